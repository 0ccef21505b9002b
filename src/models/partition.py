"""Contiguous layer-to-stage partitioning and its start-up table.

``balanced_partition`` solves the linear partition problem: split a sequence of per-layer costs into
``stages`` contiguous, non-empty groups so that the largest group cost (the pipeline's bottleneck stage)
is as small as possible. It is exact: a dynamic programme over (stage, prefix) finds the optimal
bottleneck ``M*``; among the partitions whose every stage costs at most ``M*``, a second dynamic
programme picks the one with the smallest sum of squared stage costs, so ties are broken towards
evenly loaded stages (e.g. costs ``[0, 1, 1, 1, 1, 0]`` on 4 stages give one block per stage).

Pure Python, O(stages * layers^2): microseconds for the few hundred layers of a transformer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["balanced_partition", "format_partition_table", "minmax_partition", "stage_costs"]


def _check(costs: Sequence[float], stages: int) -> list[float]:
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise TypeError(f"stages must be an int, got {stages!r}")
    values = [float(c) for c in costs]
    n = len(values)
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if n == 0:
        raise ValueError("cannot partition an empty list of layers")
    if stages > n:
        raise ValueError(
            f"cannot split {n} layers into {stages} non-empty pipeline stages: "
            f"need stages <= layers (got stages={stages}, layers={n})"
        )
    bad = [i for i, c in enumerate(values) if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"layer costs must be finite and >= 0; bad values at indices {bad[:8]}")
    return values


def balanced_partition(costs: Sequence[float], stages: int) -> list[range]:
    """Split layers ``0..len(costs)-1`` into ``stages`` contiguous non-empty ranges minimising the
    maximum stage cost (ties: smallest sum of squared stage costs).

    Raises ``ValueError`` when ``stages > len(costs)`` or a cost is negative or not finite.
    """
    values = _check(costs, stages)
    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)
    return minmax_partition(len(values), stages, lambda s, i, j: prefix[j] - prefix[i])


def minmax_partition(num_layers: int, stages: int, cost: Callable[[int, int, int], float]) -> list[range]:
    """Contiguous split minimising ``max_s cost(s, i, j)`` (stage ``s`` = layers ``i..j-1``; the cost
    may depend on the stage's position); ties go to the smallest sum of squared stage costs.
    ``O(stages · layers²)`` calls of ``cost``: memoise an expensive one."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} non-empty stages")
    n, inf = num_layers, math.inf
    # Phase 1: best[s][j] = minimal bottleneck splitting the first j layers into s stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            best[s][j] = min(max(best[s - 1][i], cost(s - 1, i, j)) for i in range(s - 1, j))
    bound = best[stages][n]
    limit = bound + 1e-9 * max(1.0, abs(bound))

    # Phase 2: among partitions with every stage <= bound, minimise the sum of squared stage costs.
    sq = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[-1] * (n + 1) for _ in range(stages + 1)]
    sq[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                c = cost(s - 1, i, j)
                if c > limit or sq[s - 1][i] == inf:
                    continue
                v = sq[s - 1][i] + c * c
                if v < sq[s][j] - 1e-12 * max(1.0, v):
                    sq[s][j] = v
                    arg[s][j] = i
    bounds = [n]
    j = n
    for s in range(stages, 0, -1):
        j = arg[s][j]
        bounds.append(j)
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(stages)]


def stage_costs(partition: Sequence[range], costs: Sequence[float]) -> list[float]:
    """Sum of ``costs`` over each stage's layers."""
    return [float(sum(costs[i] for i in stage)) for stage in partition]


def _span(stage: range, layer_names: Sequence[str]) -> str:
    if len(stage) == 1:
        return f"{stage.start}: {layer_names[stage.start]}"
    return f"{stage.start}-{stage.stop - 1}: {layer_names[stage.start]} .. {layer_names[stage.stop - 1]}"


def _fmt_cost(c: float) -> str:
    return f"{int(c):,}" if float(c).is_integer() else f"{c:.4g}"


def format_partition_table(
    partition: Sequence[range],
    layer_names: Sequence[str],
    param_counts: Sequence[int],
    costs: Sequence[float] | None = None,
) -> str:
    """A fixed-width table ``stage | layers | #layers | params [| cost]`` plus a total line.

    ``param_counts`` are per layer (a tied weight held by two layers is counted in both, as each
    stage holding it stores a copy).
    """
    if len(layer_names) != len(param_counts):
        raise ValueError(f"{len(layer_names)} layer names but {len(param_counts)} parameter counts")
    covered = [i for stage in partition for i in stage]
    if covered != list(range(len(layer_names))):
        raise ValueError("partition must cover every layer exactly once, in order")
    rows = []
    for s, stage in enumerate(partition):
        params = sum(param_counts[i] for i in stage)
        row = [str(s), _span(stage, layer_names), str(len(stage)), f"{params:,}"]
        if costs is not None:
            row.append(_fmt_cost(sum(costs[i] for i in stage)))
        rows.append(row)
    header = ["stage", "layers", "#", "params"] + (["cost"] if costs is not None else [])
    total = ["total", "", str(len(layer_names)), f"{sum(param_counts):,}"]
    if costs is not None:
        total.append(_fmt_cost(sum(costs)))
    table = [header, *rows, total]
    widths = [max(len(r[k]) for r in table) for k in range(len(header))]
    right = {0, 2, 3, 4}

    def fmt(r: list[str]) -> str:
        return " | ".join(c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths)))

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *(fmt(r) for r in rows), rule, fmt(total)])
