"""Optimizer state sharded across a stage's copies (``strategy.shard_optimizer``): what the planner charges for it.

ZeRO's first stage ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", Rajbhandari et al.,
§5.1, P_os) over the copies of each stage: a stage exists on the ``W`` replicas and, in a bidirectional schedule
(Chimera §3.3), on each of the replica's workers that one of its pipelines places it on, ``G = W × copies`` ranks
in all (the runtime's gradient all-reduce group, ``Topology.stage_group``; the tied embeddings: the ranks holding the
first or the last stage, ``Topology.tied_group``). Per gradient bucket of ``b`` bytes of fp32 weights:

* memory: weights ``b`` and gradients ``b`` stay whole, AdamW's two moments (``2·b``) become ``2·b / G`` (the
  padding to a multiple of ``G``, fewer than ``G`` elements, is not counted): per fp32 parameter
  ``16 → 8 + 8/G`` bytes;
* time, NCCL: the gradient is reduce-scattered where it was all-reduced (started at the same point, overlapping the
  same way) and, after the optimizer step, the parameters are all-gathered in the same group, exposed before the
  next forward. Each all-reduce algorithm the planner models is a reduce-scatter followed by an all-gather of the
  same cost (Rabenseifner's algorithm by construction, "Optimization of Collective Reduction Operations"; the ring
  of "Bandwidth optimal all-reduce algorithms for clusters of workstations", Patarasuk and Yuan; the hierarchical
  one of :mod:`pipeline_recipes.planner.network` level by level), so each costs half the all-reduce;
* time, gloo: the runtime all-reduces the gradients whole (gloo's reduce-scatter was slower than an all-reduce)
  and broadcasts each rank's slice of the parameters from it, which the planner charges as an all-gather, half
  an all-reduce, exposed;
* the optimizer step updates ``1/G`` of each bucket: its time scales with the optimizer bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pipeline_recipes.strategies.schedules import Schedule

from .model_costs import ADAMW_STATES, ModelCosts


@dataclass(frozen=True)
class ShardedBucket:
    """A gradient bucket of one worker: ``nbytes`` of weights whose optimizer state is split over ``group`` ranks."""

    nbytes: float
    group: int


def stage_members(schedule: Schedule, stage: int) -> tuple[int, ...]:
    """The workers of one replica that hold a copy of ``stage`` (one per pipeline placing it elsewhere)."""
    return tuple(sorted({row[stage] for row in schedule.placement}))


def tied_members(schedule: Schedule) -> tuple[int, ...]:
    """The workers of one replica holding the first or the last stage, where the tied weights live
    (the runtime's ``Topology.tied_group``)."""
    return tuple(sorted(set(stage_members(schedule, 0)) | set(stage_members(schedule, schedule.stages - 1))))


def worker_buckets(costs: ModelCosts, W: int, schedule: Schedule, worker: int,
                   ranges: Mapping[int, range]) -> list[ShardedBucket]:
    """The worker's weights by the group their optimizer state is sharded across: each of its stages' own weights
    (tied weights left out) over ``W × stage copies``, and each tied weight it holds, once, over
    ``W × tied holders``. Their bytes add up to the worker's distinct weight bytes."""
    stages = schedule.stages_of(worker)
    layers = {i for s in stages for i in ranges[s]}
    out = []
    for s in stages:
        own = costs.stage_param_bytes(ranges[s]) - sum(
            b * ((i in ranges[s]) + (j in ranges[s])) for i, j, b in costs.tied)
        out.append(ShardedBucket(float(own), W * len(stage_members(schedule, s))))
    held = sum(b for i, j, b in costs.tied if i in layers or j in layers)
    if held:
        out.append(ShardedBucket(float(held), W * len(tied_members(schedule))))
    return out


def optimizer_bytes(buckets: Iterable[ShardedBucket], shard: bool) -> float:
    """AdamW's state of these buckets: ``ADAMW_STATES`` fp32 moments per weight byte, over each bucket's group
    when ``shard``."""
    return sum(ADAMW_STATES * b.nbytes / (b.group if shard else 1) for b in buckets)


def optimizer_share(buckets: Sequence[ShardedBucket], shard: bool) -> float:
    """The fraction of the unsharded optimizer step the worker runs (1 without sharding)."""
    full = optimizer_bytes(buckets, False)
    return optimizer_bytes(buckets, shard) / full if shard and full > 0 else 1.0
