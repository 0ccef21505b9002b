"""The next training batch read in the pipeline's bubble (:mod:`strategies.fetch_ahead`) and the
transport's idle hook that triggers it (:meth:`strategies.p2p.PipeComm.when_idle`): pure Python, no
processes. The multi-process jobs (tests/test_lightning_strategy.py, tests/test_train_e2e.py) run
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

from pipeline_recipes.strategies.fetch_ahead import FetchAhead, fetch_during_waits


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
    def __init__(self, log: list[str], name: str, completed: bool) -> None:
        self.log, self.name, self.completed = log, name, completed

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout=None) -> bool:
        self.log.append(f"wait {self.name}")
        return True


def test_the_idle_work_runs_once_at_the_first_receive_that_would_block(monkeypatch) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pipeline_recipes.strategies.p2p import Incoming, PipeComm

    log: list[str] = []
    pending: list[list[_Work]] = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: pending.pop(0))
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        comm = PipeComm(torch.device("cpu"), datetime.timedelta(seconds=5), None, None)

        def receive(completed: bool, name: str) -> None:
            pending.append([_Work(log, name, completed)])
            inc = Incoming(1, torch.Size((2,)), torch.float32, name)
            comm.post([], [inc])
            comm.wait(inc)

        comm.when_idle(lambda: log.append("idle"))
        receive(True, "a")  # arrived already: no idle time
        receive(False, "b")
        receive(False, "c")  # once per step
        comm.finish()
        assert log == ["wait a", "idle", "wait b", "wait c"]

        log.clear()
        comm.when_idle(lambda: log.append("idle"))
        comm.finish()  # a step without a blocking receive drops it
        receive(False, "d")
        comm.when_idle(lambda: log.append("idle"))
        comm.stream_ordered = True  # NCCL: the host never waits for a receive
        receive(False, "e")
        assert log == ["wait d", "wait e"]
    finally:
        dist.destroy_process_group()
