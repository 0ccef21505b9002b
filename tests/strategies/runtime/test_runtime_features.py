"""Runtime features: eager gradient sync (Chimera §3.2), activation recomputation (GPipe
re-materialization), emulated-compute stages, and the benchmark script's contract."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import WorldError, run_world
from layouts import pipeline_layout
from pipeline_recipes.strategies.runtime.engine import PipelineConfig
from pipeline_recipes.strategies.runtime.grad_sync import bubble_after, last_backwards, launch_plan
from pipeline_recipes.core.pipeline_model import PipelineModel
from pipeline_recipes.strategies.runtime.recompute import recompute_stages
from pipeline_recipes.strategies.schedules import build_schedule, derive_layout, get_spec, names
from schedule_grids import smallest_valid_size
from toy_model import ToyMLP, toy_batches, train_sgd

ROOT = Path(__file__).resolve().parents[3]
STEPS, B, LR = 3, 2, 0.05


# -- configuration and plans (no processes) ------------------------------------------------------


@pytest.mark.parametrize("field,value", [("grad_sync", "soon"), ("recompute", "sometimes")])
def test_layout_rejects_unknown_modes(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be one of .*'{value}'"):
        derive_layout("gpipe", 2, 2, 4, B=1, **{field: value})


def test_layout_defaults_keep_current_behaviour() -> None:
    config = PipelineConfig(derive_layout("gpipe", 2, 2, 4, B=1))
    assert (config.grad_sync, config.recompute) == ("end", "none")


@pytest.mark.parametrize("name", names())
def test_strategy_configs_and_strategy_pass_the_modes(name: str) -> None:
    """Every schedule of the registry has ``conf/strategy/<name>.yaml`` on the shared base; the synchronous
    ones take every gradient-sync and recomputation mode."""
    from hydra import compose, initialize_config_dir

    from pipeline_recipes.strategies.runtime.grad_sync import GRAD_SYNC_MODES
    from pipeline_recipes.strategies.lightning.strategy import PipelineStrategy
    from pipeline_recipes.strategies.runtime.recompute import RECOMPUTE_MODES

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):  # on the shared base's keys
        conf = compose("config", overrides=[f"strategy={name}"]).strategy
    assert conf["schedule"] == name
    assert conf["grad_sync"] in GRAD_SYNC_MODES and conf["recompute"] in RECOMPUTE_MODES
    if get_spec(name).asynchronous:  # weight stashing: grad_sync=end and recompute=none only
        return
    D, _ = smallest_valid_size(get_spec(name), at_least=2)
    N = get_spec(name).smallest_micro_batches(D)
    layout = derive_layout(name, D, D, N, B=1, grad_sync="eager_opt", recompute="except_last")
    strategy = PipelineStrategy.from_layout(layout)
    assert (strategy.pipeline_config.grad_sync, strategy.pipeline_config.recompute) == ("eager_opt", "except_last")
    with pytest.raises(ValueError, match="grad_sync"):
        derive_layout(name, D, D, N, B=1, grad_sync="later")


def test_recompute_stages() -> None:
    assert recompute_stages("none", 4) == frozenset()
    assert recompute_stages("always", 4) == {0, 1, 2, 3}
    assert recompute_stages("except_last", 4) == {0, 1, 2}


@pytest.mark.slow
def test_saved_bytes_tracking_frees_a_graph_dropped_without_backward() -> None:
    """The executor and the profiler count saved activations with SavedBytes; a graph built under it
    and dropped without a backward (a failed step, the profiler's forward-only passes) is freed."""
    import gc
    import weakref

    from pipeline_recipes.strategies.runtime.recompute import SavedBytes

    layer = nn.Linear(4, 4)
    saved = SavedBytes(frozenset())
    with saved.track():
        out = torch.tanh(layer(torch.randn(3, 4, requires_grad=True)))  # tanh saves its own output
    assert saved.nbytes > 0
    alive = weakref.ref(out)
    del out
    gc.collect()
    assert alive() is None
    x = torch.randn(3, 4, requires_grad=True)
    with SavedBytes(frozenset()).track():
        y = torch.tanh(x)
    y.sum().backward()  # unpacked with its grad_fn: the gradient is unchanged
    assert torch.allclose(x.grad, 1 - torch.tanh(x.detach()) ** 2)


def test_a_stage_counts_saved_bytes_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved-tensor hooks run on the first forward of each input shape only; later forwards of that
    shape keep the same count, which equals SavedBytes around a plain forward of the same layers."""
    from pipeline_recipes.core.pipeline_model import run_layers
    from pipeline_recipes.strategies.runtime.recompute import SavedBytes, parameter_storages
    from pipeline_recipes.strategies.runtime.stage import PipelineStage

    layers = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)]
    weights = parameter_storages([p for layer in layers for p in layer.parameters()])

    def independent(rows: int) -> int:
        saved = SavedBytes(weights)
        with saved.track():
            out = run_layers(layers, torch.randn(rows, 8, requires_grad=True), {})
        saved.add(out)
        return saved.nbytes

    tracked = []
    track = SavedBytes.track
    monkeypatch.setattr(SavedBytes, "track", lambda self: tracked.append(1) or track(self))
    stage = PipelineStage(1, 3, layers, parameter_storages=weights)  # a middle stage
    for mb, rows in enumerate((4, 4, 4, 16, 16)):
        stage.forward((0, mb, None), torch.randn(rows, 8), {}, None, True)
    assert len(tracked) == 2  # one count per shape
    assert [stage._graphs[(0, mb, None)].nbytes for mb in range(5)] == [independent(4)] * 3 + [independent(16)] * 2
    assert stage.stored.peak == 3 * independent(4) + 2 * independent(16)
    before = len(tracked)
    dropout = PipelineStage(1, 3, [nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)])  # saves a mask in training
    dropout.forward((0, 0, None), torch.randn(4, 8), {}, None, True)
    dropout.layers[1].eval()  # same shapes, other saved tensors: counted anew
    dropout.forward((0, 1, None), torch.randn(4, 8), {}, None, True)
    assert len(tracked) == before + 2
    assert dropout._graphs[(0, 1, None)].nbytes < dropout._graphs[(0, 0, None)].nbytes


def test_eager_plan_launches_each_stage_after_its_last_backward() -> None:
    schedule = build_schedule("chimera", 4, 4)
    for worker in range(4):
        plan = launch_plan(schedule, worker, "eager")
        last = last_backwards(schedule, worker)
        assert {s for stages in plan.values() for s in stages} == set(schedule.stages_of(worker))
        for action, stages in plan.items():
            assert all(last[s] == action for s in stages)
    assert launch_plan(schedule, 0, "end") == {}


def test_eager_opt_keeps_only_stage_copies_followed_by_a_bubble() -> None:
    """Chimera Figure 4(b): P0 and P3 sync stage 3 eagerly; the middle stages wait for the end."""
    schedule = build_schedule("chimera", 4, 4)
    eager = {w: {s for ss in launch_plan(schedule, w, "eager_opt").values() for s in ss} for w in range(4)}
    assert eager == {0: {3}, 1: set(), 2: set(), 3: {3}}
    assert bubble_after(schedule, 1)[2] == 0.0
    # deeper pipelines and N > D (direct concatenation, §3.5) leave bubbles in other places too:
    # eager_opt follows the simulated timeline, never a fixed list of stages
    for D, N in ((8, 8), (8, 16), (4, 8)):
        schedule = build_schedule("chimera", D, N)
        for w in range(D):
            opt, eager = launch_plan(schedule, w, "eager_opt"), launch_plan(schedule, w, "eager")
            idle = bubble_after(schedule, w)
            assert {s for ss in opt.values() for s in ss} == {s for s, t in idle.items() if t > 0}
            assert all(eager[a] == stages for a, stages in opt.items())
    for name in ("gpipe", "dapple"):  # one stage per worker, its last backward is the last action
        schedule = build_schedule(name, 4, 8)
        assert all(launch_plan(schedule, w, "eager_opt") == {} for w in range(4))


# -- multi-process: equivalence, memory, RNG, emulated stages (one 4-rank launch) ---------------


class DropoutMLP(nn.Module, PipelineModel):
    def __init__(self, layers: int = 4, width: int = 16, p: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(p))
                                    for _ in range(layers))

    def pipeline_layers(self):
        return self.layers

    def pipeline_input(self, batch):
        return batch["x"]

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch["y"])


def _train(engine, batches, rank, N):
    opt = torch.optim.SGD(engine.local_parameters(), lr=LR, momentum=0.9)
    replica = engine.topology.replica_of(rank)
    losses, peaks = [], []
    for batch in batches:
        mine = {k: v[replica * N * B:(replica + 1) * N * B] for k, v in batch.items()}
        losses.append(engine.train_step(mine).item())
        peaks.append(engine.last_record.peak_stored_bytes)
        opt.step()
    return losses, max(peaks)


def _reference(model, batches):
    from pipeline_recipes.core.pipeline_model import sequential_loss

    return train_sgd(model, lambda batch: sequential_loss(model, batch), batches, LR)


def _features(rank: int, world: int, cases: list[dict]) -> dict:
    import torch.distributed as dist

    from pipeline_recipes.strategies.harness.emulated import EmulatedPipeline
    from pipeline_recipes.strategies.runtime.engine import build_engine
    from pipeline_recipes.strategies.schedules import simulate

    out: dict = {"equivalence": [], "memory": {}, "dropout": {}}
    for case in cases:
        D, N = case["D"], case["N"]
        W = world // D
        model = ToyMLP(layers=case.get("layers", 8), width=case.get("width", 8), tied=case.get("tied", False))
        batches = toy_batches(STEPS, W * N * B, case.get("width", 8))
        ref_losses, ref_params = _reference(copy.deepcopy(model), batches)
        names = {id(p): n for n, p in model.named_parameters()}
        layout = pipeline_layout(case["schedule"], D, B, N, W, pipelines=case.get("pipelines"),
                                 concat=case.get("concat", "direct"), grad_sync=case.get("grad_sync", "end"),
                                 recompute=case.get("recompute", "none"))
        engine = build_engine(model, layout, torch.device("cpu"), timeout_s=30.0)
        losses, peak = _train(engine, batches, rank, N)
        err = max((p.detach() - ref_params[names[id(p)]]).abs().max().item() for p in engine.local_parameters())
        out["equivalence"].append({**case, "param_err": err, "losses": losses, "ref_losses": ref_losses,
                                   "buckets": sorted(map(str, engine.synchronizer.last_buckets))})
        if "memory" in case:
            out["memory"][case["memory"]] = (engine.local_stages, peak)
        dist.barrier()

    # recompute with dropout replays the same masks: identical to the run without recompute
    for mode in ("none", "always"):
        torch.manual_seed(1234 + rank)
        engine = build_engine(DropoutMLP(), pipeline_layout("dapple", 4, B, 4, recompute=mode), torch.device("cpu"))
        losses, _ = _train(engine, toy_batches(STEPS, 4 * B, 16), rank, 4)
        out["dropout"][mode] = (losses, [p.detach().flatten().tolist() for p in engine.local_parameters()])
        dist.barrier()

    # emulated stages: a D = 4 DAPPLE step takes about the simulated makespan
    t_f = 0.01
    model = EmulatedPipeline(4, t_f=t_f, activation_numel=1024, param_numel=4096)
    engine = build_engine(model, pipeline_layout("dapple", 4, 1, 4), torch.device("cpu"))
    times = []
    for _ in range(4):
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(model.batch(4))
        times.append(time.perf_counter() - start)
    out["emulated"] = (min(times[1:]), simulate(engine.schedule_for(4), t_f, 2 * t_f).makespan)
    return out


FEATURE_CASES = [
    {"schedule": "chimera", "D": 4, "N": 4, "grad_sync": "eager"},
    {"schedule": "chimera", "D": 4, "N": 8, "grad_sync": "eager_opt", "tied": True},
    {"schedule": "chimera", "D": 2, "N": 2, "grad_sync": "eager_opt", "tied": True},
    {"schedule": "chimera", "D": 2, "N": 4, "grad_sync": "eager", "tied": True, "concat": "backward_halving"},
    {"schedule": "dapple", "D": 2, "N": 3, "grad_sync": "eager", "tied": True},
    {"schedule": "gpipe", "D": 4, "N": 4, "grad_sync": "eager", "tied": True},
    {"schedule": "dapple", "D": 4, "N": 4, "width": 32, "memory": "none"},
    {"schedule": "dapple", "D": 4, "N": 4, "width": 32, "recompute": "always", "memory": "always"},
    {"schedule": "dapple", "D": 4, "N": 4, "width": 32, "recompute": "except_last", "memory": "except_last"},
    {"schedule": "chimera", "D": 4, "N": 8, "recompute": "always", "grad_sync": "eager_opt",
     "concat": "forward_doubling"},
    {"schedule": "chimera", "D": 2, "N": 4, "recompute": "except_last", "concat": "backward_halving", "tied": True},
    {"schedule": "gpipe", "D": 2, "N": 2, "recompute": "always", "grad_sync": "eager", "tied": True},
    {"schedule": "chimera", "D": 4, "N": 4, "tied": True},  # end: stages 0, 3 and tied fused on ranks 0, 3
    {"schedule": "chimera", "D": 2, "N": 4, "tied": True},  # W = 2
]


@pytest.fixture(scope="module")
def features() -> list[dict]:
    return run_world(4, _features, FEATURE_CASES)


@pytest.mark.slow
def test_every_mode_equals_single_process(features) -> None:
    for rank_results in features:
        for r in rank_results["equivalence"]:
            label = {k: r[k] for k in r if k not in ("param_err", "losses", "ref_losses")}
            assert r["param_err"] < 1e-5, f"{label}: parameters differ by {r['param_err']:.2e}"
            assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), label


@pytest.mark.slow
def test_end_sync_fuses_each_workers_gradient_into_one_all_reduce(features) -> None:
    """Chimera copies all stages of a worker (and the tied embeddings) on the same ranks: one bucket."""
    for rank, rank_results in enumerate(features):
        for r in rank_results["equivalence"]:
            if r["schedule"] == "chimera" and r.get("grad_sync", "end") == "end":
                assert len(r["buckets"]) == 1, (rank, r["D"], r["buckets"])
                assert r["buckets"][0].count(",") >= 1, r["buckets"]  # several stages in it


@pytest.mark.slow
def test_recompute_keeps_less_activation_memory(features) -> None:
    for rank, result in enumerate(features):
        stages, none = result["memory"]["none"]
        _, always = result["memory"]["always"]
        _, except_last = result["memory"]["except_last"]
        assert none > 0 and always < none / 2, (rank, none, always)
        if 3 in stages:  # the last stage keeps its graph under except_last
            assert except_last == none
        else:
            assert except_last == always


@pytest.mark.slow
def test_recompute_replays_dropout_masks(features) -> None:
    for result in features:
        (loss_none, params_none), (loss_always, params_always) = result["dropout"]["none"], result["dropout"]["always"]
        assert loss_always == pytest.approx(loss_none, abs=1e-6)
        for a, b in zip(params_none, params_always):
            assert a == pytest.approx(b, abs=1e-6)


@pytest.mark.slow
def test_emulated_stages_take_the_simulated_time(features) -> None:
    measured, simulated = features[0]["emulated"]
    assert simulated == pytest.approx(0.21)
    assert 0.95 * simulated < measured < 3 * simulated  # loose: shared CI cores add latency


# -- benchmark script contract ------------------------------------------------------------------


@pytest.mark.slow
def test_bench_quick_writes_the_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"schedule_efficiency", "chimera_vs_dapple", "vs_torch", "bidirectional", "overhead_d1",
                         "grad_sync", "recompute", "e2e_vs_torch", "e2e_overhead_d1", "details", "meta"}
    assert data["schedule_efficiency"] and set(data["schedule_efficiency"][0]) == {
        "schedule", "D", "N", "measured_s", "simulated_s", "ratio"}
    assert data["chimera_vs_dapple"] and set(data["chimera_vs_dapple"][0]) == {
        "D", "N", "measured_ratio", "theory_ratio"}
    assert data["vs_torch"] and set(data["vs_torch"][0]) == {"ours", "theirs", "throughput_ratio"}
    # a schedule with two stages per rank (ZBV, V placement) against torch's class of the same name
    assert {(r["ours"], r["theirs"]) for r in data["vs_torch"]} >= {("zbv", "ScheduleZBVZeroBubble")}
    assert isinstance(data["overhead_d1"], float)
    assert data["grad_sync"] and data["recompute"]
    e2e = {r["theirs"]: r for r in data["e2e_vs_torch"]}
    assert set(e2e) == {"ScheduleGPipe", "Schedule1F1B", "torch best", "engine:dapple"}
    assert [k for k, r in e2e.items() if r["same_schedule"]] == ["Schedule1F1B"]  # dapple is 1F1B
    # torch's best: the class with the lower median step, and the ratio against it
    best = e2e["torch best"]["best_class"]
    assert best == min(("ScheduleGPipe", "Schedule1F1B"), key=lambda c: e2e[c]["theirs_median_s"])
    assert e2e["torch best"]["throughput_ratio"] == e2e[best]["throughput_ratio"]
    assert all(r["throughput_ratio"] > 0 for r in data["e2e_vs_torch"]) and data["e2e_overhead_d1"]["ratio"] > 0
    assert set(data["meta"]["parts"]) == {"efficiency", "vs_torch", "overhead", "grad_sync", "recompute", "e2e"}
    for row in data["schedule_efficiency"] + data["vs_torch"]:
        assert all(isinstance(v, (int, float, str)) for v in row.values())


def _rank_one_dies(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)  # no report, no traceback: as a killed or crashed process
    time.sleep(120)


@pytest.mark.slow
def test_run_world_reports_a_rank_that_died_without_waiting_for_the_timeout() -> None:
    with pytest.raises(WorldError, match=r"ranks \[1\] exited with codes \[3\] without a result"):
        run_world(2, _rank_one_dies, timeout=300)  # waiting for the timeout would say "no answer within 300s"


def test_emulated_stage_charges_a_split_backward_as_the_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """An emulated stage's forward holds t_f, a whole backward t_b (also on the first stage, whose input
    needs no gradient), the input-gradient pass I only t_b - t_w and the weight-gradient pass W t_w
    (Zero Bubble Pipeline Parallelism §2, as strategies.schedules.simulate charges them)."""
    import pipeline_recipes.strategies.harness.emulated as emulated
    from pipeline_recipes.strategies.compute.deferred_weights import WeightGradientStore, defer_weight_gradients

    held: list[float] = []
    monkeypatch.setattr(emulated, "hold", held.append)
    stage = emulated.EmulatedStage(t_f=1.0, t_b=2.0, param_numel=8, micro_batch_size=2, t_w=0.5, split_backward=True)

    def charged(run) -> list[float]:
        held.clear()
        run()
        return sorted(held)

    x = torch.ones(2, 4)  # the first stage: its input needs no gradient
    out = None

    def forward() -> None:
        nonlocal out
        out = stage(x)

    assert charged(forward) == [1.0]
    assert charged(lambda: out.sum().backward()) == [0.5, 1.5]  # B: t_b in all
    assert stage.weight.grad is not None
    store = WeightGradientStore()
    assert defer_weight_gradients([stage], store) == 1  # as a pipeline stage with split backwards sets it
    stage.weight.grad = None
    inp = torch.ones(4, 4, requires_grad=True)  # a later stage, a micro-batch twice the size
    out = stage(inp).sum()

    def input_gradient() -> None:
        with store.deferring("mb"):
            out.backward()

    assert charged(input_gradient) == [3.0]  # I: (t_b - t_w) × 2
    assert inp.grad.shape == inp.shape and stage.weight.grad is None
    assert charged(lambda: store.run("mb")) == [1.0]  # W: t_w × 2
    assert stage.weight.grad is not None and store.pending == []
    whole = emulated.EmulatedStage(t_f=1.0, t_b=2.0, param_numel=8, micro_batch_size=2)  # one node: one hold
    out = whole(torch.ones(2, 4, requires_grad=True)).sum()
    assert charged(lambda: out.backward()) == [2.0]
    with pytest.raises(ValueError, match="t_w <= t_b"):
        emulated.EmulatedStage(t_f=1.0, t_b=1.0, param_numel=8, micro_batch_size=1, t_w=2.0)


def _rank_of(rank: int, world: int) -> int:
    return rank


@pytest.mark.slow
def test_run_world_starts_again_on_another_port_when_its_port_was_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """``free_port`` only finds a port that was free: a parallel process may take it before rank 0 listens
    (seen once under pytest-xdist). Nothing ran then, so the world starts again on a new port."""
    import socket

    import pipeline_recipes.strategies.harness.spawn as spawn

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken, ports = held.getsockname()[1], []
        real = spawn.free_port
        monkeypatch.setattr(spawn, "free_port", lambda: ports.append(1) or (taken if len(ports) == 1 else real()))
        assert run_world(2, _rank_of, timeout=120) == [0, 1]
    assert len(ports) == 2
