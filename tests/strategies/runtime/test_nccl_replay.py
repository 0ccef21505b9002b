"""The runtime's real op sequence, replayed under NCCL's rules (strategies.nccl_replay).

Each rank's engine runs against a recording transport under torch's ``fake`` backend
(strategies.recording): rounds, stream-ordered waits, shape headers and collectives are recorded in
the order the rank issues them, then replayed with one FIFO per (rank, stream), batched ops
completing together, rendezvous sends, no tags and collectives on their group's stream. Covers
every schedule of the registry (tests/support/schedule_grids.py) × D × N (below, at and above D) × the choices
its spec offers, the first step (shape headers) and a steady one, training and evaluation, W = 2, and
asynchronous windows.
"""

from __future__ import annotations

import pytest
import torch

from pipeline_recipes.strategies.harness.nccl_replay import P2P, HostWait, Post, ReplayError, StreamWait, replay
from pipeline_recipes.strategies.harness.recording import record_programs
from layouts import pipeline_layout
from schedule_grids import async_replay_cases, replay_cases, replica_cases
from toy_model import ToyMLP, toy_batches

B, WIDTH = 2, 4


def _shape(peer: int, what: str) -> tuple[torch.Size, torch.dtype]:
    return torch.Size((B, WIDTH)), torch.float32


def _programs(schedule: str, D: int, N: int, W: int = 1, *, pipelines: int | None = None, concat: str = "direct",
              train_steps: int = 2, evaluate: bool = True, tied: bool = False, grad_sync: str = "end",
              recompute: str = "none", chunks: int | None = None, shard_optimizer: bool = False) -> list:
    layout = pipeline_layout(schedule, D, B, N, W, pipelines=pipelines, concat=concat, grad_sync=grad_sync,
                             recompute=recompute, chunks=chunks, shard_optimizer=shard_optimizer)
    batches = toy_batches(train_steps + 1, W * N * B, width=WIDTH)

    def mine(rank: int, batch: dict, engine) -> dict:
        r = engine.topology.replica_of(rank)
        return {k: v[r * N * B:(r + 1) * N * B] for k, v in batch.items()}

    def train(engine, rank: int, batch: dict) -> None:
        engine.train_step(mine(rank, batch, engine))
        engine.synchronizer.gather_parameters()  # what the optimizer's step ends with (sharded state; else nothing)

    steps = [lambda engine, rank, b=b: train(engine, rank, b) for b in batches[:train_steps]]
    if evaluate:
        steps.append(lambda engine, rank: engine.eval_step(mine(rank, batches[-1], engine)))
    layers = max(layout.stages, 4)
    return record_programs(lambda: ToyMLP(layers=layers, width=WIDTH, tied=tied), layout, steps, _shape)


def _id(case: tuple) -> str:
    name, D, N, options = case
    return "-".join([name, str(D), str(N), *(str(v) for v in options.values())])


@pytest.mark.parametrize("case", replay_cases(), ids=_id)
@pytest.mark.slow
def test_every_schedule_completes_under_nccl_rules(case: tuple) -> None:
    """Every synchronous schedule of the registry × D ∈ {2, 3, 4, 8} × N below, at and above D × each
    choice it offers (pipelines, concatenation, chunks): several stages per worker (local messages), split
    backwards and overlapped pairs included."""
    name, D, N, options = case
    replay(_programs(name, D, N, **options))


@pytest.mark.parametrize("case", [
    {"schedule": "chimera", "D": 4, "N": 4, "W": 2, "tied": True, "grad_sync": "eager"},
    {"schedule": "zbv", "D": 2, "N": 4, "W": 2, "tied": True, "grad_sync": "eager", "recompute": "always"},
    {"schedule": "interleaved_1f1b", "D": 2, "N": 4, "W": 2, "grad_sync": "eager_opt"},
    {"schedule": "dualpipev", "D": 2, "N": 4, "W": 2, "tied": True},
    {"schedule": "dapple", "D": 2, "N": 3, "W": 2, "grad_sync": "eager_opt", "recompute": "always"},
    {"schedule": "gpipe", "D": 4, "N": 4, "W": 2, "tied": True},
    {"schedule": "chimera", "D": 2, "N": 4, "W": 2, "concat": "backward_halving", "grad_sync": "eager"},
])
def test_replicas_eager_sync_and_recomputation_complete_under_nccl_rules(case: dict) -> None:
    replay(_programs(**case))


@pytest.mark.parametrize("case", replica_cases(), ids=lambda c: f"{c['schedule']}-{c['D']}-{c['N']}")
def test_every_schedule_with_replicas_and_tied_weights_completes_under_nccl_rules(case: dict) -> None:
    """W = 2, tied ends, gradients reduced as soon as they are final: the collectives of each schedule of
    the registry interleaved with its messages."""
    replay(_programs(**case, W=2, tied=True, grad_sync="eager"))


@pytest.mark.parametrize("name, D, N", async_replay_cases())
def test_asynchronous_windows_complete_under_nccl_rules(name: str, D: int, N: int) -> None:
    """Five consecutive windows (the fill and steady steps), an evaluation between them: messages
    crossing a step boundary never leave a receive in front of the step's collectives."""
    replay(_programs(name, D, N, train_steps=5))


@pytest.mark.parametrize("case", [
    {"schedule": "chimera", "D": 4, "N": 4, "W": 2, "tied": True},
    {"schedule": "chimera", "D": 2, "N": 4, "W": 2, "tied": True, "grad_sync": "eager"},
    {"schedule": "dapple", "D": 2, "N": 3, "W": 2, "tied": True, "grad_sync": "eager_opt"},
    {"schedule": "zbv", "D": 2, "N": 4, "W": 2, "tied": True, "grad_sync": "eager"},
    {"schedule": "gpipe", "D": 1, "N": 2, "W": 4},
], ids=lambda c: "-".join(str(v) for v in c.values()))
def test_sharded_optimizer_collectives_complete_under_nccl_rules(case: dict) -> None:
    """strategy.shard_optimizer: each bucket's reduce-scatter where its all-reduce was (at the end or eagerly,
    between the schedule's messages) and its parameters' all-gather after the step, on the bucket's group."""
    programs = _programs(**case, shard_optimizer=True)
    posted = {e.collective for program in programs for e in program if isinstance(e, Post) and e.collective}
    assert posted >= {"reduce_scatter_single", "all_gather_single"} or posted >= {"reduce_scatter_tensor",
                                                                                  "all_gather_into_tensor"}
    replay(programs)


# -- the replay itself, on hand-written programs (the expected outcome is known by construction) --

def _round(op: int, *ops: P2P) -> list:
    return [Post(op, "p2p", ops), StreamWait(op)]


def test_replay_catches_a_receive_posted_before_the_send_its_peer_waits_for() -> None:
    """1F1B at D = 2 with the receive of the gradient posted ahead of the activation's send."""
    rank0 = _round(0, P2P(False, 1, "grad0")) + _round(1, P2P(True, 1, "act0")) + [HostWait(0), HostWait(1)]
    rank1 = _round(0, P2P(False, 0, "act0")) + _round(1, P2P(True, 0, "grad0")) + [HostWait(0), HostWait(1)]
    with pytest.raises(ReplayError, match="deadlock"):
        replay([rank0, rank1])


def test_replay_catches_two_peers_that_both_send_first() -> None:
    rank0 = _round(0, P2P(True, 1, "a")) + _round(1, P2P(False, 1, "b")) + [HostWait(1)]
    rank1 = _round(0, P2P(True, 0, "b")) + _round(1, P2P(False, 0, "a")) + [HostWait(1)]
    with pytest.raises(ReplayError, match="deadlock"):
        replay([rank0, rank1])
    batched0 = _round(0, P2P(True, 1, "a"), P2P(False, 1, "b")) + [HostWait(0)]
    batched1 = _round(0, P2P(True, 0, "b"), P2P(False, 0, "a")) + [HostWait(0)]
    replay([batched0, batched1])


def test_replay_catches_swapped_messages_without_tags() -> None:
    rank0 = _round(0, P2P(True, 1, "mb0"), P2P(True, 1, "mb1"))
    rank1 = _round(0, P2P(False, 0, "mb1"), P2P(False, 0, "mb0"))
    with pytest.raises(ReplayError, match="expects mb1"):
        replay([rank0, rank1])


def test_replay_catches_a_receive_in_front_of_a_collective_on_the_same_stream() -> None:
    """A receive whose send comes after the peer's all-reduce, queued before this rank's all-reduce."""
    rank0 = [Post(0, "world", (P2P(False, 1, "x"),)), Post(1, "world", collective="sum", members=(0, 1)),
             HostWait(1)]
    rank1 = [Post(0, "world", collective="sum", members=(0, 1)), HostWait(0), Post(1, "world", (P2P(True, 0, "x"),))]
    with pytest.raises(ReplayError, match="deadlock"):
        replay([rank0, rank1])


def test_the_transport_posts_every_message_untagged_in_one_batch_per_round(monkeypatch) -> None:
    """NCCL ignores tags: the runtime never relies on them (gloo then matches first in, first out too),
    and a round's sends and receives go out together."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pipeline_recipes.strategies.runtime.p2p import Incoming, Outgoing, PipeComm

    batches: list[list] = []
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: batches.append(list(ops)) or [])
        comm = PipeComm(torch.device("cpu"), __import__("datetime").timedelta(seconds=5), None, None)
        comm.post([Outgoing(1, torch.ones(2, 4), "act0")], [Incoming(1, torch.Size((2, 4)), torch.float32, "grad0")])
        comm.post([Outgoing(1, torch.ones(2, 4), "act1")], [])
    finally:
        dist.destroy_process_group()
    assert [len(ops) for ops in batches] == [2, 1]
    assert all(op.tag == 0 for ops in batches for op in ops)
    assert [op.op.__name__ for op in batches[0]] == ["isend", "irecv"]
