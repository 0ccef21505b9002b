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

With ``strategy.shard_optimizer`` each bucket's sum goes to one slice per rank of its group instead of every rank
(a reduce-scatter, started at the same points), and each rank's optimizer steps its slice
(:mod:`pipeline_recipes.strategies.runtime.optimizer_shards`).

Which backward is a stage copy's last, and whether a bubble follows it, is read off the schedule
data (:func:`launch_plan`), never hard-coded. Every all-reduce is waited before the step returns
(blocking all-reduces on different groups could wait on each other; async ones cannot). A peer lost during one
(dead, or hung before it) is named like a lost p2p peer: which rank, closed or timed out, after how long since the
all-reduce started (:mod:`pipeline_recipes.strategies.runtime.collectives`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from pipeline_recipes.strategies.runtime.collectives import wait_collective
from pipeline_recipes.strategies.runtime.optimizer_shards import BucketShard
from pipeline_recipes.strategies.schedules import Action, Schedule, simulate
from pipeline_recipes.strategies.schedules.rules import GRAD_SYNC_MODES



def last_backwards(schedule: Schedule, worker: int) -> dict[int, Action]:
    """Stage → the last backward action of that stage copy in ``worker``'s order."""
    last: dict[int, Action] = {}
    for action in schedule.workers[worker]:
        if action.completes_weight_gradient:
            last[action.stage] = action
    return last


def bubble_after(schedule: Schedule, worker: int, t_f: float = 1.0, t_b: float = 2.0) -> dict[int, float]:
    """Stage → idle time on ``worker`` between that stage copy's last backward and the worker's end.

    Measured on the simulated timeline (:func:`pipeline_recipes.strategies.schedules.simulate`) at the given
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


@dataclass
class _Bucket:
    """Parameters all-reduced together, their gradients views of one flat buffer (no copy per step)."""

    keys: tuple[int | str, ...]
    params: list[nn.Parameter]
    group: dist.ProcessGroup
    flat: torch.Tensor | None = None
    shard: BucketShard | None = None  # strategy.shard_optimizer: the parameters' flat buffer and this rank's slice

    def views(self) -> list[torch.Tensor]:
        if self.flat is None:
            p0 = self.params[0]
            numel = self.shard.padded if self.shard is not None else sum(p.numel() for p in self.params)
            self.flat = torch.zeros(numel, dtype=p0.dtype, device=p0.device)
        out, offset = [], 0
        for p in self.params:
            out.append(self.flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def describe(self) -> str:
        """``stage 2``, ``stages 0, 3 and the tied parameters``: what the bucket holds, for messages."""
        stages = [str(k) for k in self.keys if k != "tied"]
        said = [f"stage{'s' if len(stages) > 1 else ''} {', '.join(stages)}"] if stages else []
        return " and ".join(said + (["the tied parameters"] if "tied" in self.keys else []))

    def install(self) -> None:
        """Zero the buffer and make every ``.grad`` a view of it: backward accumulates in place."""
        for p, view in zip(self.params, self.views()):
            view.zero_()
            p.grad = view

    def pack(self) -> None:
        """Gradients set elsewhere (stashed weight versions) move into the buffer; a parameter without
        a gradient adds zeros and keeps none (the optimizer leaves it alone)."""
        for p, view in zip(self.params, self.views()):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view


class GradientSynchronizer:
    """One flat all-reduce per bucket of local stage copies (plus the tied group), launched on request.

    Per step: :meth:`zero_grad` before the first backward, :meth:`launch` any stage whose gradients
    are final (eager modes), then :meth:`finish` launches the rest and waits for all.

    Buckets: with ``shared`` groups (``grad_sync=end``) the stages copied on the same ranks are one
    bucket: in Chimera every stage a worker holds (and the tied embeddings) is copied on the same
    ranks, so a worker's whole gradient goes in one collective instead of one per stage (on gloo a
    collective costs a few milliseconds however small); otherwise one bucket per stage and one for
    the tied parameters. Every gradient is a view of its bucket's flat buffer, as in DDP's
    gradient-as-bucket-view: the all-reduce runs in place and no gradient-sized copy is made per
    step. ``last_buckets`` lists the buckets of the last step's all-reduces (one tuple of keys each).

    ``shard``: the optimizer state is sharded across each bucket's group
    (:mod:`pipeline_recipes.strategies.runtime.optimizer_shards`): each bucket's parameters move into a flat buffer
    (a :class:`~pipeline_recipes.strategies.runtime.optimizer_shards.BucketShard`), its gradient is summed into this
    rank's slice instead of everywhere, and :meth:`gather_parameters` brings the updated slices back after the
    optimizer step.
    """

    def __init__(
        self,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        stage_groups: Mapping[int, dist.ProcessGroup | None],
        tied_params: Sequence[nn.Parameter],
        tied_group: dist.ProcessGroup | None,
        timeout: timedelta,
        shared: Mapping[int | str, dist.ProcessGroup] | None = None,
        shard: bool = False,
    ) -> None:
        tied_ids = {id(p) for p in tied_params}
        self.buckets = {s: [p for p in ps if id(p) not in tied_ids] for s, ps in stage_params.items()}
        self.stage_groups = stage_groups
        self.tied_params = list(tied_params)
        self.tied_group = tied_group
        self.timeout = timeout
        shared = dict(shared or {})
        # the local stages whose layers hold a tied parameter: the tied sum waits for all of them
        self.tied_stages = frozenset(s for s, ps in stage_params.items() if any(id(p) in tied_ids for p in ps))
        self._bucket_of: dict[int | str, _Bucket] = {}
        keys: list[int | str] = sorted(self.buckets) + ["tied"]
        for key in keys:
            if key in self._bucket_of or not self._params_of(key):
                continue
            if key in shared:
                fused = [k for k in keys if shared.get(k) is shared[key] and self._params_of(k)]
                bucket = _Bucket(tuple(fused), [p for k in fused for p in self._params_of(k)], shared[key])
            else:
                group = self.tied_group if key == "tied" else self.stage_groups[key]
                bucket = _Bucket((key,), list(self._params_of(key)), group)
            if len({(p.dtype, p.device) for p in bucket.params}) > 1:
                raise ValueError(f"gradient bucket {bucket.keys} mixes dtypes or devices: keep a stage's parameters "
                                 "in one dtype on one device")
            if shard:
                bucket.shard = BucketShard(bucket.params, bucket.group)
            for k in bucket.keys:
                self._bucket_of[k] = bucket
        self._launched: set[int | str] = set()
        self._works: list[tuple[dist.Work, _Bucket, float]] = []  # (all-reduce, its bucket, when it started)
        self._started: list[tuple[int | str, ...]] = []
        self.last_buckets: list[tuple[int | str, ...]] = []

    def _distinct_buckets(self) -> list[_Bucket]:
        return list({id(b): b for b in self._bucket_of.values()}.values())

    def buffers(self) -> list[torch.Tensor]:
        """The buckets' flat gradient buffers allocated so far (kept across steps)."""
        return [b.flat for b in self._distinct_buckets() if b.flat is not None]

    @property
    def shards(self) -> list[BucketShard]:
        """The sharded buckets (``shard``), each once; empty without sharding."""
        return [b.shard for b in self._distinct_buckets() if b.shard is not None]

    def drop_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """No gradient for ``params`` nor for their shards' segments: the optimizer leaves them alone."""
        for p in params:
            p.grad = None
        for shard in self.shards:
            shard.drop_gradients()

    def zero_grad(self, params: Sequence[nn.Parameter]) -> None:
        """Before a step: bucketed gradients become zeroed views of their buffers, the others ``None``."""
        self.drop_gradients(params)
        for bucket in self._distinct_buckets():
            bucket.install()

    def gather_parameters(self) -> None:
        """After the optimizer stepped this rank's slices: every bucket's parameters whole again (all gathers
        started, then waited for)."""
        works = [(work, shard, time.monotonic()) for shard in self.shards for work in shard.gather()]
        for work, shard, started in works:
            wait_collective(work, shard.group, "the parameter all-gather of a sharded optimizer", started,
                            self.timeout)

    def launch(self, stage: int) -> None:
        """Start the all-reduce of ``stage``'s gradients (its last local backward is done)."""
        if stage in self._launched:
            return
        self._launched.add(stage)
        self._start_bucket_of(stage)
        if self.tied_stages and self.tied_stages <= self._launched:
            self._launched.add("tied")
            self._start_bucket_of("tied")

    def finish(self, tied: bool = True) -> None:
        """Launch what is left, wait for every all-reduce (the sums are then in ``.grad``);
        ``tied=False`` leaves the tied group out (an asynchronous step where no tied gradient is due)."""
        if not tied:
            self._launched.add("tied")
        for key in [*sorted(self.buckets), "tied"]:
            if key not in self._launched:
                self._launched.add(key)
                self._start_bucket_of(key)
        works, self._works = self._works, []
        self.last_buckets, self._started = self._started, []
        self._launched.clear()
        for work, bucket, started in works:  # NCCL: stream-ordered (the group's timeout is the guard); gloo: up to it
            wait_collective(work, bucket.group, f"the gradient all-reduce of {bucket.describe()}", started,
                            self.timeout)
            if bucket.shard is not None:
                bucket.shard.hand_over(bucket.flat)

    def sync(self) -> None:
        """Everything at once, after the last backward (``grad_sync="end"``)."""
        self.finish()

    def _params_of(self, key: int | str) -> Sequence[nn.Parameter]:
        if key == "tied":
            return self.tied_params if self.tied_group is not None else []
        return self.buckets[key] if self.stage_groups.get(key) is not None else []

    def _start_bucket_of(self, key: int | str) -> None:
        bucket = self._bucket_of.get(key)
        if bucket is None or bucket.keys in self._started:
            return
        if len(bucket.keys) > 1 and not set(bucket.keys) <= self._launched:
            return  # a fused bucket goes once all its keys are final
        bucket.pack()
        self._started.append(bucket.keys)
        work = (bucket.shard.reduce(bucket.flat) if bucket.shard is not None else
                dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=bucket.group, async_op=True))
        self._works.append((work, bucket, time.monotonic()))
