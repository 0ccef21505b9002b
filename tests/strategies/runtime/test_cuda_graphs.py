"""``strategy.cuda_graphs``: CUDA graphs per micro-batch slot for the repeated blocks of a stage.

On the CPU: every refusal before launch (its message names the setting, the value, the rule and the fix), the
slots a stage needs against a brute force over every synchronous schedule's action lists (and GPipe's N and
1F1B's D − s), the config key, and the wiring with ``torch.cuda.make_graphed_callables`` replaced by a spy that
records its arguments and returns the callables it was given (eager): what is captured, when, how many copies,
which slot each micro-batch takes and frees, the arguments rebuilt for the block (the eager gradients), a
micro-batch of another shape refused at run time, and the engine's steps with the spy equal to its eager steps.

On a GPU (``-m gpu``, run by ``scripts/gpu_check.sh``): DAPPLE and GPipe at D = 1 and D = 2 (two ranks sharing
the GPU over gloo) with real graphs give the eager engine's losses and weights after three steps (the first
records, the second captures and replays), in fp32 and under bf16 autocast.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from distributed import run_world
from cross_imports import import_test_module

from pipeline_recipes.models import build_model
from pipeline_recipes.recipe.check.settings import ConfigError, resolve_layout
from pipeline_recipes.strategies.compute.compile import compile_target, repeated_blocks
from pipeline_recipes.strategies.compute.cuda_graphs import ShapeChanged, StageGraphs, slots_needed, thread_local_capture
from pipeline_recipes.strategies.runtime.engine import check_layout
from pipeline_recipes.strategies.lightning.strategy import PipelineStrategy
from pipeline_recipes.core.pipeline_model import run_layers
from pipeline_recipes.strategies.schedules import build_schedule, derive_layout, get_spec, names

gpt2_batch = import_test_module("test_models").gpt2_batch

ROOT = Path(__file__).resolve().parents[3]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_TRAINER = {"accelerator": "gpu", "devices": 2, "num_nodes": 1}
STEPS = 3  # the first records, the second captures and replays, the third replays
TOL_FP32, TOL_BF16 = 1e-5, 3e-2


def _layout(trainer: dict | None = None, **strategy):
    return resolve_layout({"name": "dapple", "D": 2, "micro_batch_size": 1, **strategy},
                          trainer or GPU_TRAINER, 8, 10)


# -- settings ----------------------------------------------------------------------------------------------


def test_the_key_exists_and_defaults_to_false() -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=["strategy=dapple"]), resolve=True)
    assert cfg["strategy"]["cuda_graphs"] is False
    layout = derive_layout("dapple", 2, 2, 2, B=1, cuda_graphs=True)
    assert PipelineStrategy.from_layout(layout).pipeline_config.cuda_graphs is True


def test_the_layout_line_says_so() -> None:
    assert "strategy.cuda_graphs=true" in _layout(cuda_graphs=True).describe()
    assert _layout(cuda_graphs=True).cuda_graphs and not _layout().cuda_graphs
    assert "cuda_graphs" not in _layout().describe()


@pytest.mark.parametrize("strategy, trainer, words", [
    ({"cuda_graphs": "yes"}, None, ["strategy.cuda_graphs = 'yes'", "true or false", "strategy.cuda_graphs=false"]),
    ({"cuda_graphs": True}, {"accelerator": "cpu", "devices": 2}, [
        "strategy.cuda_graphs = true", "trainer.accelerator = cpu", "CUDA graphs need CUDA devices", "trainer.accelerator=gpu",
        "strategy.cuda_graphs=false"]),
    ({"cuda_graphs": True, "name": "pipedream_2bw"}, None, [
        "strategy=pipedream_2bw", "asynchronous", "parameter storage", "synchronous schedule",
        "strategy.cuda_graphs=false"]),
    ({"cuda_graphs": True, "recompute": "always"}, None, [
        "strategy.recompute = always", "saved RNG state", "strategy.recompute=none", "strategy.cuda_graphs=false"]),
    ({"cuda_graphs": True, "name": "zb_h1"}, None, [
        "strategy=zb_h1", "I and W", "weight gradients", "whole backwards", "strategy.cuda_graphs=false"]),
    ({"cuda_graphs": True, "name": "chimera", "concat": "backward_halving", "micro_batch_size": 2}, None, [
        "backward_halving", "half micro-batches", "strategy.concat to one of [direct, forward_doubling, auto]", "strategy.cuda_graphs=false"]),
])
def test_what_cannot_be_captured_is_refused_before_launch(strategy: dict, trainer: dict | None,
                                                          words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _layout(trainer, **strategy)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_what_can_be_captured_passes() -> None:
    for name in ("dapple", "gpipe", "gems", "chimera", "interleaved_1f1b"):
        _layout({**GPU_TRAINER, "devices": 4}, name=name, D=4, cuda_graphs=True)
    _layout({"accelerator": "auto", "devices": 2}, cuda_graphs=True)  # checked again once resolved
    _layout(name="chimera", concat="forward_doubling", cuda_graphs=True)


@pytest.mark.parametrize("settings", [{"schedule": "pipedream_2bw"}, {"recompute": "except_last"},
                                      {"schedule": "zb_h2"}])
def test_the_engine_refuses_them_too(settings: dict) -> None:
    """A layout a direct user of the engine derived without the launcher's rule: the engine's check refuses it."""
    settings = {"schedule": "dapple", **settings}
    name = settings.pop("schedule")
    with pytest.raises(ValueError, match="strategy.cuda_graphs = true"):
        check_layout(derive_layout(name, 2, 2, 2, B=1, **settings, cuda_graphs=True))
    check_layout(derive_layout(name, 2, 2, 2, B=1, **settings))  # fine without graphs


# -- slots -------------------------------------------------------------------------------------------------


def _brute_force_slots(schedule, worker: int) -> dict[int, int]:
    """For every position of the worker's list: the micro-batches of each stage whose forward is at or before it
    and whose last weight-completing backward is after it."""
    acts = schedule.workers[worker]
    out: dict[int, int] = {}
    for stage in {a.stage for a in acts}:
        first = {}
        last = {}
        for i, a in enumerate(acts):
            if a.stage != stage:
                continue
            if a.kind == "F":
                for mb in a.mbs:
                    first.setdefault((a.pipe, mb), i)
            elif a.kind in ("B", "W"):
                last[(a.pipe, a.mb)] = i
        out[stage] = max(sum(1 for k, f in first.items() if f <= t < last.get(k, len(acts)))
                         for t in range(len(acts)))
    return out


SYNCHRONOUS = [n for n in names() if not get_spec(n).asynchronous]


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_slots_equal_a_brute_force_over_the_action_lists(name: str) -> None:
    spec = get_spec(name)
    checked = 0
    for D in (1, 2, 3, 4):
        for N in (D, D + 1, 2 * D + 1, 3 * D):
            if spec.errors(_settings(name, D, N)):
                continue
            schedule = build_schedule(name, D, N)
            for worker in range(len(schedule.workers)):
                assert slots_needed(schedule, worker) == _brute_force_slots(schedule, worker), (name, D, N, worker)
            checked += 1
    assert checked


def _settings(name: str, D: int, N: int):
    from pipeline_recipes.strategies.schedules import Settings

    return Settings(name, D, N)


@pytest.mark.parametrize("D, N", [(1, 3), (2, 3), (3, 5), (4, 4), (4, 9)])
def test_gpipe_holds_every_micro_batch_and_1f1b_holds_d_minus_s(D: int, N: int) -> None:
    """GPipe: every forward before any backward, N in flight on each stage; 1F1B (PipeDream-Flush): stage s
    holds min(N, D − s)."""
    gpipe, dapple = build_schedule("gpipe", D, N), build_schedule("dapple", D, N)
    for s in range(D):
        assert slots_needed(gpipe, s) == {s: N}
        assert slots_needed(dapple, s) == {s: min(N, D - s)}


# -- wiring, with make_graphed_callables replaced by a spy ---------------------------------------------------


class Spy:
    """Records each make_graphed_callables call and returns the callables unchanged (eager)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, callables, sample_args, **kwargs):
        self.calls.append((callables, sample_args, kwargs))
        return callables


def _micro_batches(n: int, seq: int = 32) -> list[dict]:
    return [gpt2_batch(seed=i, batch=2, seq=seq, labels=True) for i in range(n)]


def _stage_step(model, batches: list[dict], graphs: StageGraphs | None, schedule) -> float:
    """GPipe on one stage holding the whole model: every forward, then every backward."""
    if graphs is not None:
        graphs.before_step(schedule)
    layers = model.pipeline_layers()
    losses = [model.pipeline_loss(run_layers(layers, model.pipeline_input(b), b), b) for b in batches]
    for loss in reversed(losses):
        loss.backward()
    return float(sum(loss.detach() for loss in losses))


def test_blocks_are_recorded_then_captured_once_per_slot_and_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", spy)
    eager, model = (build_model("gpt2-tiny", init_seed=0, n_layer=3) for _ in range(2))
    layers = model.pipeline_layers()
    keys = list(model.state_dict())
    graphs = StageGraphs({0: list(layers)}, layers, repeated_blocks(layers), worker=0)
    assert list(model.state_dict()) == keys and "captured at the second training step" in graphs.describe()
    schedule = build_schedule("gpipe", 1, 3)
    for step in range(STEPS):
        batches = _micro_batches(3)
        assert _stage_step(model, batches, graphs, schedule) == pytest.approx(_stage_step(eager, batches, None, None),
                                                                              abs=1e-6)
        assert len(spy.calls) == (0 if step == 0 else 3)  # three slots, captured once, at the second step
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-6)
    callables, samples, kwargs = spy.calls[0]
    targets = [compile_target(layers[i]) for i in repeated_blocks(layers)]
    assert [c.block for c in callables] == targets  # the stage's blocks in the order they run, one pool per slot
    assert kwargs == {"num_warmup_iters": 3, "allow_unused_input": True}
    for sample in samples:
        assert sample[0].shape == (2, 32, 64) and sample[0].requires_grad
        assert all(not t.requires_grad for t in sample[1:])
    assert {id(c) for call in spy.calls for c in call[0]} == {id(s) for g in graphs.blocks for s in g.slots}
    assert "stage 0: 3 blocks × 3 slots" in graphs.describe() and "float32[2×32×64]" in graphs.describe()


def test_a_slot_is_held_from_its_forward_to_its_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", Spy())
    model = build_model("gpt2-tiny", init_seed=0, n_layer=2)
    layers = model.pipeline_layers()
    graphs = StageGraphs({0: list(layers)}, layers, repeated_blocks(layers), worker=0)
    schedule = build_schedule("dapple", 1, 2)  # D = 1: one micro-batch in flight
    _stage_step(model, _micro_batches(1), graphs, schedule)
    graphs.before_step(schedule)
    assert [g.busy for g in graphs.blocks] == [[False], [False]]
    batch = _micro_batches(1)[0]
    loss = model.pipeline_loss(run_layers(layers, model.pipeline_input(batch), batch), batch)
    assert [g.busy for g in graphs.blocks] == [[True], [True]]
    with pytest.raises(RuntimeError, match="more micro-batches in flight than the 1 CUDA graph slots"):
        run_layers(layers, model.pipeline_input(batch), batch)
    loss.backward()
    assert [g.busy for g in graphs.blocks] == [[False], [False]]
    with torch.no_grad():  # evaluation and shape probes run eagerly, whatever their shape
        run_layers(layers, model.pipeline_input(batch), {**batch})
        short = _micro_batches(1, seq=16)[0]
        run_layers(layers, model.pipeline_input(short), short)
    assert [g.busy for g in graphs.blocks] == [[False], [False]]


def test_a_micro_batch_of_another_shape_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", Spy())
    model = build_model("gpt2-tiny", init_seed=0, n_layer=2)
    layers = model.pipeline_layers()
    graphs = StageGraphs({0: list(layers)}, layers, repeated_blocks(layers), worker=0)
    schedule = build_schedule("gpipe", 1, 1)
    _stage_step(model, _micro_batches(1), graphs, schedule)
    with pytest.raises(ShapeChanged) as err:
        _stage_step(model, _micro_batches(1, seq=16), graphs, schedule)
    message = str(err.value)
    for word in ("strategy.cuda_graphs = true", "input: float32[2×16×64]", "input: float32[2×32×64]",
                 "model.seq_len", "data.drop_last=true", "strategy.cuda_graphs=false"):
        assert word in message, message


def test_captures_forbid_unsafe_calls_in_this_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A data loader's pin-memory thread may allocate while a graph is captured (``thread_local``)."""
    seen = []
    monkeypatch.setattr(torch.cuda, "graph", lambda *args, **kwargs: seen.append(kwargs))
    with thread_local_capture():
        torch.cuda.graph(object(), pool=None)
        torch.cuda.graph(object(), capture_error_mode="global")
    torch.cuda.graph(object())
    assert seen == [{"pool": None, "capture_error_mode": "thread_local"}, {"capture_error_mode": "global"}, {}]


def test_switched_off_blocks_run_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark's eager rows share the blocks: switched off, nothing is recorded or replayed."""
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", Spy())
    model = build_model("gpt2-tiny", init_seed=0, n_layer=2)
    layers = model.pipeline_layers()
    graphs = StageGraphs({0: list(layers)}, layers, repeated_blocks(layers), worker=0)
    graphs.switch(False)
    _stage_step(model, _micro_batches(1), None, None)
    assert all(g.plan is None for g in graphs.blocks)
    with graphs.switched_on():
        _stage_step(model, _micro_batches(1), graphs, build_schedule("gpipe", 1, 1))
    assert all(g.plan is not None for g in graphs.blocks)
    assert all("_stage_graphs" not in g.block.__dict__ for g in graphs.blocks)


def test_the_lightning_module_routes_the_blocks_when_fitting_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from pipeline_recipes.strategies.lightning.strategy import PipelineModule

    model = build_model("gpt2-tiny", init_seed=0, n_layer=2)
    module = PipelineModule(model)
    layers = model.pipeline_layers()
    engine = SimpleNamespace(config=SimpleNamespace(cuda_graphs=True), stage_graphs=None,
                             stage_layers={0: list(layers)}, setup=SimpleNamespace(rank=0),
                             topology=SimpleNamespace(worker_of=lambda rank: rank))
    monkeypatch.setattr(PipelineModule, "pipeline", property(lambda self: engine))
    module.on_fit_start()
    assert isinstance(engine.stage_graphs, StageGraphs)
    assert [g.block for g in engine.stage_graphs.blocks] == [compile_target(layers[i]) for i in (1, 2)]
    first = engine.stage_graphs
    module.on_fit_start()  # a second fit keeps them
    assert engine.stage_graphs is first


# -- the engine: the spy on the CPU, real graphs on a GPU ----------------------------------------------------


def _train(rank: int, world: int, cases: list[dict]) -> list[dict]:
    import torch.distributed as dist

    from pipeline_recipes.strategies.compute.cuda_graphs import StageGraphs, slots_needed
    from pipeline_recipes.strategies.runtime.engine import build_engine

    cuda = torch.cuda.is_available() and cases[0].get("cuda", False)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    spy = Spy()
    if not cuda:
        torch.cuda.make_graphed_callables = spy
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
    out = []
    for case in cases:
        N, B = case["N"], 2
        runs = {}
        for graphed in (False, True):
            model = build_model("gpt2-tiny", init_seed=0, n_layer=4)
            blocks = repeated_blocks(model.pipeline_layers())
            engine = build_engine(model, derive_layout(case["schedule"], world, world, N * B, B=B, cuda_graphs=graphed),
                                  device)
            lines: list[str] = []
            if graphed:
                engine.stage_graphs = StageGraphs(engine.stage_layers, model.pipeline_layers(), blocks,
                                                  engine.topology.worker_of(rank), report=lines.append)
            params = engine.local_parameters()
            opt = torch.optim.SGD(params, lr=0.1)
            losses = []
            for step in range(STEPS):
                batch = {k: v.to(device) for k, v in gpt2_batch(seed=step, batch=N * B, labels=True).items()}
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=case["bf16"], cache_enabled=False):
                    losses.append(engine.train_step(batch).item())
                opt.step()
            names = {id(p): n for n, p in model.named_parameters()}
            runs[graphed] = (losses, {names[id(p)]: p.detach().float().cpu() for p in params}, lines)
        schedule = engine.schedule_for(N)
        worker = engine.topology.worker_of(rank)
        errs = {n: (runs[True][1][n] - p).abs().max().item() for n, p in runs[False][1].items()}
        out.append({**case, "losses": runs[True][0], "eager_losses": runs[False][0], "errs": errs,
                    "lines": runs[True][2], "captured": engine.stage_graphs.captured,
                    "slots": slots_needed(schedule, worker), "device": str(device)})
        dist.barrier()
    if not cuda:
        out.append({"spied": len(spy.calls)})
    return out


def _check(results: list[list[dict]], tol_fp32: float, tol_bf16: float) -> None:
    for per_rank in results:
        for r in per_rank:
            if "spied" in r:
                continue
            tol = tol_bf16 if r["bf16"] else tol_fp32
            label = f"{r['schedule']} N={r['N']} bf16={r['bf16']} on {r['device']}"
            assert r["losses"] == pytest.approx(r["eager_losses"], abs=tol, rel=tol), label
            assert max(r["errs"].values()) < tol, (label, r["errs"])
            assert r["captured"] == r["slots"], label
            assert len(r["lines"]) == 1 and "captured per micro-batch slot" in r["lines"][0], label


@pytest.mark.slow
def test_engine_steps_with_the_spy_equal_its_eager_steps() -> None:
    """Two ranks over gloo: the engine captures at its second step (before any message) and replays."""
    cases = [{"schedule": s, "N": 3, "bf16": False} for s in ("dapple", "gpipe")]
    results = run_world(2, _train, cases, timeout=300)
    _check(results, 1e-6, 1e-6)
    assert all(r[-1]["spied"] > 0 for r in results)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_graph_steps_equal_eager_steps_on_gpu(world: int) -> None:
    """DAPPLE and GPipe at D = ``world`` on GPU 0 (two ranks share it over gloo), fp32 (TF32 off) and bf16."""
    cases = [{"schedule": s, "N": 2 * world + 1, "bf16": bf16, "cuda": True}
             for s in ("dapple", "gpipe") for bf16 in (False, True)]
    results = run_world(world, _train, cases, timeout=300)
    assert all(r["device"] == "cuda:0" for rank in results for r in rank)
    _check(results, TOL_FP32, TOL_BF16)


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "bert-tiny"])
def test_the_cost_model_finds_the_blocks_the_graphs_capture(model: str) -> None:
    """The planner's repeated layers (from its cost names) are the modules ``strategy.cuda_graphs`` and
    ``model.compile`` treat (:func:`repeated_blocks` on the built model)."""
    from pipeline_recipes.planner.estimate import estimate_costs

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=[f"model={model}"]), resolve=True)
    layers = build_model(cfg["model"]).pipeline_layers()
    costs = estimate_costs(cfg["model"])
    assert costs.repeated_layers() == frozenset(repeated_blocks(layers)) and len(costs.repeated_layers()) >= 2


@pytest.mark.parametrize("D, N", [(2, 4), (3, 5)])
def test_graph_pools_count_one_copy_per_micro_batch_held(D: int, N: int) -> None:
    """GPipe holds all N micro-batches on every stage, 1F1B D − s (GPipe §2.2; the Chimera paper's Table 2):
    the predicted pools of stage s are that many times one copy of its blocks."""
    from pipeline_recipes.planner.estimate import estimate_costs
    from pipeline_recipes.planner.memory import predict_memory
    from pipeline_recipes.planner.predict import Candidate, runtime_partition

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=["model=gpt2-tiny"]), resolve=True)
    costs = estimate_costs(cfg["model"], precision="bf16-mixed", device="cuda")
    partition = runtime_partition(costs, D)
    for name, held in (("gpipe", lambda s: N), ("dapple", lambda s: min(N, D - s))):
        cand = Candidate.of(name, 1, D, 2, N, cuda_graphs=True)
        with_graphs = predict_memory(costs, cand, partition).workers
        without = predict_memory(costs, Candidate.of(name, 1, D, 2, N), partition).workers
        for s in range(D):
            copy = costs.graph_slot_bytes(partition[s], 2)
            assert copy > 0
            assert with_graphs[s].graph_pools == pytest.approx(held(s) * copy)
            assert with_graphs[s].peak == pytest.approx(without[s].peak + held(s) * copy)
