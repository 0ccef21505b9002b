"""Partition recommender: split layers into stages by time (throughput) or by memory (CAPTURE).

* ``objective="time"``: :func:`pipeline_recipes.models.partition.balanced_partition` on per-layer forward + backward
  time at the candidate's ``B`` (min-max of stage time: the pipeline's bottleneck).
* ``objective="memory"``: CAPTURE's objective (§III-C), the smallest peak across ranks. A stage's
  peak depends on where it sits (under 1F1B the first stage keeps D micro-batches in flight, the last
  one) and on its layers (the embedding and the LM head are heavy), so the cost of a stage is the
  predicted peak of the worker holding it (:func:`pipeline_recipes.planner.memory.worker_peak`). With one stage per
  worker (GPipe, DAPPLE) :func:`minmax_partition` solves it exactly by dynamic programming; Chimera's
  workers hold several stages, so a local search moves stage boundaries from the time-balanced split
  while the sorted per-rank peaks decrease (CAPTURE's tie-break: lowest peak, then the next ranks).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence

from pipeline_recipes.models.partition import balanced_partition
from pipeline_recipes.models.partition import minmax_partition as solve_minmax

from .memory import worker_peak
from .model_costs import ModelCosts
from .predict import Candidate

OBJECTIVES = ("time", "memory")


def minmax_partition(num_layers: int, stages: int, cost: Callable[[int, int, int], float]) -> list[range]:
    """:func:`pipeline_recipes.models.partition.minmax_partition` with ``cost`` memoised (a stage's predicted peak)."""
    return solve_minmax(num_layers, stages, functools.cache(lambda s, i, j: float(cost(s, i, j))))


def time_costs(costs: ModelCosts, cand: Candidate) -> list[float]:
    """Per-layer forward + backward seconds at ``B`` (plus a forward under recomputation)."""
    extra = 1.0 if cand.recompute == "always" else 0.0
    return [layer.fwd.clamp(cand.B) * (1 + extra) + layer.bwd.clamp(cand.B) for layer in costs.layers]


def layer_kinds(costs: ModelCosts) -> list[int]:
    """Per layer, the index of the first layer with the same costs (names aside): the profiler gives
    every member of a group of identical layers the same costs
    (:class:`pipeline_recipes.planner.profile.DistinctLayers`)."""
    first: dict[str, int] = {}
    out = []
    for i, layer in enumerate(costs.layers):
        data = layer.to_json()
        data.pop("name", None)
        out.append(first.setdefault(json.dumps(data, sort_keys=True), i))
    return out


def rank_peaks(costs: ModelCosts, cand: Candidate, partition: Sequence[range], keep_sends: bool = True) -> list[float]:
    schedule = cand.schedule()
    return [worker_peak(costs, cand, schedule, w, partition, keep_sends=keep_sends).peak for w in range(cand.D)]


def recommend_partition(costs: ModelCosts, cand: Candidate, objective: str = "time", *,
                        keep_sends: bool | None = None) -> list[range]:
    """The recommended layers per stage for this layout (see the module docstring)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"partition objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if cand.S > costs.num_layers:
        raise ValueError(f"S = {cand.S} stages but the model has {costs.num_layers} layers")
    by_time = balanced_partition(time_costs(costs, cand), cand.S)
    if objective == "time":
        return by_time
    if keep_sends is None:
        keep_sends = not costs.device.startswith("cuda")
    schedule = cand.schedule()
    if schedule.pipelines == 1 and cand.S == cand.D:  # worker s holds stage s alone
        kinds = layer_kinds(costs)
        peaks: dict[tuple, float] = {}

        def cost(s: int, i: int, j: int) -> float:
            # a stage's peak depends on its layers' costs, its input (the previous layer's output) and
            # where tied weights sit in it: stages of equal blocks at other offsets are computed once
            key = (s, kinds[i - 1] if i > 0 else -1, tuple(kinds[i:j]),
                   tuple(k - i if i <= k < j else -1 for a, b, _ in costs.tied for k in (a, b)))
            if key not in peaks:
                peaks[key] = worker_peak(costs, cand, schedule, s, {s: range(i, j)}, keep_sends=keep_sends).peak
            return peaks[key]

        return minmax_partition(costs.num_layers, cand.D, cost)
    return _local_search(costs, cand, by_time, keep_sends)


def _key(peaks: Sequence[float]) -> tuple[float, ...]:
    return tuple(sorted(peaks, reverse=True))


def _local_search(costs: ModelCosts, cand: Candidate, start: Sequence[range], keep_sends: bool) -> list[range]:
    bounds = [r.start for r in start] + [start[-1].stop]
    best = _key(rank_peaks(costs, cand, start, keep_sends))
    improved = True
    while improved:
        improved = False
        for k in range(1, len(bounds) - 1):
            for step in (-1, 1):
                trial = list(bounds)
                trial[k] += step
                if not trial[k - 1] < trial[k] < trial[k + 1]:
                    continue
                part = [range(trial[i], trial[i + 1]) for i in range(len(trial) - 1)]
                key = _key(rank_peaks(costs, cand, part, keep_sends))
                if key < best:
                    best, bounds, improved = key, trial, True
    return [range(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def partition_overrides(partition: Sequence[range], layer_costs: Sequence[float],
                        grid: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)) -> list[str] | None:
    """``model.embedding_cost``/``model.head_cost`` overrides under which ``train.py``'s
    ``model.partition(D)`` yields ``partition`` (None if no pair on the grid does)."""
    target = [(r.start, r.stop) for r in partition]
    base = list(layer_costs)
    for e in grid:
        for h in grid:
            trial = [e, *base[1:-1], h]
            if [(r.start, r.stop) for r in balanced_partition(trial, len(partition))] == target:
                return [f"model.embedding_cost={e:g}", f"model.head_cost={h:g}"]
    return None
