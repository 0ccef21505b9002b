"""Cluster descriptions (conf/cluster/) load, validate and refuse bad values clearly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipeline_recipes.core.errors import ConfigError
from pipeline_recipes.planner.cluster import ClusterSpec

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = sorted(p.stem for p in (ROOT / "conf" / "cluster").glob("*.yaml"))


def _compose(*overrides: str):
    spec = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compose_config(list(overrides))


def test_the_issues_clusters_exist() -> None:
    assert {"local", "piz-daint", "v100-nvlink-ib", "dgx-h100", "h200"} <= set(CLUSTERS)


@pytest.mark.parametrize("name", CLUSTERS)
def test_every_cluster_yaml_loads_and_validates(name: str) -> None:
    spec = ClusterSpec.from_config(_compose(f"cluster={name}").cluster)
    assert spec.name == name
    if not spec.measure:
        assert spec.devices_per_node >= 1 and spec.device_memory > 0 and spec.host_memory > 0
        assert spec.peak_flops("fp32") > 0 and spec.intra_node and spec.inter_node


def test_local_is_the_default_and_measures() -> None:
    spec = ClusterSpec.from_config(_compose().cluster)
    assert spec.name == "local" and spec.measure


def test_figures_read_in_their_units() -> None:
    spec = ClusterSpec.from_config(_compose("cluster=dgx-h100").cluster)
    assert spec.devices_per_node == 8 and spec.device_memory == 80 * 10**9
    assert spec.inter_node.alpha_beta.alpha == pytest.approx(8e-6)
    assert spec.inter_node.alpha_beta.beta == pytest.approx(1 / 50e9)
    assert spec.peak_flops("bf16") == pytest.approx(989.4e12)
    daint = ClusterSpec.from_config(_compose("cluster=piz-daint").cluster)
    assert daint.peak_flops("bf16") == pytest.approx(9.3e12)  # a P100 has no bf16 unit: fp32's
    assert daint.nodes(2048) == 2048


@pytest.mark.parametrize("override,key", [
    ("cluster.devices_per_node=0", "devices_per_node"),
    ("cluster.device_memory=lots", "device_memory"),
    ("cluster.inter_node.bandwidth_GBps=-1", "inter_node.bandwidth_GBps"),
    ("cluster.intra_node.latency_us=-3", "intra_node.latency_us"),
    ("cluster.allreduce=tree", "allreduce"),
    ("+cluster.peak_tflops.fp8=2000", "peak_tflops"),
    ("cluster.reserved_memory=90GB", "reserved_memory"),
    ("cluster.allocator_overhead=1.5", "allocator_overhead"),
])
def test_a_bad_value_is_refused_naming_key_value_rule_and_fix(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        ClusterSpec.from_config(_compose("cluster=dgx-h100", override).cluster)
    text = str(err.value)
    assert f"cluster.{key}=" in text and "must" in text and "Fix:" in text


def test_a_described_device_loses_its_reserved_memory_and_the_allocators_share() -> None:
    """80 GB less 512 MiB of context; a 70 GiB estimate needs 70 × 1.09 = 76.3 GiB, which fits 80 GB − 0.5 GiB
    (74.0 GiB) only without the allocator's share: by hand."""
    from pipeline_recipes.planner.derived_costs import described_budget

    spec = ClusterSpec.from_config(_compose("cluster=dgx-h100").cluster)
    assert spec.reserved_memory == 512 * 2**20 and spec.allocator_overhead == pytest.approx(0.09)
    budget = described_budget(spec)
    assert budget.limit() == 80 * 10**9 - 512 * 2**20
    assert budget.need([70 * 2**30, 1], 8) == int(70 * 2**30 * 1.09)
    assert not budget.fits([70 * 2**30], 8) and budget.fits([67 * 2**30], 8)
    assert "512.00 MiB outside the allocator" in budget.describe() and "× 1.09" in budget.describe()


def test_calibration_takes_each_micro_batch_at_its_fastest_mode(tmp_path: Path) -> None:
    """Two sizes, an eager (slow, launch-bound) and a compiled row each: the line goes through the compiled rows.
    By hand: 1 sample = 1e12 FLOPs on a 1e15 FLOP/s device; compiled B = 4 → 10 ms, B = 16 → 34 ms per micro-batch:
    b = 2 ms per sample (efficiency 1e12 / (2e-3 · 1e15) = 0.5), a = 2 ms per micro-batch."""
    import json

    from pipeline_recipes.planner.derived_costs import calibrate_from_bench

    def row(mode: str, size: int, count: int, per_mb: float) -> dict:
        return {"model": "m", "system": "stage", "mode": mode, "status": "ok", "micro_batch_size": size,
                "micro_batches": count, "forward_s": per_mb * count / 3, "backward_s": 2 * per_mb * count / 3,
                "step_s": per_mb * count + 1e-3}

    record = {"meta": {"peak_tflops": 1000.0, "device_name": "X"},
              "models": {"m": {"flops_per_token": 1e9, "seq_len": 1000, "parameters": 10**6}},
              "rows": [row("eager", 4, 4, 0.050), row("compiled", 4, 4, 0.010), row("eager", 16, 1, 0.040),
                       row("compiled", 16, 1, 0.034), {**row("compiled", 16, 1, 0.001), "system": "handwritten"}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(record))
    cal = calibrate_from_bench(path, "m")
    assert cal.efficiency == pytest.approx(0.5)
    assert cal.microbatch_overhead_s == pytest.approx(2e-3)
    assert cal.opt_s_per_param == pytest.approx(1e-3 / 10**6)
    assert "4 compiled, 16 compiled" in cal.source


def test_a_time_balanced_split_per_layout_on_a_cluster() -> None:
    """``partition="time"``: each best plan runs the split balanced by its layers' times (an expensive last layer
    gets a stage of fewer layers), which the brute force over every split of that stage count also finds."""
    import itertools
    from dataclasses import replace

    from pipeline_recipes.planner.costs import LinearFit
    from pipeline_recipes.planner.memory import Budget
    from pipeline_recipes.planner.model_costs import uniform_costs
    from pipeline_recipes.planner.recommend import best_plans

    costs = uniform_costs(8, t_f=1e-3, t_b=2e-3, params=10**5, stored=2e6)
    heavy = replace(costs.layers[-1], fwd=LinearFit(0.0, 3e-3), fwd_nograd=LinearFit(0.0, 3e-3), bwd=LinearFit(0.0, 6e-3))
    costs = replace(costs, layers=(*costs.layers[:-1], heavy))
    plans = best_plans(costs, 4, 16, Budget(per_rank=10**12), schedules=["dapple"], partition="time", workers=1)
    part = plans[0].partition
    weights = [layer.fwd.clamp(1) + layer.bwd.clamp(1) for layer in costs.layers]
    S = len(part)
    best = min(max(sum(weights[a:b]) for a, b in zip((0, *cuts), (*cuts, 8)))
               for cuts in itertools.combinations(range(1, 8), S - 1))
    assert max(sum(weights[r.start:r.stop]) for r in part) == pytest.approx(best)
    assert len(part[-1]) < len(part[0])
    with pytest.raises(ValueError, match="runtime or time"):
        best_plans(costs, 4, 16, Budget(per_rank=10**12), schedules=["dapple"], partition="memory", workers=1)


# --- the network model, against hand-computed α–β costs --------------------------------------------------------------

from pipeline_recipes.planner.costs import AlphaBeta  # noqa: E402
from pipeline_recipes.planner.network import Network  # noqa: E402

INTRA, INTER = AlphaBeta(1e-6, 1e-11), AlphaBeta(1e-5, 1e-10)


def test_hierarchical_allreduce_by_hand() -> None:
    # 32 processes, 8 per node, 4 nodes, 1 GB: 2·(3·1µs + 7/8·0.01 s) + (2·2·10µs + 2·3/4·0.1 s·(1/8))
    net = Network(8, INTRA, INTER, "hierarchical")
    expected = 2 * (3 * 1e-6 + 7 / 8 * 1e-11 * 1e9) + (2 * 2 * 1e-5 + 2 * 3 / 4 * 1e-10 * 1e9 / 8)
    assert net.allreduce(32, 1e9, per_node=8) == pytest.approx(expected)


def test_flat_algorithms_by_hand_and_one_node_uses_the_intra_link() -> None:
    ring = Network(8, INTRA, INTER, "ring")
    assert ring.allreduce(4, 1e6, per_node=1) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * 1e-10 * 1e6)
    raben = Network(8, INTRA, INTER, "rabenseifner")
    assert raben.allreduce(4, 1e6, per_node=4) == pytest.approx(2 * 2 * 1e-6 + 2 * 3 / 4 * 1e-11 * 1e6)
    assert raben.allreduce(1, 1e6) == 0.0


def test_group_placement_and_p2p_links() -> None:
    net = Network(8, INTRA, INTER)
    assert net.members_per_node(D=4, W=16) == 2  # two replicas of a 4-stage pipeline per node
    assert net.members_per_node(D=4, W=16, copies=2) == 4  # Chimera: both pipelines' copies too
    assert net.members_per_node(D=16, W=4) == 1  # a replica spans two nodes: every copy on its own node
    assert not net.pipeline_crosses_nodes(8) and net.pipeline_crosses_nodes(16)
    assert net.p2p(1e6, crosses_node=True) == pytest.approx(1e-5 + 1e-4)


def test_a_cluster_plans_with_its_network() -> None:
    from dataclasses import replace

    from pipeline_recipes.planner.costs import rabenseifner
    from pipeline_recipes.planner.model_costs import uniform_costs
    from pipeline_recipes.planner.predict import Candidate, predict_time

    spec = ClusterSpec.from_config(_compose("cluster=dgx-h100").cluster)
    costs = uniform_costs(8, t_f=1e-3, t_b=2e-3, params=10**6).with_comm(spec.comm_costs())
    cand = Candidate.of("dapple", 2, 4, 1, 4)  # 2 replicas of 4 stages: one node, each stage's 8 MB over NVLink
    nvlink = spec.intra_node.alpha_beta
    assert predict_time(costs, cand).sync_s == pytest.approx(rabenseifner(2, 8e6, nvlink.alpha, nvlink.beta))
    one_per_node = replace(costs.comm, network=replace(costs.comm.network, devices_per_node=1))
    ib = spec.inter_node.alpha_beta
    assert predict_time(costs.with_comm(one_per_node), cand).sync_s == pytest.approx(
        rabenseifner(2, 8e6, ib.alpha, ib.beta))


@pytest.mark.slow
def test_the_smart_search_equals_brute_force_on_a_small_space() -> None:
    from pipeline_recipes.planner.memory import Budget, predict_memory
    from pipeline_recipes.planner.model_costs import uniform_costs
    from pipeline_recipes.planner.recommend import best_per_schedule, best_plans, plan_all

    costs = uniform_costs(8, t_f=1e-3, t_b=2e-3, params=10**5, stored=2e6)
    schedules = ["gpipe", "dapple", "chimera", "gems", "pipedream_2bw"]
    everything = plan_all(costs, 8, 32, None, schedules=schedules, workers=1)
    peaks = sorted(max(p.memory.per_rank) for p in everything)
    budget = Budget(per_rank=int(peaks[len(peaks) // 2]), source="test")  # about half the layouts fit
    brute = plan_all(costs, 8, 32, budget, schedules=schedules, workers=1)
    smart = best_plans(costs, 8, 32, budget, schedules=schedules, workers=1)
    expected = {k: v for k, v in best_per_schedule(brute, costs).items() if v["fits"]}
    got = {k: v for k, v in best_per_schedule(smart, costs).items() if v["fits"]}
    assert expected and got.keys() == expected.keys()
    for name in expected:
        assert got[name]["samples_per_s"] == pytest.approx(expected[name]["samples_per_s"])
    spread = best_plans(costs, 8, 32, budget, schedules=schedules, workers=2)  # one forked process per core
    assert [(p.candidate, p.samples_per_s) for p in spread] == [(p.candidate, p.samples_per_s) for p in smart]


@pytest.mark.slow
def test_plan_script_for_2048_piz_daint_nodes_writes_best_per_schedule(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from pipeline_recipes.strategies.schedules import names

    out = tmp_path / "plan.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), "cluster=piz-daint", "model=gpt2",
                    "trainer.devices=2048", "data.global_batch_size=2048", "--compare", "--json", str(out)],
                   check=True, timeout=900, capture_output=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    best = json.loads(out.read_text())["best_per_schedule"]
    assert set(best) == set(names())
    for row in best.values():
        assert {"W", "D", "B", "recompute", "samples_per_s", "peak_bytes"} <= set(row)
        assert row["W"] is None and row["no_layout"] or row["W"] * row["D"] == 2048
    assert best["chimera"]["samples_per_s"] > 0


@pytest.mark.slow
def test_strategy_auto_plans_for_the_described_cluster() -> None:
    from pipeline_recipes.recipe.check.auto import auto_overrides

    out = auto_overrides(["strategy=auto", "cluster=dgx-h100", "model=gpt2-tiny", "trainer.devices=8",
                          "trainer.num_nodes=2", "data.global_batch_size=64"], ROOT / "conf")
    assert "strategy=auto" not in out and any(o.startswith("strategy=") for o in out)
    assert "cluster=dgx-h100" in out


@pytest.mark.slow
def test_a_layer_table_measured_here_plans_in_place_of_derived_times(tmp_path: Path) -> None:
    """The device-table path of scripts/bench_gpu.py, run on the CPU with the tiny model (no GPU needed)."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_gpu
    from dataclasses import replace

    from pipeline_recipes.planner.derived_costs import described_costs
    from pipeline_recipes.planner.predict import Candidate, predict_time

    table = tmp_path / "layers.json"
    record = bench_gpu.layer_table("gpt2-tiny", table, device="cpu", batch_sizes=(1, 2), reps=1)
    assert record["layers"] and record["meta"]["command"].startswith("python scripts/bench_gpu.py --layer-table")
    spec = replace(ClusterSpec.from_config(_compose("cluster=dgx-h100").cluster), cost_table=str(table))
    costs = described_costs(None, spec, None)
    assert costs.kind == "measured" and "measured" in costs.meta["derived"] and costs.comm.network is not None
    assert predict_time(costs, Candidate.of("dapple", 1, 2, 1, 2)).iteration_s > 0


@pytest.mark.slow
def test_plan_script_gives_each_time_balanced_split_as_train_py_overrides(tmp_path: Path) -> None:
    """``--partition time`` on a cluster: the best layout's ``split_overrides`` make ``train.py``'s own split
    (``balanced_partition`` of the layer weights with the overrides' embedding/head costs) the time-balanced split
    of that layout — checked against a brute force over every split of GPT-2's 66 layers into D stages' time."""
    import json
    import subprocess
    import sys

    from pipeline_recipes.models.partition import balanced_partition
    from pipeline_recipes.planner.derived_costs import described_costs
    from pipeline_recipes.planner.predict import Candidate
    from pipeline_recipes.planner.partition_search import time_costs

    out = tmp_path / "plan.json"
    args = ["cluster=piz-daint", "model=gpt2", "trainer.devices=8", "data.global_batch_size=8"]
    subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), *args, "--compare", "--schedules", "dapple",
                    "--recompute", "none", "--partition", "time", "--json", str(out)], check=True, timeout=300,
                   capture_output=True)
    row = json.loads(out.read_text())["best_per_schedule"]["dapple"]
    costs = {o.split("=")[0]: float(o.split("=")[1]) for o in row["split_overrides"]}
    cfg = _compose(*args)
    model_costs = described_costs(cfg.model, ClusterSpec.from_config(cfg.cluster), None)
    weights = [costs["model.embedding_cost"], *[1.0] * (model_costs.num_layers - 2), costs["model.head_cost"]]
    split = balanced_partition(weights, row["D"])
    seconds = time_costs(model_costs, Candidate.of("dapple", row["W"], row["D"], row["B"], row["N"], recompute="none"))
    prefix = [0.0]
    for t in seconds:
        prefix.append(prefix[-1] + t)
    n, D = len(seconds), row["D"]
    best = [[float("inf")] * (n + 1) for _ in range(D + 1)]  # best[k][j]: k stages over the first j layers
    best[0][0] = 0.0
    for k in range(1, D + 1):
        for j in range(k, n + 1):
            best[k][j] = min(max(best[k - 1][i], prefix[j] - prefix[i]) for i in range(k - 1, j))
    assert max(prefix[r.stop] - prefix[r.start] for r in split) == pytest.approx(best[D][n])
    refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), *args, "--partition", "memory"],
                             check=False, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--partition time or runtime" in refused.stderr
