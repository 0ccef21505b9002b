"""Recommend a layout: predict every candidate, rank by throughput among those that fit (Chimera §3.4).

:func:`plan_all` predicts iteration time (:mod:`pipeline_recipes.planner.predict`) and peak memory per rank
(:mod:`pipeline_recipes.planner.memory`) for every candidate of :func:`pipeline_recipes.planner.predict.candidates`,
marks whether it fits the memory budget, and sorts: fitting layouts first, by predicted samples/s. :func:`plan_rows`
gives the JSON rows of ``scripts/plan.py --json``; :func:`best_config` the top one as Hydra
overrides (for a future ``strategy=auto``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from pipeline_recipes.strategies.schedules.rules import DEFAULT_GRAD_SYNC, GRAD_SYNC_MODES

from .costs import format_bytes
from .memory import Budget, MemoryPrediction, predict_memory
from .model_costs import ModelCosts
from .partition_search import recommend_partition
from .parallel import map_grouped, map_groups, planner_pool, workers_for
from .predict import (
    RECOMPUTE, SHARDING, Candidate, TimePrediction, candidates, partition_for, predict_time, stage_costs, time_split,
)

JSON_KEYS = ("strategy", "W", "D", "B", "N", "pipelines", "concat", "recompute", "shard_optimizer",
             "predicted_iteration_s", "predicted_peak_bytes_per_rank", "fits")


@dataclass(frozen=True)
class Plan:
    candidate: Candidate
    time: TimePrediction
    memory: MemoryPrediction
    fits: bool
    partition: tuple[range, ...]

    @property
    def samples_per_s(self) -> float:
        t = self.time.iteration_s
        return self.candidate.global_batch_size / t if t > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        c = self.candidate
        return {"strategy": c.strategy, "W": c.W, "D": c.D, "B": c.B, "N": c.N, "pipelines": c.pipelines,
                "concat": c.concat, "recompute": c.recompute, "shard_optimizer": c.shard_optimizer,
                "predicted_iteration_s": self.time.iteration_s,
                "predicted_peak_bytes_per_rank": self.memory.per_rank, "fits": self.fits}


def plan_one(costs: ModelCosts, cand: Candidate, budget: Budget | None = None, *, ranks_per_node: int | None = None,
             partition: Sequence[range] | None = None) -> Plan:
    part = partition_for(costs, cand.S, partition)
    cand = cand.resolved(costs, part)  # concat=auto: the method fastest at this model's measured costs
    time = predict_time(costs, cand, part)
    memory = predict_memory(costs, cand, part)
    per_node = ranks_per_node or cand.world_size
    fits = True if budget is None else budget.fits(memory.per_rank, per_node)
    return Plan(cand, time, memory, fits, tuple(part))


def _plan_group(costs: ModelCosts, budget: Budget | None, ranks_per_node: int | None,
                cands: Sequence[Candidate]) -> list[Plan]:
    return [plan_one(costs, cand, budget, ranks_per_node=ranks_per_node) for cand in cands]


def _plan_each(costs: ModelCosts, cands: Sequence[Candidate], budget: Budget | None, ranks_per_node: int | None,
               workers: int | None) -> list[Plan]:
    """``plan_one`` of every candidate, in order, spread over processes (:mod:`pipeline_recipes.planner.parallel`):
    candidates on one schedule go to the same process, which builds it once."""
    return map_grouped(partial(_plan_group, costs, budget, ranks_per_node), cands, Candidate.schedule_key,
                       workers_for(len(cands), workers))


def plan_all(costs: ModelCosts, devices: int, global_batch_size: int, budget: Budget | None = None, *,
             ranks_per_node: int | None = None, schedules: Sequence[str] | None = None,
             recompute: Sequence[str] = RECOMPUTE, grad_sync: str = DEFAULT_GRAD_SYNC,
             partition: str = "runtime", refine: int = 10, workers: int | None = None,
             shard_optimizer: Sequence[bool] = SHARDING) -> list[Plan]:
    """Every candidate predicted and ranked (fitting first, then by predicted samples/s).

    ``shard_optimizer``: the ``strategy.shard_optimizer`` choices compared (both by default, sharded only where
    the rule allows it: :func:`~pipeline_recipes.planner.predict.candidates`).

    ``workers``: processes that predict the candidates (default: one per available core where
    processes fork, for a large search; 1: in this process).

    ``partition``: ``runtime`` (what ``train.py`` runs: ``model.partition(D)``), ``time`` or ``memory``:
    the ``refine`` best candidates (and every one that does not fit) are re-predicted with
    :func:`pipeline_recipes.planner.partition_search.recommend_partition`'s split, then all are ranked again.
    """
    if grad_sync not in GRAD_SYNC_MODES:
        raise ValueError(f"grad_sync must be one of {', '.join(GRAD_SYNC_MODES)}, got {grad_sync!r}")

    if partition not in ("runtime", "time", "memory"):
        raise ValueError(f"partition must be runtime, time or memory, got {partition!r}")

    def order(p: Plan) -> tuple:
        return (not p.fits, -p.samples_per_s, max(p.memory.per_rank))

    cands = candidates(devices, global_batch_size, costs.num_layers, schedules=schedules, recompute=recompute,
                       grad_sync=grad_sync, shard_optimizer=shard_optimizer)
    plans = sorted(_plan_each(costs, cands, budget, ranks_per_node, workers), key=order)
    if partition != "runtime":
        chosen = [k for k, p in enumerate(plans) if k < refine or (partition == "memory" and not p.fits)]
        for k in chosen:
            cand = plans[k].candidate
            plans[k] = plan_one(costs, cand, budget, ranks_per_node=ranks_per_node,
                                partition=recommend_partition(costs, cand, partition))
        plans.sort(key=order)
    return plans


def best_per_schedule(plans: Sequence[Plan], costs: ModelCosts) -> dict[str, dict[str, Any]]:
    """The first plan of each schedule in ``plans`` (ranked as :func:`plan_all` or :func:`best_plans` rank them:
    fitting first), with its W, D, B, recomputation, optimizer sharding, samples/s, step time, bubble ratio, unhidden
    gradient sync time (``allreduce_s``), exposed parameter all-gather of a sharded optimizer state (``gather_s``),
    peak bytes per rank, and why: ``time_split`` (its step in compute, bubble, messages and unhidden collectives:
    :func:`~pipeline_recipes.planner.predict.time_split`) and ``memory_split`` (the fullest rank's peak in weights,
    gradients, optimizer state and activations: :meth:`~pipeline_recipes.planner.memory.WorkerMemory.split`)."""
    out: dict[str, dict[str, Any]] = {}
    for p in plans:
        c = p.candidate
        if c.strategy in out:
            continue
        fullest = max(p.memory.workers, key=lambda w: w.peak)
        out[c.strategy] = {"W": c.W, "D": c.D, "B": c.B, "recompute": c.recompute,
                           "shard_optimizer": c.shard_optimizer, "samples_per_s": p.samples_per_s,
                           "peak_bytes": max(p.memory.per_rank), "N": c.N, "pipelines": c.pipelines,
                           "step_s": p.time.iteration_s, "bubble": p.time.bubble_ratio, "allreduce_s": p.time.sync_s,
                           "gather_s": p.time.gather_s, "label": c.label(), "fits": p.fits,
                           "time_split": time_split(costs, c, p.time, p.partition), "memory_split": fullest.split()}
    return out


def time_lower_bound(costs: ModelCosts, cand: Candidate, split: Sequence[range] | None = None) -> float:
    """A bound no prediction of ``cand`` goes below: each of the ``N`` micro-batches of a replica passes every stage
    forward and backward once, and the ``D`` workers share that work, so the makespan is at least
    ``N·Σ_s (t_f[s] + t_b[s]) / D`` (no schedule build needed; ``split``: the runtime split, when known)."""
    t_f, t_b, _ = stage_costs(costs, cand, partition_for(costs, cand.S, split))
    return cand.N * (sum(t_f) + sum(t_b)) / cand.D


def _best_of_schedule(costs: ModelCosts, budget: Budget, ranks_per_node: int | None, partition: str,
                      cands: Sequence[Candidate]) -> list[Plan]:
    """The fastest fitting plan of one schedule's candidates (branch and bound on :func:`time_lower_bound`); where
    none fits, the one of least peak memory."""
    best: Plan | None = None
    tried: list[Plan] = []
    splits = {S: partition_for(costs, S) for S in {c.S for c in cands}}  # the runtime split of S stages, once
    for bound, cand in sorted(((time_lower_bound(costs, c, splits[c.S]), c) for c in cands), key=lambda bc: bc[0]):
        if best is not None and bound >= best.time.iteration_s:
            break
        part = splits[cand.S] if partition == "runtime" else recommend_partition(costs, cand, "time")
        resolved = cand.resolved(costs, part)
        time = predict_time(costs, resolved, part)
        if best is not None and time.iteration_s >= best.time.iteration_s:
            continue
        memory = predict_memory(costs, resolved, part)
        plan = Plan(resolved, time, memory, budget.fits(memory.per_rank, ranks_per_node or cand.world_size),
                    tuple(part))
        if plan.fits:
            best = plan
        else:
            tried.append(plan)
    if best is not None:
        return [best]
    return [min(tried, key=lambda p: max(p.memory.per_rank))] if tried else []


def best_plans(costs: ModelCosts, devices: int, global_batch_size: int, budget: Budget, *,
               ranks_per_node: int | None = None, schedules: Sequence[str] | None = None,
               recompute: Sequence[str] = RECOMPUTE, grad_sync: str = DEFAULT_GRAD_SYNC, partition: str = "runtime",
               workers: int | None = None, shard_optimizer: Sequence[bool] = SHARDING) -> list[Plan]:
    """The fastest fitting plan of every schedule (the least memory where none fits), fastest first: the search for
    a large cluster. ``partition``: ``runtime`` (``model.partition(D)``, what ``train.py`` runs) or ``time`` (each
    candidate's split balanced by its layers' predicted times, head and embeddings included; run it with the
    ``model.partition`` overrides of :func:`pipeline_recipes.planner.partition_search.partition_overrides`).
    Per schedule, candidates go in order of :func:`time_lower_bound`; a candidate is simulated only while its bound
    is below the best fitting time found, and its memory (a walk over every worker's actions and messages, the
    expensive part) predicted only when it would be faster. The result equals ranking every plan with
    :func:`plan_all` and keeping each schedule's first fitting one. A layout and its sharded-optimizer twin share
    one simulation (:func:`pipeline_recipes.planner.predict.predict_time`) and one memory walk
    (:func:`pipeline_recipes.planner.memory.predict_memory`)."""
    if partition not in ("runtime", "time"):
        raise ValueError(f"partition must be runtime or time for a cluster-wide search, got {partition!r}")
    cands = candidates(devices, global_batch_size, costs.num_layers, schedules=schedules, recompute=recompute,
                       grad_sync=grad_sync, shard_optimizer=shard_optimizer)
    groups: dict[str, list[Candidate]] = {}
    for cand in cands:
        groups.setdefault(cand.strategy, []).append(cand)
    with planner_pool(workers_for(len(cands), workers)) as pool:  # one schedule per task
        found = map_groups(pool, partial(_best_of_schedule, costs, budget, ranks_per_node, partition),
                           list(groups.values()))
    return sorted((p for plans in found for p in plans), key=lambda p: (not p.fits, -p.samples_per_s))


def plan_rows(plans: Sequence[Plan]) -> list[dict[str, Any]]:
    return [p.to_json() for p in plans]


def format_table(plans: Sequence[Plan], top: int | None = 20) -> str:
    header = ["#", "strategy", "W", "D", "B", "N", "iter s", "samples/s", "bubble", "peak/rank", "fits"]
    rows = []
    for k, p in enumerate(plans[:top] if top else plans, 1):
        c = p.candidate
        rows.append([str(k), c.label(), str(c.W), str(c.D), str(c.B), str(c.N), f"{p.time.iteration_s:.4g}",
                     f"{p.samples_per_s:.4g}", f"{p.time.bubble_ratio:.0%}", format_bytes(max(p.memory.per_rank)),
                     "yes" if p.fits else "NO"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(v.rjust(w) if i not in (1, 10) else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
              for r in rows]
    if top and len(plans) > top:
        lines.append(f"... {len(plans) - top} more (--top 0 shows all)")
    return "\n".join(lines)


def best_config(costs: ModelCosts, devices: int, global_batch_size: int, budget: Budget | None = None, *,
                num_nodes: int = 1, **kwargs: Any) -> list[str]:
    """The top recommendation as ``train.py`` Hydra overrides (raises ``ValueError`` if nothing fits).

    ``devices``: all processes (W·D); ``num_nodes`` splits them into ``trainer.devices`` per node.
    """
    if devices % num_nodes:
        raise ValueError(f"{devices} processes cannot be split evenly over {num_nodes} nodes")
    kwargs.setdefault("ranks_per_node", devices // num_nodes)
    plans = plan_all(costs, devices, global_batch_size, budget, **kwargs)
    if not plans:
        raise ValueError(f"no layout of {devices} processes divides the global batch {global_batch_size}")
    best = plans[0]
    if not best.fits:
        need = min(max(p.memory.per_rank) for p in plans)
        raise ValueError(f"no layout of {devices} processes fits {budget.describe() if budget else ''}: the smallest "
                         f"predicted peak per rank is {format_bytes(need)}; add devices or lower data.global_batch_size")
    return [*best.candidate.overrides(), f"trainer.devices={devices // num_nodes}", f"trainer.num_nodes={num_nodes}",
            f"data.global_batch_size={global_batch_size}"]
