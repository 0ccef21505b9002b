"""An asynchronous schedule's step loss, summed over the world and reported late (PipeDream, PipeDream-2BW).

Each rank holds a share of a step's mini-batch loss (its last stage's micro-batches; zero
elsewhere); the sum over the world is what every rank returns. Waiting for that sum in the step
that produced it would line the stages up again: without flushes the last stage finishes a step
about D - 1 forwards after the first. So step ``t`` returns the loss of step ``t - lag``,
``lag = ceil((D - 1) / N)``, whose all-reduce every rank has certainly started by then; the first
step returns its own (the pipeline fills once).

The losses of consecutive steps go in one all-reduce, ``max(1, lag // 2)`` steps at a time
(PipeDream at D = 8: one collective every third step instead of every step; PipeDream-2BW, whose
lag is one step, still one per step): each collective passes messages through every rank's
communication threads, on CPUs that the stages' own work needs (measured: the per-step loss
all-reduce cost PipeDream about 0.5 ms of a 60 ms step at D = 8 on two cores). An all-reduce starts at
the end of the last of its steps, at least ``lag - lag // 2`` steps before the first of them is
due. The last stage trails the first by (D - 1) forwards, (D - 1)·t_f, which is at most lag / 2
steps of N (t_f + t_b) when a backward takes at least a forward (Chimera §3.4: t_b ≈ 2 t_f), so
every rank has started it when the first rank waits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor


def loss_lag(stages: int, micro_batches: int) -> int:
    """Steps between an asynchronous step and the step that reports its loss (at least one)."""
    return max(1, -(-(stages - 1) // micro_batches))


def steps_per_reduction(lag: int) -> int:
    """How many consecutive steps' losses one all-reduce carries."""
    return max(1, lag // 2)


class Waitable(Protocol):
    """A started collective (``torch.distributed.Work``)."""

    def wait(self) -> Any: ...


@dataclass
class _Reduction:
    """One started all-reduce of the losses of steps ``first`` …; ``losses`` hold the sums once waited."""

    work: Waitable
    losses: Tensor
    first: int
    waited: bool = False

    def loss(self, step: int) -> Tensor:
        if not self.waited:
            self.work.wait()  # the process group's timeout guards it (as every collective's here)
            self.waited = True
        return self.losses[step - self.first]


class LateLosses:
    """This rank's loss shares of the steps not reported yet, and their all-reduces.

    Per step: :meth:`add` the step's share (it may start an all-reduce; every rank adds the same
    steps, so every rank starts the same collectives in the same order), then :meth:`report` gives
    the (loss, step) to return. :meth:`flush` (every rank, at the same step) starts what is left and
    gives the losses not reported yet. ``all_reduce(tensor)`` starts a sum over the world in place
    and returns its work.
    """

    def __init__(self, stages: int, all_reduce: Callable[[Tensor], Waitable]) -> None:
        self.stages = stages
        self.all_reduce = all_reduce
        self.reductions = 0  # all-reduces started
        self._unreduced: list[tuple[int, Tensor]] = []  # (step, this rank's share), not started yet
        self._started: deque[tuple[int, _Reduction]] = deque()  # (step, its all-reduce), not reported yet
        self._reported: tuple[Tensor, int] | None = None  # the last loss returned, and its step

    def add(self, step: int, share: Tensor, micro_batches: int) -> None:
        """Step ``step``'s share of the loss; starts the all-reduce of the steps kept once there are enough."""
        self._unreduced.append((step, share))
        if len(self._unreduced) >= steps_per_reduction(loss_lag(self.stages, micro_batches)):
            self._start()

    def report(self, step: int, micro_batches: int) -> tuple[Tensor, int]:
        """(loss, its step) to return at the end of step ``step``: the first step's own, then ``step - lag``'s."""
        if self._reported is None:
            self.flush()
        lag = loss_lag(self.stages, micro_batches)
        while self._started and self._started[0][0] <= step - lag:
            at, reduction = self._started.popleft()
            self._reported = (reduction.loss(at), at)
        if self._reported is None:
            raise RuntimeError("no asynchronous step's loss was added before report()")
        return self._reported

    def flush(self) -> list[tuple[int, Tensor]]:
        """(step, loss) of every step not reported yet, oldest first; starts the all-reduce of the
        steps not started yet (so every rank calls it at the same step) and waits for them all."""
        if self._unreduced:
            self._start()
        out = []
        while self._started:
            at, reduction = self._started.popleft()
            out.append((at, reduction.loss(at)))
            self._reported = (out[-1][1], at)
        return out

    def _start(self) -> None:
        steps = [step for step, _ in self._unreduced]
        losses = torch.stack([share for _, share in self._unreduced])
        reduction = _Reduction(self.all_reduce(losses), losses, steps[0])
        self.reductions += 1
        self._started.extend((step, reduction) for step in steps)
        self._unreduced.clear()
