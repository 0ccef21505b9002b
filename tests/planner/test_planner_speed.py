"""The profiler runs one layer per group of identical layers and builds only the layers it runs;
it prints progress lines with the time left. Counts, not timings."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import pipeline_recipes.planner.profile as prof
from pipeline_recipes.models import build_model, preset


def tiny_gpt2(n_layer: int) -> dict[str, Any]:
    return {**preset("gpt2-tiny"), "n_layer": n_layer, "init_seed": 0}


def emulated_timing_runs(monkeypatch: pytest.MonkeyPatch, layers: int) -> tuple[Any, Any, list, list]:
    """An emulated pipeline of ``layers`` layers prepared at batch sizes 1 and 2, with every layer
    forward the timing rounds make recorded as ``(first layer, batch size)``, and no minimum time."""
    from pipeline_recipes.strategies.harness.emulated import EmulatedPipeline

    model = EmulatedPipeline(layers, t_f=0.0, activation_numel=4, param_numel=4)
    runner = prof._LayerRunner(model, torch.device("cpu"))
    runs = [prof._prepare_size(runner, model.batch(size)) for size in (1, 2)]
    size_of = {id(run.batch): size for run, size in zip(runs, (1, 2))}
    order: list[tuple[int, int]] = []
    forward = runner.forward

    def recording(first: int, last: int, x: object, batch: dict) -> tuple:
        order.append((first, size_of[id(batch)]))
        return forward(first, last, x, batch)

    monkeypatch.setattr(runner, "forward", recording)
    monkeypatch.setattr(prof, "MIN_SECONDS", 0.0)
    return model, runner, runs, order


def test_timed_rounds_run_one_layer_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five emulated layers: first, three identical middle ones, last. Only layers 0, 1 and 4 are timed."""
    model, runner, runs, order = emulated_timing_runs(monkeypatch, 5)
    prof._time_layers(runner, runs, reps=3, warmup=0)
    assert order == [(0, 1), (0, 2), (1, 1), (1, 2), (4, 1), (4, 2)] * 3
    for run in runs:
        assert all(run.rows[i] == run.rows[1] for i in (2, 3))  # the middle layers share layer 1's costs


def test_time_budget_stops_after_the_minimum_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    model, runner, runs, order = emulated_timing_runs(monkeypatch, 3)
    prof._time_layers(runner, runs, reps=10, warmup=0, budget_s=0.0)  # any round overruns a zero budget
    assert Counter(order) == {(i, b): prof.MIN_ROUNDS for i in range(3) for b in (1, 2)}
    with pytest.raises(ValueError, match="reps >= 1"):
        prof.profile_pipeline(model, model.batch, "emulated", batch_sizes=(1, 2), reps=0)


@pytest.mark.slow
def test_identical_blocks_run_once_and_get_the_costs_of_a_block_measured_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt2-tiny with 6 blocks, every layer built: the profile runs the embedding, the first two blocks
    (the second after the first, for M_a) and the head, never blocks 3-6; a never-run block's stored
    bytes, measured here on its own, equal the ones the profile gave it."""
    cfg = tiny_gpt2(6)
    calls: Counter[int] = Counter()
    real = prof.profile_pipeline

    def counting(model: Any, *args: Any, **kwargs: Any) -> Any:
        for i, layer in enumerate(model.pipeline_layers()):
            layer.register_forward_pre_hook(lambda *_, i=i: calls.update([i]))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(prof, "profile_pipeline", counting)
    costs = prof.profile_model(cfg, batch_sizes=(1, 2), reps=1, layers="all")
    n = costs.num_layers
    assert n == 8 and set(calls) == {0, 1, 2, n - 1}
    blocks = costs.layers[1:-1]
    assert all(b.fwd == blocks[0].fwd and b.stored_added == blocks[1].stored_added for b in blocks[1:])

    from pipeline_recipes.planner.profile import _LayerRunner, make_batch
    from pipeline_recipes.core.pipeline_model import run_layers

    model = build_model(cfg, device="meta")
    model.materialize(None, "cpu")
    model.train()
    runner = _LayerRunner(model, torch.device("cpu"))
    layers = model.pipeline_layers()
    for size in (1, 2):
        batch = make_batch(model, size)
        with torch.no_grad():
            x4 = run_layers(layers[:4], model.pipeline_input(batch), batch)
            x3 = run_layers(layers[:3], model.pipeline_input(batch), batch)
        assert runner.forward(4, 4, x4, batch)[2] == pytest.approx(costs.layers[4].stored_alone(size))
        pair = runner.forward(3, 4, x3, batch)[2] - runner.forward(3, 3, x3, batch)[2]
        assert pair == pytest.approx(costs.layers[4].stored_added(size))


@pytest.mark.slow
def test_a_large_model_builds_only_the_layers_that_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """48 blocks on a 'device' too small for them: three layers run, four are built (the second
    block for M_a), and the profile still covers all 50 layers with the block's costs."""
    from pipeline_recipes.models.base import HFPipelineModel

    built: list[int] = []
    materialize = HFPipelineModel.materialize

    def recording(self: Any, layers: Any, device: Any) -> None:
        indices = list(range(len(self.pipeline_layers())) if layers is None else layers)
        built.extend(indices)
        materialize(self, indices, device)

    monkeypatch.setattr(HFPipelineModel, "materialize", recording)
    monkeypatch.setattr(prof, "_device_memory", lambda device: 2**20)
    cfg = tiny_gpt2(48)
    assert prof.layers_mode(cfg) == "distinct"
    costs = prof.profile_model(cfg, batch_sizes=(1, 2), reps=1)
    assert sorted(built) == [0, 1, 2, 49]
    assert costs.num_layers == 50 and len({layer.fwd for layer in costs.layers[1:-1]}) == 1
    whole = build_model(cfg, device="meta").num_parameters()
    assert sum(costs.layers[i].params for i in built) < whole / 4  # what was built, against the whole model
    assert prof.layers_mode("gpt2") == "distinct"  # 1.39 B parameters: never built whole, whatever the RAM


def test_progress_lines_estimate_the_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline_recipes.strategies.harness.emulated import EmulatedPipeline

    monkeypatch.setattr(prof, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(prof, "MIN_SECONDS", 0.0)
    model = EmulatedPipeline(4, t_f=0.001, activation_numel=4, param_numel=4)
    lines: list[str] = []
    prof.profile_pipeline(model, model.batch, "emulated", batch_sizes=(1, 2), reps=3, memory=False, log=lines.append)
    assert all(line.startswith("profile: ") for line in lines)
    assert sum("timing round" in line and "s left)" in line for line in lines) >= 3
    assert any("memory pass at B=2 done; timing about" in line and "s left)" in line for line in lines)
    assert "3 distinct of 4 layers" in lines[0] and lines[-1].startswith("profile: done (")


def test_memory_partition_computes_stages_of_equal_layers_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory objective's dynamic programme asks for the peak of every (stage, first, last); with
    equal blocks most of those stages are the same and are computed once, with the same split as the
    programme that computes every one (tied embedding and head included)."""
    import functools
    from dataclasses import replace

    from pipeline_recipes.models.partition import minmax_partition as solve
    from pipeline_recipes.planner import partition_search as part
    from pipeline_recipes.planner.costs import LinearFit
    from pipeline_recipes.planner.memory import worker_peak
    from pipeline_recipes.planner.model_costs import uniform_costs
    from pipeline_recipes.planner.predict import Candidate

    base = uniform_costs(14, params=10, stored=1000.0, out=100.0)
    layers = list(base.layers)
    layers[0] = replace(layers[0], params=400, param_bytes=1600)
    layers[-1] = replace(layers[-1], params=400, param_bytes=1600, stored_alone=LinearFit(0, 5000.0))
    costs = replace(base, layers=tuple(layers), tied=((0, 13, 1600),))
    cand = Candidate.of("dapple", 1, 4, 1, 8)
    schedule = cand.schedule()
    every = solve(14, 4, functools.cache(
        lambda s, i, j: worker_peak(costs, cand, schedule, s, {s: range(i, j)}, keep_sends=True).peak))
    calls = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[3:])
        return worker_peak(*args, **kwargs)

    monkeypatch.setattr(part, "worker_peak", counting)
    assert part.recommend_partition(costs, cand, "memory", keep_sends=True) == every
    stages = sum(1 for s in range(4) for i in range(14) for j in range(i + 1, 15))  # what the programme may ask
    assert len(calls) < stages / 3
