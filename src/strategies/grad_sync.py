"""Gradient synchronisation across stage copies (Chimera §3.2–3.3, Figure 4).

The gradients of every stage are summed over all its copies (the W replicas, and for Chimera
also the 2f pipelines) with one flat, non-blocking all-reduce per stage copy; with ``end``, the
buckets copied on the same ranks (a Chimera worker's stages, the tied embeddings) are fused into one
all-reduce. Losses are normalised over the whole mini-batch, so the sum is the mini-batch
gradient. Tied parameters (shared by the first and the last stage) are summed over the tied group
instead, so they get the gradient of both uses; their all-reduce starts once every local stage holding them is done.

When each all-reduce starts is the ``grad_sync`` mode (§3.2):

* ``end``: all of them after this rank's last backward (Figure 4a).
* ``eager``: a stage copy's all-reduce as soon as its last backward on this rank is done, so it
  overlaps the rank's remaining computation and bubbles (Figure 4b).
* ``eager_opt``: eager only for stage copies whose last backward is followed by a bubble on this
  rank (the first and the last stages in Chimera); the others wait for the end, as the paper
  advises, because an early non-blocking collective can slow the computation it overlaps.

Which backward is a stage copy's last, and whether a bubble follows it, is read off the schedule
data (:func:`launch_plan`), never hard-coded. Every all-reduce is waited before the step returns
(blocking all-reduces on different groups could wait on each other; async ones cannot).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .schedules import Action, Schedule, simulate

GRAD_SYNC_MODES = ("end", "eager", "eager_opt")


def last_backwards(schedule: Schedule, worker: int) -> dict[int, Action]:
    """Stage → the last backward action of that stage copy in ``worker``'s order."""
    last: dict[int, Action] = {}
    for action in schedule.workers[worker]:
        if action.kind == "B":
            last[action.stage] = action
    return last


def bubble_after(schedule: Schedule, worker: int, t_f: float = 1.0, t_b: float = 2.0) -> dict[int, float]:
    """Stage → idle time on ``worker`` between that stage copy's last backward and the worker's end.

    Measured on the simulated timeline (:func:`strategies.schedules.simulate`) at the given
    per-micro-batch costs (backward twice the forward by default, §3.4).
    """
    row = simulate(schedule, t_f, t_b).timeline[worker]
    if not row:
        return {}
    finish = row[-1].end
    out: dict[int, float] = {}
    for stage, action in last_backwards(schedule, worker).items():
        index = next(i for i, t in enumerate(row) if t.action == action)
        work_after = sum(t.end - t.start for t in row[index + 1 :])
        out[stage] = max(finish - row[index].end - work_after, 0.0)
    return out


def launch_plan(
    schedule: Schedule, worker: int, mode: str, t_f: float = 1.0, t_b: float = 2.0
) -> dict[Action, tuple[int, ...]]:
    """Backward action → the local stages whose all-reduce starts right after it.

    ``end`` gives an empty plan (everything starts after the last action); ``eager`` maps each
    stage copy's last backward to its stage; ``eager_opt`` keeps only those followed by a bubble.
    """
    if mode not in GRAD_SYNC_MODES:
        raise ValueError(f"grad_sync must be one of {', '.join(GRAD_SYNC_MODES)}, got {mode!r}")
    if mode == "end":
        return {}
    last = last_backwards(schedule, worker)
    if mode == "eager_opt":
        idle = bubble_after(schedule, worker, t_f, t_b)
        last = {s: a for s, a in last.items() if idle.get(s, 0.0) > 1e-9}
    plan: dict[Action, list[int]] = {}
    for stage, action in last.items():
        plan.setdefault(action, []).append(stage)
    return {a: tuple(sorted(stages)) for a, stages in plan.items()}


class GradientSynchronizer:
    """One flat all-reduce per local stage copy (plus the tied group), launched on request.

    Per step: :meth:`launch` any stage whose gradients are final (eager modes), then
    :meth:`finish` launches the rest and waits for all, writing the sums back into ``.grad``.

    With ``shared`` groups, :meth:`finish` fuses what is left into one all-reduce per set of member
    ranks: in Chimera every stage a worker holds (and the tied embeddings) is copied on the same
    ranks, so a worker's whole gradient goes in one collective instead of one per stage (on gloo a
    collective costs a few milliseconds however small). Fusing is only safe when no member launched
    any of the fused buckets early, so the engine passes ``shared`` with ``grad_sync=end`` only.
    ``last_buckets`` lists the buckets of the last step's all-reduces (one tuple of keys each).
    """

    def __init__(
        self,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        stage_groups: Mapping[int, dist.ProcessGroup | None],
        tied_params: Sequence[nn.Parameter],
        tied_group: dist.ProcessGroup | None,
        timeout: timedelta,
        shared: Mapping[int | str, dist.ProcessGroup] | None = None,
    ) -> None:
        tied_ids = {id(p) for p in tied_params}
        self.buckets = {s: [p for p in ps if id(p) not in tied_ids] for s, ps in stage_params.items()}
        self.stage_groups = stage_groups
        self.tied_params = list(tied_params)
        self.tied_group = tied_group
        self.timeout = timeout
        self.shared = dict(shared or {})
        # the local stages whose layers hold a tied parameter: the tied sum waits for all of them
        self.tied_stages = frozenset(s for s, ps in stage_params.items() if any(id(p) in tied_ids for p in ps))
        self._launched: set[int | str] = set()
        self._works: list[tuple[dist.Work, torch.Tensor, Sequence[nn.Parameter]]] = []
        self._started: list[tuple[int | str, ...]] = []
        self.last_buckets: list[tuple[int | str, ...]] = []

    def launch(self, stage: int) -> None:
        """Start the all-reduce of ``stage``'s gradients (its last local backward is done)."""
        if stage in self._launched:
            return
        self._launched.add(stage)
        group = self.stage_groups.get(stage)
        if group is not None and self.buckets.get(stage):
            self._start((stage,), self.buckets[stage], group)
        if self.tied_stages and self.tied_stages <= self._launched:
            self._launch_tied()

    def finish(self, tied: bool = True) -> None:
        """Launch what is left (fused per shared group), wait for every all-reduce, copy the sums into
        ``.grad``; ``tied=False`` leaves the tied group out (an asynchronous step where no tied
        gradient is due)."""
        if not tied:
            self._launched.add("tied")
        left: list[int | str] = [s for s in sorted(self.buckets) if s not in self._launched]
        if "tied" not in self._launched:
            left.append("tied")
        fused: dict[int, list[int | str]] = {}
        for key in left:
            if key in self.shared:
                fused.setdefault(id(self.shared[key]), []).append(key)
        for keys in fused.values():
            if len(keys) > 1:
                params = [p for key in keys for p in self._params_of(key)]
                self._launched.update(keys)
                if params:
                    self._start(tuple(keys), params, self.shared[keys[0]])
        for key in left:
            if key == "tied":
                self._launch_tied()
            else:
                self.launch(key)
        works, self._works = self._works, []
        self.last_buckets, self._started = self._started, []
        self._launched.clear()
        for work, flat, params in works:
            work.wait()  # NCCL: stream-ordered (the group's timeout is the guard); gloo: up to that timeout
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))
                offset += n

    def sync(self) -> None:
        """Everything at once, after the last backward (``grad_sync="end"``)."""
        self.finish()

    def _params_of(self, key: int | str) -> Sequence[nn.Parameter]:
        if key == "tied":
            return self.tied_params if self.tied_group is not None else []
        return self.buckets[key] if self.stage_groups.get(key) is not None else []

    def _launch_tied(self) -> None:
        if "tied" in self._launched:
            return
        self._launched.add("tied")
        if self.tied_group is not None and self.tied_params:
            self._start(("tied",), self.tied_params, self.tied_group)

    def _start(self, keys: tuple[int | str, ...], params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self._started.append(keys)
        self._works.append((dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), flat, params))
