"""Record what every rank of a pipeline really posts, without processes or GPUs, for the NCCL replay.

:func:`record_programs` builds the real :class:`~pipeline_recipes.strategies.runtime.engine.PipelineEngine` once per rank
under torch's ``fake`` process-group backend (every collective a no-op), swaps its transport for
a :class:`RecordingComm` and runs real steps: the executor's own rounds, waits and shape headers,
and the engine's collectives (loss normalisers, gradient all-reduces, the loss), become events
(:mod:`pipeline_recipes.strategies.harness.nccl_replay`) exactly in the order the rank issues them. Receives return zeros
of the announced shape: the order of operations does not depend on the values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from pipeline_recipes.core.layout import Layout
from pipeline_recipes.strategies.runtime.engine import build_engine
from pipeline_recipes.strategies.harness.nccl_replay import P2P, Event, HostRecv, HostSend, HostWait, Post, StreamWait
from pipeline_recipes.strategies.runtime.p2p import Incoming, Outgoing


class _Recorder:
    """The events of one rank and the next operation id."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ops: list[int] = []

    def post(self, stream: Any, ops: tuple[P2P, ...] = (), collective: Any = None,
             members: tuple[int, ...] = ()) -> int:
        op = len(self.ops)
        self.ops.append(op)
        self.events.append(Post(op, stream, ops, collective, members))
        return op

    def host_sync(self) -> None:
        """``.item()`` and the like: the host waits for the device work, i.e. for every operation the
        compute stream was made to wait for (not for sends still open)."""
        waited = sorted({e.op for e in self.events if isinstance(e, StreamWait)})
        self.events += [HostWait(op) for op in waited]


class _RecordedRound:
    def __init__(self, op: int) -> None:
        self.op = op
        self.waited = False


class RecordingComm:
    """Stands in for :class:`~pipeline_recipes.strategies.runtime.p2p.PipeComm`: records rounds, waits and headers as NCCL
    would see them (batches on the rank's p2p stream, stream-ordered waits)."""

    def __init__(self, recorder: _Recorder, device: torch.device, timeout: timedelta,
                 shape_of: Callable[[int, str], tuple[torch.Size, torch.dtype]]) -> None:
        self.recorder, self.device, self.timeout, self.shape_of = recorder, device, timeout, shape_of
        self.stream_ordered = True
        self._opened = 0  # operations posted before the current step

    def post(self, sends: Sequence[Outgoing], recvs: Sequence[Incoming]) -> _RecordedRound | None:
        if not sends and not recvs:
            return None
        ops = tuple(P2P(True, o.peer, o.label) for o in sends) + tuple(P2P(False, i.peer, i.label) for i in recvs)
        posted = _RecordedRound(self.recorder.post("p2p", ops))
        for inc in recvs:
            inc.buffer = torch.zeros(inc.shape, dtype=inc.dtype, device=self.device)
            inc.round = posted  # type: ignore[assignment]
        return posted

    def wait(self, inc: Incoming) -> Tensor:
        posted = inc.round
        if posted is None or inc.buffer is None:
            raise RuntimeError(f"receive {inc.label} from rank {inc.peer} was never posted")
        if not posted.waited:  # type: ignore[union-attr]
            self.recorder.events.append(StreamWait(posted.op))  # type: ignore[union-attr]
            posted.waited = True  # type: ignore[union-attr]
        return inc.buffer

    def finish(self, keep_open: bool = False) -> None:
        """The polled end-of-step wait: every round so far, or (``keep_open``) those of earlier steps."""
        upto = self._opened if keep_open else len(self.recorder.ops)
        self.recorder.events += [HostWait(op) for op in self.recorder.ops[:upto]]
        self._opened = len(self.recorder.ops)

    def announce(self, peer: int, shape: torch.Size, dtype: torch.dtype, what: str) -> None:
        self.recorder.events.append(HostSend(peer, what))

    def learn(self, peer: int, what: str) -> tuple[torch.Size, torch.dtype]:
        self.recorder.events.append(HostRecv(peer, what))
        return self.shape_of(peer, what)


class _RecordedWork:
    def __init__(self, recorder: _Recorder, op: int) -> None:
        self.recorder, self.op = recorder, op

    def wait(self, timeout: Any = None) -> bool:
        self.recorder.events.append(StreamWait(self.op) if timeout is None else HostWait(self.op))
        return True

    def is_completed(self) -> bool:
        return True


@contextmanager
def recorded_collectives(recorder: _Recorder) -> Iterator[None]:
    """Record ``all_reduce``, ``broadcast``, ``barrier`` and the flat reduce-scatter and all-gather of a sharded
    optimizer (as NCCL would run them) while the block runs."""
    names = ("all_reduce", "broadcast", "barrier", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_gather_single", "all_gather_into_tensor")
    real = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def stream_of(group: dist.ProcessGroup | None) -> tuple[Any, tuple[int, ...]]:
        if group is None:
            return "world", tuple(range(dist.get_world_size()))
        return group.group_name, tuple(dist.get_process_group_ranks(group))

    def collective(name: str) -> Callable[..., Any]:
        def run(*args: Any, group: dist.ProcessGroup | None = None, async_op: bool = False, **kwargs: Any) -> Any:
            stream, members = stream_of(group)
            op = recorder.post(stream, collective=name, members=members)
            if name == "barrier":
                recorder.events.append(HostWait(op))
            elif not async_op:
                recorder.events.append(StreamWait(op))
            return _RecordedWork(recorder, op) if async_op else None
        return run

    try:
        for name in real:
            setattr(dist, name, collective(name))
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def record_programs(
    make_model: Callable[[], nn.Module],
    layout: Layout,
    steps: Sequence[Callable[[Any, int], Any]],
    shape_of: Callable[[int, str], tuple[torch.Size, torch.dtype]],
) -> list[list[Event]]:
    """Each rank's events: build the engine of ``layout`` on its W·D ranks, then run ``step(engine, rank)`` for every
    step (e.g. a train step and an eval step), a host synchronisation after each (the loss is read)."""
    world = layout.world_size
    programs = []
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            recorder = _Recorder()
            torch.manual_seed(0)
            with recorded_collectives(recorder):
                engine = build_engine(make_model(), layout, torch.device("cpu"), timeout_s=30.0)
                engine.executor.comm = RecordingComm(recorder, torch.device("cpu"), engine.timeout, shape_of)
                for step in steps:
                    step(engine, rank)
                    recorder.host_sync()
            programs.append(recorder.events)
        finally:
            dist.destroy_process_group()
    return programs
