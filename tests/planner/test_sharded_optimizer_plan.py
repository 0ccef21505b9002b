"""The planner with ``strategy.shard_optimizer`` (ZeRO stage 1 across each stage's copies): the optimizer state it
counts, the collectives it charges, the layouts it compares and ``strategy=auto`` picking a sharded layout. By-hand
figures from parameter counts and group sizes; CPU, no process started but by ``plan.py``'s own pool."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline_recipes.planner.costs import AlphaBeta, LinearFit, rabenseifner
from pipeline_recipes.planner.memory import Budget, predict_memory, worker_peak
from pipeline_recipes.planner.model_costs import CommCosts, ModelCosts, uniform_costs
from pipeline_recipes.planner.predict import Candidate, candidates, predict_time
from pipeline_recipes.planner.recommend import best_config, best_per_schedule, plan_all

ROOT = Path(__file__).resolve().parents[2]
FREE = CommCosts(AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0))
PARAMS = 1000  # fp32 parameters per layer: 4000 bytes of weights, AdamW's two moments 8000 bytes


def toy(num_layers: int, **kwargs: object) -> ModelCosts:
    return uniform_costs(num_layers, params=PARAMS, comm=FREE, **kwargs)


def _saved(params: int, group: int) -> float:
    """AdamW's fp32 moments (8 bytes per parameter) that a rank no longer holds when ``group`` ranks share them."""
    return 8 * params * (1 - 1 / group)


# -- memory ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, W, D, N, pipelines, held_layers, group", [
    ("dapple", 2, 4, 4, 1, 2, 2),  # W = 2 replicas: each stage (2 layers) on 2 ranks
    ("chimera", 1, 4, 4, 2, 4, 2),  # one replica, 2 pipelines: each worker holds 2 stages, each on 2 workers
    ("chimera", 2, 4, 4, 2, 4, 4),  # 2 replicas × 2 pipelines: 4 copies of every stage
    ("chimera", 1, 4, 4, 4, 8, 4),  # 4 pipelines: each worker holds 4 stages of 2 layers, each on 4 workers
])
def test_a_sharded_rank_holds_its_optimizer_state_over_the_stage_copies(name: str, W: int, D: int, N: int,
                                                                        pipelines: int, held_layers: int,
                                                                        group: int) -> None:
    """8 layers of 1000 parameters, 2 per stage: every worker's peak drops by its parameters × 8 bytes × (1 − 1/G),
    nothing else (the walk, its activations and gradients, unchanged), whether walked directly or derived from
    the unsharded twin."""
    costs = toy(8, stored=500.0, transient=300.0)
    whole = Candidate.of(name, W, D, 1, N, pipelines)
    sharded = whole.replace(shard_optimizer=True)
    assert sharded.shard_optimizer and sharded.label().endswith("+shard_optim")
    expected = _saved(held_layers * PARAMS, group)
    base = predict_memory(costs, whole, keep_sends=False)
    mem = predict_memory(costs, sharded, keep_sends=False)
    schedule = sharded.schedule()
    part = [range(2 * s, 2 * s + 2) for s in range(sharded.S)]
    for w in range(D):
        assert base.workers[w].peak - mem.workers[w].peak == pytest.approx(expected)
        assert base.workers[w].states - mem.workers[w].states == pytest.approx(expected)
        assert mem.workers[w].activations == pytest.approx(base.workers[w].activations)
        walked = worker_peak(costs, sharded, schedule, w, part, keep_sends=False)
        assert walked.peak == pytest.approx(mem.workers[w].peak)


def test_tied_weights_are_sharded_over_the_ranks_holding_either_end() -> None:
    """DAPPLE, W = 2, D = 4, 8 layers; layers 0 and 7 share 400 bytes (100 parameters). Worker 0: layers 0-1, 2000
    parameters of which 100 tied. Its own 1900 are on 2 ranks (the replicas), the tied 100 on 4 (stage 0 and stage 3
    of both replicas, the runtime's tied group). Worker 1 holds no tied weight."""
    costs = replace(toy(8), tied=((0, 7, 400),))
    whole = Candidate.of("dapple", 2, 4, 1, 4)
    base = predict_memory(costs, whole, keep_sends=False)
    mem = predict_memory(costs, whole.replace(shard_optimizer=True), keep_sends=False)
    assert base.workers[0].peak - mem.workers[0].peak == pytest.approx(_saved(1900, 2) + _saved(100, 4))
    assert base.workers[1].peak - mem.workers[1].peak == pytest.approx(_saved(2000, 2))
    assert base.workers[3].peak - mem.workers[3].peak == pytest.approx(_saved(1900, 2) + _saved(100, 4))


def test_sharding_is_compared_only_where_a_stage_has_copies() -> None:
    """The rule refuses sharding where every stage has one copy (W = 1 without a second pipeline) and for the
    asynchronous schedules: the search is not doubled there."""
    cands = candidates(4, 16, 8)
    sharded = [c for c in cands if c.shard_optimizer]
    assert sharded and all(c.W * c.pipelines > 1 for c in sharded)
    assert {c.replace(shard_optimizer=False) for c in sharded} <= set(cands)  # each next to its unsharded twin
    assert len(sharded) == sum(not c.shard_optimizer and c.W * c.pipelines > 1 for c in cands)
    assert not any(c.W == 1 and c.pipelines == 1 and c.shard_optimizer for c in cands)
    assert {c.shard_optimizer for c in cands if c.strategy == "chimera" and c.W == 1} == {False, True}
    asynchronous = candidates(4, 16, 8, schedules=("pipedream_2bw",))
    assert asynchronous and not any(c.shard_optimizer for c in asynchronous)
    assert not any(c.shard_optimizer for c in candidates(4, 16, 8, shard_optimizer=(False,)))


# -- time --------------------------------------------------------------------------------------------------------


def _comm_only(device: str) -> ModelCosts:
    """4 layers of 1000 parameters, no compute, an all-reduce of α = 1 ms, β = 1 µs/byte, AdamW 1 s per layer."""
    layers = tuple(replace(x, fwd=LinearFit(0, 0), bwd=LinearFit(0, 0), opt_s=1.0) for x in toy(4).layers)
    return replace(toy(4), layers=layers, device=device, comm=CommCosts(AlphaBeta(0.0, 0.0), AlphaBeta(1e-3, 1e-6)))


def test_nccl_reduce_scatters_then_gathers_after_a_shard_of_the_optimizer_step() -> None:
    """One stage on W = 4 replicas (16000 bytes): unsharded, an all-reduce then the 4 s AdamW step; sharded on
    NCCL, a reduce-scatter (half the all-reduce), a quarter of the step, then the all-gather (the other half)."""
    costs = _comm_only("cuda")
    ar = rabenseifner(4, 16000, 1e-3, 1e-6)
    whole = predict_time(costs, Candidate.of("gpipe", 4, 1, 1, 1))
    sharded = predict_time(costs, Candidate.of("gpipe", 4, 1, 1, 1, shard_optimizer=True))
    assert (whole.sync_s, whole.optimizer_s, whole.gather_s) == pytest.approx((ar, 4.0, 0.0))
    assert (sharded.sync_s, sharded.optimizer_s, sharded.gather_s) == pytest.approx((ar / 2, 1.0, ar / 2))
    assert sharded.step_s == pytest.approx(whole.step_s)
    assert whole.iteration_s - sharded.iteration_s == pytest.approx(3.0)


def test_gloo_all_reduces_gradients_and_broadcasts_parameters() -> None:
    """On CPU ranks (gloo) the runtime all-reduces the gradients whole and broadcasts each rank's slice of the
    parameters: the gradient sync is a whole all-reduce, the gather an all-gather's half of one."""
    costs = _comm_only("cpu")
    ar = rabenseifner(4, 16000, 1e-3, 1e-6)
    sharded = predict_time(costs, Candidate.of("gpipe", 4, 1, 1, 1, shard_optimizer=True))
    assert (sharded.sync_s, sharded.optimizer_s, sharded.gather_s) == pytest.approx((ar, 1.0, ar / 2))


# -- the search, --compare's JSON and strategy=auto --------------------------------------------------------------


def test_best_config_shards_the_optimizer_state_when_only_that_fits() -> None:
    """``strategy=auto``'s choice (:func:`best_config`): one layer of 10⁶ parameters on 2 processes, so D = 1 and
    W = 2 copies. Whole, a rank holds 4 + 4 + 8 MB of model states; sharded, 4 + 4 + 4 MB. A 13 MB budget fits
    only the sharded layouts, and the overrides say so."""
    costs = uniform_costs(1, params=10**6, stored=10.0, comm=FREE)
    budget = Budget(per_rank=13 * 10**6, source="test")
    plans = plan_all(costs, 2, 2, budget, workers=1)
    assert {p.candidate.shard_optimizer for p in plans if p.fits} == {True}
    assert any(not p.candidate.shard_optimizer for p in plans)
    overrides = best_config(costs, 2, 2, budget, workers=1)
    assert "strategy.shard_optimizer=true" in overrides
    roomy = best_config(costs, 2, 2, Budget(per_rank=10**9, source="test"), workers=1)
    assert any(o.startswith("strategy.shard_optimizer=") for o in roomy)


@pytest.mark.slow
def test_strategy_auto_on_a_described_cluster_returns_the_sharded_override() -> None:
    """Through the launcher's own path (:func:`auto_overrides`, a described cluster, no profiling): gpt2-tiny with
    one block (3 pipeline layers, so D ≤ 2 and W ≥ 2 on 4 devices) on a device whose memory fits its layouts only
    with the optimizer state sharded."""
    from pipeline_recipes.planner.cluster import ClusterSpec
    from pipeline_recipes.planner.derived_costs import described_budget, described_costs
    from pipeline_recipes.recipe.check.auto import auto_overrides

    given = ["cluster=dgx-h100", "model=gpt2-tiny", "model.n_layer=1", "trainer.devices=4", "data.global_batch_size=4",
             "cluster.reserved_memory=1MiB", "cluster.allocator_overhead=0.0"]
    cfg = _plan_script().compose_config(given)
    spec = ClusterSpec.from_config(cfg.cluster)
    costs = described_costs(cfg.model, spec, None)
    plans = plan_all(costs, 4, 4, described_budget(spec), workers=1)
    whole = min(max(p.memory.per_rank) for p in plans if not p.candidate.shard_optimizer)
    sharded = min(max(p.memory.per_rank) for p in plans if p.candidate.shard_optimizer)
    assert sharded < whole
    memory = f"cluster.device_memory={(whole + sharded) // 2 + 2**20}"  # between the two, plus the reserved MiB
    out = auto_overrides(["strategy=auto", *given, memory], ROOT / "conf")
    assert "strategy.shard_optimizer=true" in out and "strategy=auto" not in out


def _plan_script():
    spec = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_compare_json_carries_shard_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``plan.py cluster=<name> --compare --json``: every row and every schedule's best layout says whether it
    shards the optimizer state; the printed table shows it in the variant column."""
    out = tmp_path / "plan.json"
    code = _plan_script().main(["cluster=dgx-h100", "model=gpt2-tiny", "trainer.devices=4", "data.global_batch_size=8",
                                "--schedules", "dapple,chimera", "--recompute", "none", "--compare", "--json",
                                str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["rows"] and all(isinstance(r["shard_optimizer"], bool) for r in record["rows"])
    best = record["best_per_schedule"]
    assert set(best) == {"dapple", "chimera"} and all(isinstance(b["shard_optimizer"], bool) for b in best.values())
    printed = capsys.readouterr().out
    for name, row in best.items():
        line = next(line for line in printed.splitlines() if line.split()[:1] == [name])
        assert ("shard_optim" in line) == row["shard_optimizer"]
    assert "variant" in printed


def test_best_per_schedule_carries_the_flag_and_the_gather() -> None:
    costs = toy(4)
    plans = plan_all(costs, 4, 8, Budget(per_rank=10**12), schedules=["chimera"], workers=1)
    best = best_per_schedule(plans, costs)["chimera"]
    assert {"shard_optimizer", "gather_s", "label"} <= set(best)
    assert best["shard_optimizer"] == plans[0].candidate.shard_optimizer
