"""balanced_partition: contiguity, optimality against brute force, tie-breaking, errors; the start-up table."""

from __future__ import annotations

import itertools
import random

import pytest

from pipeline_recipes.models.partition import balanced_partition, format_partition_table, stage_costs


def brute_force_bottleneck(costs: list[float], stages: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[bounds[k]:bounds[k + 1]]) for k in range(stages)))
    return best


def check_shape(partition: list[range], n: int, stages: int) -> None:
    assert len(partition) == stages
    assert all(isinstance(r, range) and len(r) > 0 and r.step == 1 for r in partition)
    assert [i for r in partition for i in r] == list(range(n))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 9, 13, 66])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5, 7, 8])
def test_uniform_grid(n: int, stages: int) -> None:
    if stages > n:
        with pytest.raises(ValueError):
            balanced_partition([1.0] * n, stages)
        return
    part = balanced_partition([1.0] * n, stages)
    check_shape(part, n, stages)
    sizes = [len(r) for r in part]
    assert max(sizes) == -(-n // stages)  # ceil(n / stages): the optimum for equal costs
    assert max(sizes) - min(sizes) <= 1  # tie-break: as even as possible


def test_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = [rng.choice([0.0, 0.5, 1.0, 2.0, 3.0, rng.random() * 10]) for _ in range(n)]
        part = balanced_partition(costs, stages)
        check_shape(part, n, stages)
        assert max(stage_costs(part, costs)) == pytest.approx(brute_force_bottleneck(costs, stages))


def test_integer_costs_brute_force_odd_sizes() -> None:
    rng = random.Random(1)
    for n in (3, 5, 7, 11):
        for stages in range(1, min(n, 6) + 1):
            costs = [rng.randint(1, 100) for _ in range(n)]
            part = balanced_partition(costs, stages)
            assert max(stage_costs(part, costs)) == brute_force_bottleneck(costs, stages)


def test_transformer_shapes() -> None:
    # embedding/head weighted 0: D stages hold equal numbers of blocks (the Chimera paper's setting)
    costs = [0.0] + [1.0] * 64 + [0.0]
    part = balanced_partition(costs, 8)
    assert [sum(costs[i] for i in r) for r in part] == [8.0] * 8
    assert part[0].start == 0 and part[-1].stop == 66
    assert [len(r) for r in balanced_partition([0, 1, 1, 1, 1, 0], 4)] == [2, 1, 1, 2]
    # a heavy head gets a stage with fewer blocks
    part = balanced_partition([1.0] * 8 + [4.0], 3)
    assert max(stage_costs(part, [1.0] * 8 + [4.0])) == 4.0


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"stages=5.*layers=4"):
        balanced_partition([1, 1, 1, 1], 5)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        balanced_partition([1, 1], 0)
    with pytest.raises(ValueError, match="empty"):
        balanced_partition([], 1)
    with pytest.raises(ValueError, match=">= 0"):
        balanced_partition([1, -1], 1)
    with pytest.raises(TypeError):
        balanced_partition([1, 1], 1.5)  # type: ignore[arg-type]


def test_format_partition_table() -> None:
    names = ["embeddings", "block.0", "block.1", "block.2", "head"]
    params = [1000, 200, 200, 200, 1500]
    part = balanced_partition([0, 1, 1, 1, 0], 3)
    text = format_partition_table(part, names, params)
    lines = text.splitlines()
    assert lines[0].split("|")[0].strip() == "stage"
    assert len(lines) == 3 + 3 + 1  # header, rule, rows, rule, total
    assert "0-1: embeddings .. block.0" in text and "3-4: block.2 .. head" in text
    assert "1,200" in text and "3,100" in text
    assert len({len(line) for line in lines}) == 1  # fixed width
    with_costs = format_partition_table(part, names, params, costs=[0, 1, 1, 1, 0])
    assert "cost" in with_costs.splitlines()[0]
    with pytest.raises(ValueError, match="cover"):
        format_partition_table([range(0, 2)], names, params)
    with pytest.raises(ValueError, match="parameter counts"):
        format_partition_table(part, names, params[:-1])
