"""The next training batch read in the pipeline's bubble (:mod:`strategies.fetch_ahead`), and where
that is: the longest simulated wait of a worker, if the host waits there
(:meth:`strategies.executor.StageExecutor.run`, :meth:`strategies.p2p.PipeComm.would_block`). Pure
Python, no processes. The multi-process jobs (tests/strategies/lightning/test_lightning_strategy.py, tests/e2e/test_train_e2e.py) run
every pipeline step with it and compare their parameters with a single process on the same data."""

from __future__ import annotations

import datetime
import random
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader, Dataset

from pipeline_recipes.strategies.runtime.fetch_ahead import FetchAhead, fetch_during_waits


class _CountedItems(Dataset):
    """Items 0..n-1, counting how many were read."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads += 1
        return torch.tensor(i)


def _fetcher(n: int, batch: int) -> tuple[_PrefetchDataFetcher, _CountedItems]:
    items = _CountedItems(n)
    fetcher = _PrefetchDataFetcher()
    fetcher.setup(CombinedLoader(DataLoader(items, batch_size=batch), "max_size_cycle"))
    iter(fetcher)
    return fetcher, items


def _drain(fetcher, ahead_at: set[int] = frozenset()) -> list[tuple[list[int], int, bool]]:
    """(batch, batch_idx, done) of every batch until ``done``, reading ahead before the steps in ``ahead_at``."""
    out, step = [], 0
    while not fetcher.done:
        batch, batch_idx, _ = next(fetcher)
        out.append((batch.tolist(), batch_idx, fetcher.done))
        if step in ahead_at:
            fetcher.fetch_ahead()
            fetcher.fetch_ahead()  # a second call reads nothing more
        step += 1
    return out


@pytest.mark.parametrize("n, batch", [(10, 2), (7, 3), (4, 4)])
def test_reading_ahead_yields_lightnings_batches_in_order_and_ends_the_epoch_alike(n: int, batch: int) -> None:
    expected = _drain(_fetcher(n, batch)[0])  # Lightning's own fetcher, the independent reference
    steps = len(expected)
    for ahead_at in [set(range(steps)), set(), set(random.Random(n).sample(range(steps), steps // 2))]:
        plain, items = _fetcher(n, batch)
        fetcher = FetchAhead.take_over(plain)
        assert _drain(fetcher, ahead_at) == expected
        fetcher.fetch_ahead()
        assert items.reads == n  # every item once, never past the epoch's end


def test_take_over_continues_mid_epoch_and_reset_drops_a_batch_read_ahead() -> None:
    plain, items = _fetcher(8, 2)
    first = next(plain)[0].tolist()
    fetcher = FetchAhead.take_over(plain)
    fetcher.fetch_ahead()
    assert items.reads == 4 and next(fetcher)[0].tolist() == [2, 3] and first == [0, 1]
    fetcher.fetch_ahead()
    fetcher.reset()  # the loop stopped (max_steps) or the epoch restarts: the batch read ahead is dropped
    assert fetcher._ahead is None and fetcher.fetched == 0


def _trainer_with(fetcher) -> SimpleNamespace:
    return SimpleNamespace(fit_loop=SimpleNamespace(_data_fetcher=fetcher))


def test_the_engine_reads_ahead_only_for_the_loop_s_current_fetcher_of_known_length() -> None:
    engine = SimpleNamespace(idle_work=None)
    plain, items = _fetcher(6, 2)
    trainer = _trainer_with(plain)
    assert fetch_during_waits(trainer, engine)
    fetcher = trainer.fit_loop._data_fetcher
    assert isinstance(fetcher, FetchAhead)
    engine.idle_work()
    assert items.reads == 2 and next(fetcher)[0].tolist() == [0, 1]
    trainer.fit_loop._data_fetcher, reads = _fetcher(6, 2)[0], items.reads  # reload_dataloaders_every_n_epochs
    engine.idle_work()
    assert items.reads == reads  # the replaced fetcher's iterator is left alone

    unsized = SimpleNamespace(idle_work=lambda: None)
    fetcher = _PrefetchDataFetcher()
    fetcher.length = None  # an iterable without length: Lightning's prefetching decides when the epoch ends
    assert not fetch_during_waits(_trainer_with(fetcher), unsized) and unsized.idle_work is None
    assert not fetch_during_waits(_trainer_with(None), unsized)  # limit_train_batches=0: no fetcher


class _Work:
    def __init__(self, completed: bool) -> None:
        self.completed = completed

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout=None) -> bool:
        self.completed = True
        return True


def test_the_transport_says_whether_a_receive_would_block_the_host(monkeypatch) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pipeline_recipes.strategies.runtime.p2p import Incoming, PipeComm

    pending: list[list[_Work]] = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: pending.pop(0))
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        comm = PipeComm(torch.device("cpu"), datetime.timedelta(seconds=5), None, None)

        def posted(completed: bool) -> Incoming:
            pending.append([_Work(completed)])
            inc = Incoming(1, torch.Size((2,)), torch.float32)
            comm.post([], [inc])
            return inc

        arrived, underway = posted(True), posted(False)
        assert not comm.would_block(arrived) and comm.would_block(underway)
        comm.wait(underway)
        assert not comm.would_block(underway)  # received
        comm.stream_ordered = True  # NCCL: the compute stream waits, the host goes on
        assert not comm.would_block(posted(False))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("D", [2, 3, 4, 5])
@pytest.mark.parametrize("per_stage", [1, 2])
def test_a_1f1b_stage_waits_longest_before_its_first_forward_or_first_backward(D: int, per_stage: int) -> None:
    """DAPPLE (1F1B, Chimera §2) at t_b = 2 t_f: stage s starts its first forward after s·t_f; its D - s
    warm-up forwards end at D·t_f, and the first backward reaches it (D - 1 - s)·t_b later."""
    from pipeline_recipes.strategies.schedules import build_schedule, simulate

    N = D * per_stage
    schedule = build_schedule("dapple", D, N)
    simulation = simulate(schedule, t_f=1.0, t_b=2.0)
    for s in range(D):
        before_forward, before_backward = float(s), 2.0 * (D - 1 - s)
        i, wait = simulation.longest_wait(s)
        assert wait == max(before_forward, before_backward)
        first_backward = next(k for k, a in enumerate(schedule.workers[s]) if a.kind == "B")
        assert i == (0 if before_forward >= before_backward else first_backward)


def test_the_executor_reads_ahead_in_the_longest_bubble_of_at_least_one_forward() -> None:
    from pipeline_recipes.strategies.runtime.executor import StageExecutor
    from pipeline_recipes.strategies.schedules import build_schedule

    def idle_point(schedule, worker):
        actions = schedule.workers[worker]
        i = StageExecutor._idle_point(SimpleNamespace(worker=worker, _idle_points={}), schedule, actions)
        return None if i is None else actions[i]

    dapple = build_schedule("dapple", 2, 4)
    assert str(idle_point(dapple, 0)) == "0B0"  # waits 2 t_f for the first backward
    assert str(idle_point(dapple, 1)) == "1F0"  # waits t_f for the first forward's activation
    chimera = build_schedule("chimera", 2, 4)  # two pipelines in opposite directions fill each other's bubbles
    assert [idle_point(chimera, w) for w in (0, 1)] == [None, None]
