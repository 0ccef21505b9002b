"""Planner (Chimera §3.4's performance model, CAPTURE's memory prediction): cost formulas, memory
arithmetic, simulate-based prediction, partition recommender, the plan CLI's JSON, the memory pre-flight
and the profile cache. No timed assertions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline_recipes.planner.costs import AlphaBeta, LinearFit, fit_line, parse_bytes, rabenseifner, robust_line
from pipeline_recipes.planner.memory import Budget, predict_memory, worker_peak
from pipeline_recipes.planner.model_costs import CommCosts, LayerCosts, ModelCosts, uniform_costs
from pipeline_recipes.planner.partition_search import minmax_partition, recommend_partition
from pipeline_recipes.planner.predict import Candidate, candidates, predict_time
from pipeline_recipes.planner.recommend import JSON_KEYS, best_config, plan_all
from pipeline_recipes.strategies.schedules import get_spec, peak_activations, specs
from schedule_grids import asynchronous, default_planner_schedules, smallest_valid_size

ROOT = Path(__file__).resolve().parents[2]
FREE = CommCosts(AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0))


# -- formulas ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", [2, 4, 8, 16])
def test_rabenseifner_formula(r: int) -> None:
    alpha, beta, L = 1e-5, 1e-9, 4e6
    expected = 2 * math.log2(r) * alpha + 2 * (r - 1) / r * beta * L
    assert rabenseifner(r, L, alpha, beta) == pytest.approx(expected)
    assert rabenseifner(2, L, alpha, beta) == pytest.approx(2 * alpha + beta * L)


def test_rabenseifner_single_replica_is_free() -> None:
    assert rabenseifner(1, 1e9, 1.0, 1.0) == 0.0
    with pytest.raises(ValueError):
        rabenseifner(0, 1.0, 1.0, 1.0)


def test_fit_line_two_points_exact_and_least_squares() -> None:
    fit = fit_line([1, 4], [3.0, 9.0])
    assert (fit.a, fit.b) == pytest.approx((1.0, 2.0))
    assert fit(8) == pytest.approx(17.0)
    ls = fit_line([1, 2, 3], [1.0, 2.0, 4.0])
    assert ls.b == pytest.approx(1.5) and ls.a == pytest.approx(-2 / 3)
    assert LinearFit(-5.0, 1.0).clamp(1) == 0.0
    with pytest.raises(ValueError, match="two distinct"):
        fit_line([2, 2], [1.0, 1.0])


def test_robust_line_ignores_one_outlier() -> None:
    xs = [1, 2, 3, 4, 5]
    ys = [1 + 2 * x for x in xs]
    ys[2] = 100.0
    fit = robust_line(xs, ys)
    assert (fit.a, fit.b) == pytest.approx((1.0, 2.0))


def test_parse_bytes() -> None:
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1e3") == 1000
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")


# -- memory -----------------------------------------------------------------------------------------


def toy(num_layers: int = 4, *, params: int = 100, stored: float = 1000.0, out: float = 100.0,
        transient: float = 0.0) -> ModelCosts:
    return uniform_costs(num_layers, params=params, stored=stored, out=out, transient=transient, comm=FREE)


def test_peak_memory_toy_by_hand() -> None:
    """4 layers of 100 fp32 parameters, 1000 B stored per layer and sample, D = 2, GPipe, N = 2, B = 1."""
    costs = toy()
    cand = Candidate.of("gpipe", 1, 2, 1, 2)
    mem = predict_memory(costs, cand, [range(0, 2), range(2, 4)], keep_sends=False, receive_ahead=False)
    # weights 800 + AdamW 2·800 + 2 micro-batches × 2 layers × 1000 bytes in flight, when the first
    # backward allocates its last layer's gradient (400) before freeing that layer's activations
    assert [w.peak for w in mem.workers] == [800 + 1600 + 2 * 2 * 1000 + 400] * 2
    assert mem.per_rank == [6800, 6800]
    # recompute: stage 0 keeps nothing, stage 1 its 100-byte input per micro-batch; a backward
    # re-materialises one micro-batch of the stage (2000 bytes): the peak is the second backward, with
    # every gradient (800) allocated and, on stage 1, that micro-batch's input still kept
    rec = predict_memory(costs, cand.replace(recompute="always"), [range(0, 2), range(2, 4)],
                         keep_sends=False, receive_ahead=False)
    assert [w.peak for w in rec.workers] == [3200 + 2000, 3200 + 100 + 2000]


def test_peak_memory_tied_weights_counted_once_per_rank() -> None:
    costs = replace(toy(), tied=((0, 3, 400),))
    one = predict_memory(costs, Candidate.of("gpipe", 1, 1, 1, 1), [range(0, 4)], keep_sends=False, receive_ahead=False)
    # 4 layers × 400 bytes, minus the tied copy: 1200 bytes of weights, ×4 with gradients and AdamW
    assert one.workers[0].states == 1200 * 4


@pytest.mark.parametrize("name,D,N,pipes", [("gpipe", 4, 8, 1), ("dapple", 4, 8, 1), ("chimera", 4, 4, 2),
                                            ("chimera", 4, 8, 2), ("dapple", 2, 6, 1), ("gems", 4, 5, 2)])
def test_activation_peak_matches_in_flight_count(name: str, D: int, N: int, pipes: int) -> None:
    """Equal stages: activation peak = bytes per micro-batch × peak in-flight micro-batches
    (:func:`strategies.schedules.peak_activations`); no parameters, so the peak is activations only."""
    costs = toy(D * 2, params=0)
    cand = Candidate.of(name, 1, D, 1, N, pipes)
    schedule = cand.schedule()
    part = [range(2 * s, 2 * s + 2) for s in range(D)]
    inflight = peak_activations(schedule)
    for w in range(D):
        mem = worker_peak(costs, cand, schedule, w, part, keep_sends=False, receive_ahead=False)
        assert mem.peak == pytest.approx(inflight[w] * 2 * 1000)


def test_synced_gradients_are_bucket_views_from_the_start() -> None:
    """Chimera D = 2, worker 0 runs ``0F0 1F1p1 1B1p1 0B0``; layers of 4000 bytes of weights, 1000
    bytes kept and a 5000-byte backward transient per sample. Both stages have a copy on the other
    worker, so their gradients are views of the all-reduce buckets (strategies.grad_sync), there from
    the start, and no all-reduce needs a buffer of its own, whatever the sync mode: the peak is in
    ``1B1p1``, with both micro-batches kept: 24000 (weights, AdamW) + 8000 (gradients) + 2 × 1000 +
    5000 (transient) = 39000."""
    costs = toy(2, params=1000, transient=5000.0)
    part = [range(0, 1), range(1, 2)]
    peaks = {}
    for sync in ("end", "eager"):
        cand = Candidate.of("chimera", 1, 2, 1, 2, 2, grad_sync=sync)
        schedule = cand.schedule()
        assert [str(a) for a in schedule.workers[0]] == ["0F0", "1F1p1", "1B1p1", "0B0"]
        peaks[sync] = worker_peak(costs, cand, schedule, 0, part, keep_sends=False, receive_ahead=False).peak
    assert peaks == {"end": 39000, "eager": 39000}


def test_budget_cpu_is_shared_and_gpu_per_rank() -> None:
    assert Budget(per_rank=100).fits([100, 90], 2)
    assert not Budget(per_rank=100).fits([101, 1], 2)
    host = Budget(host=1000, process_bytes=100)
    assert host.fits([400, 400], 2)  # 800 + 2 processes × 100 = 1000: exactly fits
    assert host.need([400, 400], 2) == 1000
    assert not host.fits([400, 401], 2)


# -- time -------------------------------------------------------------------------------------------


def test_chimera_not_slower_than_dapple_at_n_equals_d() -> None:
    costs = toy(8)
    for D in (2, 4, 8):
        part = [range(s * 8 // D, (s + 1) * 8 // D) for s in range(D)]
        t = {name: predict_time(costs, Candidate.of(name, 1, D, 1, D, 2 if name == "chimera" else 1), part).iteration_s
             for name in ("gpipe", "dapple", "chimera")}
        assert t["chimera"] <= t["dapple"] + 1e-12
        assert t["gpipe"] == pytest.approx(t["dapple"])
    # D = 4: chimera's bubbles are (D-2) against 2(D-1) (Chimera §2): strictly faster
    part4 = [range(2 * s, 2 * s + 2) for s in range(4)]
    assert predict_time(costs, Candidate.of("chimera", 1, 4, 1, 4, 2), part4).iteration_s < \
        predict_time(costs, Candidate.of("dapple", 1, 4, 1, 4), part4).iteration_s


def test_time_includes_rabenseifner_allreduce_and_recompute() -> None:
    comm = CommCosts(AlphaBeta(0.0, 0.0), AlphaBeta(1e-3, 1e-6))
    costs = replace(toy(4, params=1000), comm=comm, layers=tuple(replace(x, fwd=LinearFit(0, 0), bwd=LinearFit(0, 0))
                                                                 for x in toy(4, params=1000).layers))
    pred = predict_time(costs, Candidate.of("gpipe", 4, 1, 1, 1), [range(0, 4)])
    ar = lambda r, n: rabenseifner(r, n, 1e-3, 1e-6)  # noqa: E731
    # gradients of 4 × 1000 fp32 parameters over W = 4 copies, plus the step's two scalar all-reduces
    # over the 4 ranks (loss normalisers; the final loss, whose 2-rank cost is in the calibrated step_s)
    assert pred.sync_s == pytest.approx(ar(4, 4 * 4000))
    assert pred.iteration_s == pytest.approx(ar(4, 4 * 4000) + ar(4, 8) + ar(4, 8) - ar(2, 8))
    base = toy(4)
    none = predict_time(base, Candidate.of("dapple", 1, 2, 1, 4), [range(0, 2), range(2, 4)])
    rec = predict_time(base, Candidate.of("dapple", 1, 2, 1, 4, recompute="always"), [range(0, 2), range(2, 4)])
    assert rec.t_b == pytest.approx(tuple(b + f for b, f in zip(none.t_b, none.t_f)))


def test_end_sync_fuses_the_buckets_copied_on_the_same_workers() -> None:
    """Chimera: a worker's two stages have the same copies, so they are one all-reduce (as the runtime)."""
    comm = CommCosts(AlphaBeta(0.0, 0.0), AlphaBeta(1e-3, 1e-6))
    zero = tuple(replace(x, fwd=LinearFit(0, 0), bwd=LinearFit(0, 0)) for x in toy(4, params=1000).layers)
    costs = replace(toy(4, params=1000), comm=comm, layers=zero)
    part = [range(s, s + 1) for s in range(4)]
    pred = predict_time(costs, Candidate.of("chimera", 1, 4, 1, 4, 2), part)
    assert pred.sync_s == pytest.approx(rabenseifner(2, 2 * 4000, 1e-3, 1e-6))  # not 2 × ar(2, 4000)
    eager = predict_time(costs, Candidate.of("chimera", 1, 4, 1, 4, 2, grad_sync="eager"), part)
    assert eager.sync_s == pytest.approx(2 * rabenseifner(2, 4000, 1e-3, 1e-6))  # launched apart: not fused


@pytest.mark.slow
def test_emulated_pipeline_profiles_without_sharing_cores() -> None:
    """The emulated stages (sleeps with real tensors, Chimera §3.4's cost model) are profiled like a
    model; they hold no core, so no stretch."""
    from pipeline_recipes.planner.profile import profile_pipeline
    from pipeline_recipes.strategies.harness.emulated import EmulatedPipeline

    model = EmulatedPipeline(4, t_f=0.002, activation_numel=64, param_numel=16)
    costs = profile_pipeline(model, model.batch, "emulated", batch_sizes=(1, 2), reps=2, memory=False,
                             shares_cores=False)
    assert costs.cores == 0 and costs.num_layers == 4
    assert all(layer.fwd(1) >= 0.002 and layer.bwd(2) >= 0.008 for layer in costs.layers)  # t·B, t_b = 2 t_f
    busy = predict_time(replace(costs, cores=2), Candidate.of("gpipe", 1, 4, 1, 8), [range(s, s + 1) for s in range(4)])
    free = predict_time(costs, Candidate.of("gpipe", 1, 4, 1, 8), [range(s, s + 1) for s in range(4)])
    assert free.compute_s < busy.compute_s  # 4 ranks on 2 shared cores would be stretched


def test_profile_rounds_interleave_batch_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round times each layer at every batch size back to back, so a slow spell of a shared
    machine moves the fitted line's level, not its slope (sizes profiled one after the other once
    read a 3× slope)."""
    import pipeline_recipes.planner.profile as prof
    from test_planner_speed import emulated_timing_runs

    _, runner, runs, order = emulated_timing_runs(monkeypatch, 3)
    monkeypatch.setattr(prof, "MIN_SAMPLES", 1)
    prof._time_layers(runner, runs, reps=2, warmup=0)
    assert order == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)] * 2
    assert all(row["fwd"] >= 0 and row["bwd"] >= 0 and "fwd_nograd" in row for run in runs for row in run.rows)


def test_eager_sync_hides_allreduce_behind_bubbles() -> None:
    comm = CommCosts(AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 1e-4))
    costs = replace(toy(8), comm=comm)
    part = [range(2 * s, 2 * s + 2) for s in range(4)]
    end = predict_time(costs, Candidate.of("chimera", 1, 4, 1, 4, 2, grad_sync="end"), part)
    eager = predict_time(costs, Candidate.of("chimera", 1, 4, 1, 4, 2, grad_sync="eager"), part)
    assert eager.sync_s < end.sync_s
    assert eager.iteration_s < end.iteration_s
    # CPU ranks on every core: what overlaps computation takes its core time, only idle time hides it
    busy = replace(costs, cores=4)
    eager_cpu = predict_time(busy, Candidate.of("chimera", 1, 4, 1, 4, 2, grad_sync="eager"), part)
    end_cpu = predict_time(busy, Candidate.of("chimera", 1, 4, 1, 4, 2, grad_sync="end"), part)
    assert eager_cpu.iteration_s >= eager.iteration_s and end_cpu.iteration_s == pytest.approx(end.iteration_s)


def test_cpu_contention_charges_only_the_overlap_with_computation() -> None:
    from types import SimpleNamespace as Box

    from pipeline_recipes.planner.costs import Collective
    from pipeline_recipes.planner.predict import _cpu_contention

    timeline = [[Box(start=0.0, end=2.0), Box(start=3.0, end=4.0)], [Box(start=0.0, end=4.0)]]
    early = Collective("stage0", (0, 1), {0: 1.0, 1: 1.0}, 2.5)  # runs 1.0–3.5
    assert _cpu_contention([early], timeline, [4.0, 4.0], 1.0) == pytest.approx([4.0 + 1.0 + 0.5, 4.0 + 2.5])
    late = Collective("stage0", (0, 1), {0: 4.0, 1: 4.0}, 2.5)  # launched at the end: nothing overlaps
    assert _cpu_contention([late], timeline, [4.0, 4.0], 1.0) == [4.0, 4.0]


def test_candidates_cover_the_search_space() -> None:
    cands = candidates(4, 16, 6)
    assert all(c.W * c.D == 4 and c.W * c.B * c.N == 16 for c in cands)
    assert {c.strategy for c in cands} >= {"gpipe", "dapple", "gems", "chimera", "interleaved_1f1b", "zb_h1", "zb_h2",
                                           "zbv", "dualpipev", "chimera_zb"}
    assert {c.strategy for c in cands} == default_planner_schedules()  # every synchronous schedule registered
    assert all(c.D % 2 == 0 and c.pipelines == 2 for c in cands if c.strategy == "gems")
    assert all(c.S <= 6 for c in cands)  # v·D stages of the 6 layers: interleaved v = 2 only up to D = 3
    assert {(c.D, c.chunks) for c in cands if c.strategy == "interleaved_1f1b"} == {(2, 2)}
    assert all(c.N >= 2 * c.D for c in cands if c.strategy == "dualpipev")
    assert {c.recompute for c in cands} == {"none", "always"}
    chimera = [c for c in cands if c.strategy == "chimera"]
    assert all(c.D % 2 == 0 for c in chimera)
    assert {c.pipelines for c in chimera if c.D == 4} == {2, 4}
    assert any(c.concat == "forward_doubling" for c in chimera) and any(c.concat == "backward_halving" for c in chimera)
    assert all(c.N > c.D for c in chimera if c.concat != "direct")
    assert all(c.B % 2 == 0 for c in chimera if c.concat == "backward_halving")


@pytest.mark.parametrize("name", [spec.name for spec in specs()])
def test_every_schedule_of_the_registry_is_planned(name: str) -> None:
    """Each registered schedule at its least valid size (D ≥ 2) is a candidate when asked for, and its
    predicted pipeline time is at least a worker's own work: N micro-batches through 1/D of the layers,
    t_f + t_b = 3 per layer and sample, whatever the placement (pipelines, chunks) or bubble."""
    D, N = smallest_valid_size(get_spec(name), at_least=2)
    layers = 2 * get_spec(name).total_stages(D)
    cands = [c for c in candidates(D, N, layers, schedules=(name,), recompute=("none",))
             if (c.W, c.D, c.B, c.N) == (1, D, 1, N)]
    assert cands, f"{name}: no candidate at D = {D}, N = {N}"
    costs = toy(layers)
    for cand in cands:
        pred = predict_time(costs, cand)
        assert pred.compute_s >= N * (layers / D) * 3.0 * (1 - 1e-9), (cand, pred)
        assert 0.0 <= pred.bubble_ratio < 1.0
        assert predict_memory(costs, cand).max_rank > 0


def test_concat_auto_with_the_planners_measured_costs() -> None:
    """``concat=auto``: as the runtime picks it (best_concat at t_b = 2 t_f) unless the planner has measured
    costs, then the method fastest at each method's own costs; a plan shows the concrete method."""
    from pipeline_recipes.planner.recommend import plan_one
    from pipeline_recipes.strategies.schedules import best_concat, concat_choices

    assert [c.concat for c in candidates(4, 16, 6) if c.strategy == "chimera" and (c.D, c.B, c.pipelines) == (4, 2, 2)
            and c.recompute == "none" and not c.shard_optimizer] == list(concat_choices(4, 8, 2))
    auto = Candidate.of("chimera", 1, 4, 2, 8, 2, "auto")
    assert auto.resolved().concat == best_concat(4, 8, 2, 2) == "backward_halving"  # ties fd, half the activations
    assert auto.schedule().concat == "backward_halving"
    proportional = toy(4)  # every pass proportional to B: halves cost what whole micro-batches do
    assert auto.resolved(proportional).concat == "backward_halving"
    # a fixed cost per backward pass makes two half-size backwards slower than one: doubling wins
    fixed = replace(proportional, layers=tuple(replace(layer, bwd=LinearFit(1.0, 2.0))
                                               for layer in proportional.layers))
    assert auto.resolved(fixed).concat == "forward_doubling"
    assert plan_one(fixed, auto).candidate.concat == "forward_doubling"
    halving = auto.replace(concat="backward_halving")  # predicted alone, auto runs what the runtime would
    assert predict_time(fixed, auto).iteration_s == predict_time(fixed, halving).iteration_s


# -- partition --------------------------------------------------------------------------------------


def skewed() -> ModelCosts:
    """A light embedding, 6 blocks, a head 4× as slow and with a large stored activation."""
    layers = list(toy(8, stored=1000.0).layers)
    layers[0] = replace(layers[0], fwd=LinearFit(0, 0.1), bwd=LinearFit(0, 0.2))
    layers[-1] = replace(layers[-1], fwd=LinearFit(0, 4.0), bwd=LinearFit(0, 8.0), stored_alone=LinearFit(0, 5000.0),
                         stored_added=LinearFit(0, 5000.0))
    return replace(toy(8), layers=tuple(layers))


def test_minmax_partition_equals_balanced_partition_for_additive_costs() -> None:
    from pipeline_recipes.models.partition import balanced_partition

    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for stages in (1, 2, 3, 4):
        got = minmax_partition(len(costs), stages, lambda s, i, j: sum(costs[i:j]))
        assert max(sum(costs[r.start:r.stop]) for r in got) == pytest.approx(
            max(sum(costs[r.start:r.stop]) for r in balanced_partition(costs, stages)))


def test_partition_by_time_isolates_the_slow_head() -> None:
    part = recommend_partition(skewed(), Candidate.of("dapple", 1, 4, 1, 4), "time")
    assert [len(r) for r in part][-1] == 1  # the 12-unit head alone; 3-unit blocks elsewhere
    assert part[0].start == 0 and part[-1].stop == 8


def test_partition_by_memory_unloads_the_first_stage_under_1f1b() -> None:
    """DAPPLE's first stage keeps D micro-batches in flight, the last one: with equal layers the
    memory objective gives the first stage fewer layers than the last (CAPTURE §III-C)."""
    costs = toy(12, params=10)
    cand = Candidate.of("dapple", 1, 4, 1, 8)
    part = recommend_partition(costs, cand, "memory", keep_sends=False)
    sizes = [len(r) for r in part]
    assert sizes[0] < sizes[-1]
    even = [range(3 * s, 3 * s + 3) for s in range(4)]
    peak = max(w.peak for w in predict_memory(costs, cand, part, keep_sends=False).workers)
    assert peak < max(w.peak for w in predict_memory(costs, cand, even, keep_sends=False).workers)
    chimera = recommend_partition(skewed(), Candidate.of("chimera", 1, 4, 1, 4, 2), "memory")
    assert [i for r in chimera for i in r] == list(range(8))


# -- recommend, CLI, pre-flight, cache ----------------------------------------------------------------


@pytest.mark.slow
def test_plan_all_ranks_fitting_first_and_best_config() -> None:
    costs = toy(6)
    plans = plan_all(costs, 4, 16, Budget(per_rank=10**12))
    assert plans and all(p.fits for p in plans)
    rates = [p.samples_per_s for p in plans]
    assert rates == sorted(rates, reverse=True)
    assert set(plans[0].to_json()) == set(JSON_KEYS)
    overrides = best_config(costs, 4, 16, Budget(per_rank=10**12))
    assert overrides[0].startswith("strategy=") and "trainer.devices=4" in overrides
    tight = plan_all(costs, 4, 16, Budget(per_rank=1))
    assert not any(p.fits for p in tight)
    with pytest.raises(ValueError, match="no layout"):
        best_config(costs, 4, 16, Budget(per_rank=1))


def test_plan_all_gives_the_same_rows_spread_over_processes() -> None:
    """Predicting the layouts in forked processes (grouped by schedule) changes nothing: the same rows in
    the same order as in this process."""
    costs = toy(6)
    serial = plan_all(costs, 8, 32, Budget(per_rank=10**12), workers=1)
    spread = plan_all(costs, 8, 32, Budget(per_rank=10**12), workers=2)
    assert len(serial) > 64 and [p.to_json() for p in spread] == [p.to_json() for p in serial]


@pytest.mark.slow
def test_plan_script_json_keys(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plan.py"), "model=gpt2-tiny", "trainer.devices=2",
         "data.global_batch_size=4", "--cache", str(tmp_path / "cache"), "--comm", "default",
         "--profile-batches", "1,2", "--reps", "1", "--json", str(out), "--budget", "64GiB"],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert rows and all(list(r) == list(JSON_KEYS) for r in rows)
    assert all(r["W"] * r["D"] == 2 and r["W"] * r["B"] * r["N"] == 4 for r in rows)
    assert all(len(r["predicted_peak_bytes_per_rank"]) == 2 and isinstance(r["fits"], bool) for r in rows)
    assert all(r["predicted_iteration_s"] > 0 for r in rows)
    assert list((tmp_path / "cache").glob("profile-gpt2-tiny-*.json"))
    assert "best: python train.py" in proc.stdout
    assert "profile: memory pass at B=2 done; timing about" in proc.stderr and "s left)" in proc.stderr


@pytest.mark.slow
def test_preflight_refuses_the_paper_gpt2_on_one_small_process() -> None:
    from pipeline_recipes.models import hydra_config
    from pipeline_recipes.planner.preflight import PreflightError, preflight
    from pipeline_recipes.recipe.check.settings import resolve_layout

    cfg = {"model": hydra_config("gpt2"), "trainer": {"accelerator": "cpu", "devices": 1, "num_nodes": 1},
           "strategy": {"name": "gpipe", "D": 1, "micro_batch_size": 1, "recompute": "none"},
           "data": {"global_batch_size": 2}}
    layout = resolve_layout(cfg["strategy"], cfg["trainer"], 2, 66)
    with pytest.raises(PreflightError) as err:
        preflight(cfg, layout, budget_bytes=2 * 2**30)
    message = str(err.value)
    assert "2.00 GiB" in message and "GiB weights+gradients+AdamW state" in message
    assert "no layout of 1 processes" in message
    # 1.39 B parameters × 16 bytes (weights, gradients, two AdamW moments) alone exceed 20 GiB
    assert float(message.split("needs ")[1].split(" GiB")[0]) > 20


@pytest.mark.slow
def test_preflight_passes_and_suggests_layouts_that_fit() -> None:
    from pipeline_recipes.models import hydra_config
    from pipeline_recipes.planner.preflight import PreflightError, preflight
    from pipeline_recipes.strategies.schedules import derive_layout

    cfg = {"model": hydra_config("gpt2-tiny"), "trainer": {"accelerator": "cpu", "devices": 2},
           "strategy": {"name": "dapple", "recompute": "none"}}
    layout = derive_layout("dapple", 2, 2, 64, B=16)  # W = 1, N = 4
    assert preflight(cfg, layout, budget_bytes=2**30) is None
    with pytest.raises(PreflightError, match="predicted to fit") as err:
        preflight(cfg, layout, budget_bytes=20 * 2**20)
    assert "strategy.micro_batch_size=" in str(err.value)


def test_preflight_suggestions_are_the_same_spread_over_processes() -> None:
    """The walk for fitting layouts predicts the same memory in forked processes as in this one, so it
    suggests the same layouts in the same order (the serial walk is the reference)."""
    from pipeline_recipes.models import hydra_config
    from pipeline_recipes.planner import preflight as pf
    from pipeline_recipes.planner.memory import Budget
    from pipeline_recipes.strategies.schedules import derive_layout

    cfg = {"model": hydra_config("gpt2-tiny"), "trainer": {"accelerator": "cpu", "devices": 8},
           "strategy": {"name": "dapple", "recompute": "none"}}
    layout = derive_layout("dapple", 8, 8, 64, B=8)  # W = 1, N = 8
    costs, cand, per_node, keep_sends, _ = pf._setup(cfg, layout)
    budget = Budget(per_rank=12 * 2**20)
    serial = pf._fitting_options(costs, cand, budget, per_node, keep_sends, 5, workers=1)
    spread = pf._fitting_options(costs, cand, budget, per_node, keep_sends, 5, workers=2)
    assert serial and [(c.overrides(), peak) for c, peak in spread] == [(c.overrides(), peak) for c, peak in serial]


@pytest.mark.slow
def test_profile_cache_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline_recipes.planner.profile as prof

    first = prof.load_or_profile("gpt2-tiny", cache_dir=tmp_path, comm="none", batch_sizes=(1, 2), reps=1)
    assert first.num_layers == 6 and first.layers[1].fwd(2) > 0
    assert first.layers[1].stored_alone(2) > first.layers[1].stored_alone(1) > 0
    assert first.tied and first.tied[0][:2] == (0, 5)

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled again instead of reading the cache")

    monkeypatch.setattr(prof, "profile_model", boom)
    again = prof.load_or_profile("gpt2-tiny", cache_dir=tmp_path, comm="none", batch_sizes=(1, 2), reps=1)
    assert again.layers == first.layers


def test_profile_of_a_large_model_materialises_two_copies_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose training state would not fit is profiled from a meta build holding the embedding,
    the head and two blocks; a small one gets every layer."""
    import pipeline_recipes.planner.profile as prof

    seen: dict = {}

    def capture(model, batch_of, name, **kwargs):  # what profile_pipeline would measure
        seen["layers"] = list(model.pipeline_layers())
        return "profiled"

    monkeypatch.setattr(prof, "profile_pipeline", capture)
    monkeypatch.setattr(prof, "_device_memory", lambda device: 2**40)
    assert prof.layers_mode("gpt2-tiny") == "all" and prof.profile_model("gpt2-tiny") == "profiled"
    assert len({id(layer) for layer in seen["layers"]}) == 6
    monkeypatch.setattr(prof, "_device_memory", lambda device: 2**20)  # a 1 MiB device: gpt2-tiny is "large"
    assert prof.layers_mode("gpt2-tiny") == "distinct"
    prof.profile_model("gpt2-tiny")
    layers = seen["layers"]
    assert len({id(layer) for layer in layers}) == 4 and layers[3] is layers[4] is layers[2] and layers[1] is not layers[2]
    assert not any(t.is_meta for layer in layers for t in (*layer.parameters(), *layer.buffers()))
    with pytest.raises(ValueError, match="layers must be one of"):
        prof.layers_mode("gpt2-tiny", layers="some")


def test_model_costs_json_round_trip() -> None:
    costs = replace(skewed(), tied=((0, 7, 40),), meta={"layer_costs": [0.0] + [1.0] * 6 + [0.0]})
    assert ModelCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs
    layer = LayerCosts("x", 1, 4)
    assert LayerCosts.from_json(layer.to_json()) == layer


@pytest.mark.slow
def test_strategy_auto_overrides(tmp_path: Path) -> None:
    from pipeline_recipes.recipe.check.auto import auto_overrides

    given = ["model=gpt2-tiny", "trainer.devices=2", "data.global_batch_size=4"]
    assert auto_overrides(given, ROOT / "conf") == given  # no strategy=auto: unchanged
    out = auto_overrides([*given, "strategy=auto", "strategy.D=2"], ROOT / "conf", cache_dir=tmp_path, comm="none",
                         budget_bytes=64 * 2**30)
    assert out[:3] == given and "strategy=auto" not in out
    assert sum(o.startswith("strategy.D=") for o in out) == 1  # the user's strategy.D=2 is replaced
    chosen = dict(o.split("=", 1) for o in out[3:])
    from pipeline_recipes.planner.predict import default_schedules

    assert chosen["strategy"] in default_schedules()
    assert int(chosen["strategy.D"]) * int(chosen["strategy.W"]) == 2


# -- asynchronous schedules (PipeDream-2BW, PipeDream) ------------------------------------------------

def test_async_candidates_only_when_asked_and_within_their_rules() -> None:
    async_names = {spec.name for spec in asynchronous()}
    assert async_names >= {"pipedream", "pipedream_2bw"}
    assert not {c.strategy for c in candidates(4, 16, 6)} & async_names  # not SGD: opt-in
    cands = candidates(4, 16, 6, schedules=tuple(async_names))
    assert {c.strategy for c in cands} == async_names
    assert all(c.N == 1 for c in cands if c.strategy == "pipedream")
    assert all(c.N >= c.D for c in cands if c.strategy == "pipedream_2bw")
    assert all((c.recompute, c.grad_sync) == ("none", "end") for c in cands)


@pytest.mark.parametrize("D, N", [(2, 2), (4, 4), (4, 8)])
def test_async_iteration_is_the_steady_window_without_bubbles(D: int, N: int) -> None:
    costs = uniform_costs(2 * D, comm=FREE)
    part = [range(2 * s, 2 * s + 2) for s in range(D)]
    two_bw = predict_time(costs, Candidate.of("pipedream_2bw", 1, D, 1, N), part)
    dapple = predict_time(costs, Candidate.of("dapple", 1, D, 1, N), part)
    per_step = N * (two_bw.t_f[0] + two_bw.t_b[0])
    assert two_bw.compute_s == pytest.approx(per_step)
    assert two_bw.bubble_ratio == pytest.approx(0.0, abs=1e-9)
    assert dapple.compute_s == pytest.approx((N + D - 1) / N * per_step)  # the flush costs D - 1 slots
    one = predict_time(costs, Candidate.of("pipedream", 1, D, 1, 1), part)
    assert one.compute_s == pytest.approx(two_bw.t_f[0] + two_bw.t_b[0])


def test_async_memory_counts_the_stashed_weight_versions() -> None:
    costs = toy(4, params=100)  # 100 fp32 parameters (400 bytes) per layer, 2 layers per stage
    part = [range(0, 2), range(2, 4)]
    sync = predict_memory(costs, Candidate.of("dapple", 1, 2, 1, 2), part, keep_sends=False, receive_ahead=False)
    two_bw = predict_memory(costs, Candidate.of("pipedream_2bw", 1, 2, 1, 2), part, keep_sends=False, receive_ahead=False)
    one = predict_memory(costs, Candidate.of("pipedream", 1, 2, 1, 1), part, keep_sends=False, receive_ahead=False)
    stage_bytes = 2 * 100 * 4
    # stage 0 stashes 2 versions under both (PipeDream: D - s = 2), each with its gradient
    assert two_bw.workers[0].states - sync.workers[0].states == 2 * 2 * stage_bytes
    assert one.workers[0].states - sync.workers[0].states == 2 * 2 * stage_bytes
    assert one.workers[1].states - sync.workers[1].states == 2 * 1 * stage_bytes


def test_plan_accuracy_compares_the_pick_with_the_best_measured_per_global_batch() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_accuracy", Path(__file__).resolve().parents[2] / "scripts" / "plan_accuracy.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def row(layout: str, B: int, N: int, predicted: float, measured: float) -> dict:
        return {"layout": layout, "W": 1, "D": 2, "B": B, "N": N, "predicted_s": predicted, "measured_s": measured}

    rows = [row("gpipe", 4, 4, 1.0, 1.10), row("chimera", 4, 4, 0.9, 1.21), row("dapple", 2, 8, 1.2, 1.0),
            row("gpipe", 1, 8, 1.0, 1.0)]  # B̂ = 8 alone: nothing to compare
    (pick,) = script.recommendation_check(rows)
    assert pick["global_batch_size"] == 16 and pick["layouts"] == 3
    assert pick["recommended"] == "chimera W=1 D=2 B=4" and pick["best_measured"] == "dapple W=1 D=2 B=2"
    assert pick["ratio"] == pytest.approx(1.21)

    # independent repeats: per layout the median predicted and median measured times count
    runs = ((1.0, 1.3), (1.1, 1.0), (1.0, 1.1))  # (predicted, measured) per repeat
    repeats = [[{**row("gpipe", 4, 4, p, m), "time_error": abs(p - m) / m}] for p, m in runs]
    (merged,) = script.merge_repeats(repeats)
    assert (merged["predicted_s"], merged["measured_s"]) == (1.0, 1.1)
    assert merged["time_error"] == pytest.approx(0.1 / 1.1) and len(merged["repeats"]) == 3

    # errors per compute kind: the real rows' bias is not averaged away by the emulated ones
    rows = [{**row("gpipe", 4, 4, 0.8, 1.0), "compute": "real", "time_error": 0.2},
            {**row("dapple", 4, 4, 0.9, 1.0), "compute": "real", "time_error": 0.1},
            {**row("gpipe", 1, 4, 1.01, 1.0), "compute": "emulated", "time_error": 0.01}]
    by = script.errors_by_compute(rows)
    assert by["real"]["layouts"] == 2 and by["real"]["time_error_max"] == 0.2
    assert by["real"]["signed_error_median"] == pytest.approx(-0.15) and by["emulated"]["time_error_median"] == 0.01


@pytest.mark.slow
def test_comm_micro_benchmarks_run_the_runtime_synchronizer() -> None:
    """Two gloo processes: p2p ping-pong, GradientSynchronizer all-reduces, the emulated calibration step."""
    from pipeline_recipes.planner.comm_profile import measure_comm

    comm = measure_comm(sizes=(4096, 65536, 262144), reps=3, steps=3)
    assert comm.measured and comm.process_bytes > 0
    assert comm.allreduce(262144) > 0 and comm.p2p(262144) > 0
    assert comm.action_s >= 0 and comm.step_s >= 0


def test_runtime_calibration_separates_action_cost_from_message_latency() -> None:
    """Steps synthesised with a known per-action cost, per-message latency and per-step cost come back."""
    from pipeline_recipes.planner.comm_profile import calibrate_runtime
    from pipeline_recipes.strategies.schedules import build_schedule, simulate

    t_f, t_comm, o, hop, step = 0.002, 1e-4, 3e-4, 7e-4, 5e-4
    steps = {name: {n: step + simulate(build_schedule(name, 2, n), t_f + o, 2 * t_f + o, t_comm=t_comm + hop).makespan
                    for n in (2, 8)}
             for name in ("gpipe", "chimera")}
    assert calibrate_runtime(steps, t_f, t_comm) == pytest.approx((o, hop, step), abs=2e-5)
    # a step cost below zero is no cost: it is held at zero and the others refitted
    faster = {name: {n: t - 2 * step for n, t in by_n.items()} for name, by_n in steps.items()}
    action, latency, fixed = calibrate_runtime(faster, t_f, t_comm)
    assert fixed == 0.0 and action >= 0 and latency >= 0


def test_nonnegative_least_squares() -> None:
    import numpy as np

    from pipeline_recipes.planner.comm_profile import nonnegative_lstsq

    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nonnegative_lstsq(a, a @ np.array([2.0, 3.0])) == pytest.approx([2.0, 3.0])
    # b = (-1, 2, 1), exact at x = (-1, 2); with x1 held at zero, x2 = mean(2, 1) fits best
    assert nonnegative_lstsq(a, a @ np.array([-1.0, 2.0])) == pytest.approx([0.0, 1.5])


def test_comm_samples_combine_as_the_slowest_rank_per_repetition() -> None:
    from pipeline_recipes.planner.comm_profile import combine_ranks

    def rank(p2p: list[float], allreduce: list[float], steps: list[float], rss: int) -> dict:
        return {"p2p": {4096: p2p}, "allreduce": {4096: allreduce}, "steps": {"gpipe": {2: steps}},
                "rss": rss, "t_f": 0.002, "sleep_overshoot": 1e-4}

    a = rank([1.0, 1.0, 5.0, 1.0], [1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 9.0], 10)
    b = rank([2.0, 1.0, 1.0, 1.0], [4.0, 3.0, 2.0, 1.0], [3.0, 1.0, 1.0, 1.0], 20)
    out = combine_ranks([a, b])
    # per repetition the max over ranks: p2p [2, 1, 5, 1] -> lower quartile 1.0; all-reduce
    # [4, 3, 3, 4] -> median 3.5; steps [3, 2, 2, 9] -> lower quartile 2.0
    assert out["p2p"] == {4096: pytest.approx(1.0)} and out["allreduce"] == {4096: pytest.approx(3.5)}
    assert out["steps"] == {"gpipe": {2: pytest.approx(2.0)}} and out["rss"] == 20

