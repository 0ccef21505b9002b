"""Compiled stages (``model.compile``): each repeated block compiled with inductor on the CPU gives the eager
model's loss and gradients (GPT-2, Llama, BERT), one graph serves every block, the state_dict keys stay,
split backwards still defer their weight gradients to ``W``, and pipelines with a split backward or with
recomputation equal the single-process eager step. Every model here has blocks of one shape (hidden 64,
micro-batches of 2 × 32 tokens; BERT 4 × 32).

Inductor (the backend training uses) compiles GPT-2's block in one test; the others run TorchDynamo and
AOTAutograd with ``aot_eager``, the same capture, joint graph and partition into forward and backward
without code generation, which is where a split backward or recomputation could go wrong, at seconds
instead of the 20-70 s each new inductor graph costs on two cores with a cold cache (a fresh CI machine)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from distributed import run_world
from cross_imports import import_test_module

from pipeline_recipes.models import build_model
from pipeline_recipes.core.node import NodeDevices
from pipeline_recipes.recipe.check.accelerator import resolve_accelerator, resolve_compile, with_compile
from pipeline_recipes.recipe.check.settings import ConfigError
from pipeline_recipes.strategies.compute.compile import compile_blocks, repeated_blocks
from pipeline_recipes.strategies.compute.deferred_weights import WeightGradientStore, defer_weight_gradients
from pipeline_recipes.strategies.lightning.strategy import PipelineModule
from pipeline_recipes.core.pipeline_model import sequential_loss

_models = import_test_module("test_models")
gpt2_batch, bert_batch = _models.gpt2_batch, _models.bert_batch

TINY = {"gpt2-tiny": {"n_layer": 2}, "llama-tiny": {"num_hidden_layers": 2}, "bert-tiny": {"num_hidden_layers": 2}}
CAPTURE = "aot_eager"  # TorchDynamo + AOTAutograd, no code generation
CPU = torch.device("cpu")


def _model(name: str):
    return build_model(name, init_seed=0, **TINY[name])


def _batch(name: str) -> dict:
    return bert_batch() if name.startswith("bert") else gpt2_batch(batch=2, labels=True)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name, backend", [
    pytest.param("gpt2-tiny", "inductor", marks=pytest.mark.slow),  # 20-70 s on two cores, cold cache
    pytest.param("llama-tiny", CAPTURE, marks=pytest.mark.slow),
    pytest.param("bert-tiny", CAPTURE, marks=pytest.mark.slow),
])
def test_compiled_blocks_equal_the_eager_model(name: str, backend: str) -> None:
    """Loss and every gradient within fp32 rounding of the eager twin (same init); one graph for both
    blocks; state_dict keys unchanged."""
    eager = _model(name)
    compiled = copy.deepcopy(eager)
    layers = compiled.pipeline_layers()
    blocks = repeated_blocks(layers)
    assert blocks == list(range(1, len(layers) - 1))  # every layer but the embedding and the head
    done = compile_blocks(layers, blocks, CPU, backend=backend)
    assert (done.compiled, done.eager_linears, done.fallback) == (2, 0, None)
    counters.clear()  # after the compiler's probe
    batch = _batch(name)
    loss = sequential_loss(compiled, batch)
    loss.backward()
    ref = sequential_loss(eager, batch)
    ref.backward()
    assert counters["stats"]["unique_graphs"] == 1, "both blocks should reuse one compiled graph"
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    want, got = _grads(eager), _grads(compiled)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4, msg=n)
    assert list(compiled.state_dict()) == list(eager.state_dict())


def test_compiled_blocks_under_bf16_autocast_stay_within_bf16_rounding() -> None:
    """bf16-mixed (autocast): the compiled model's loss and gradients within bf16 rounding of the eager
    model's (relative norm error), as a GPU's default precision runs them."""
    eager = _model("gpt2-tiny")
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled.pipeline_layers(), repeated_blocks(compiled.pipeline_layers()), CPU, backend=CAPTURE)
    batch = _batch("gpt2-tiny")
    losses = []
    for model in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sequential_loss(model, batch)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    want, got = _grads(eager), _grads(compiled)
    for n in want:
        assert (got[n] - want[n]).norm() <= 1e-2 * want[n].norm() + 1e-6, n


@pytest.mark.slow
def test_split_backward_keeps_weight_gradients_for_w() -> None:
    """Inside a compiled block the deferring linear layers run eagerly: after ``I`` their weights have no
    gradient yet, after ``W`` they equal the eager block's (a traced one would have computed them in ``I``)."""
    layers = _model("gpt2-tiny").pipeline_layers()
    eager, block = copy.deepcopy(layers[1]), layers[1]
    store = WeightGradientStore()
    deferring = defer_weight_gradients([block], store)
    assert compile_blocks(layers, [1], CPU, backend=CAPTURE).eager_linears == 1
    x = torch.randn(2, 32, 64)
    x_eager, x_compiled = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_eager, out = eager(x_eager), block(x_compiled)
    grad = torch.randn_like(out)
    out_eager.backward(grad)
    with store.deferring(0):
        out.backward(grad)
    linears = [m for m in block.modules() if hasattr(m, "_weight_store")]
    assert len(linears) == deferring == 4
    assert all(m.weight.grad is None for m in linears), "I computed weight gradients it should defer"
    torch.testing.assert_close(x_compiled.grad, x_eager.grad, atol=1e-5, rtol=1e-4)
    store.run(0)
    for (n, p), q in zip(eager.named_parameters(), block.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_a_compiler_that_cannot_run_leaves_the_blocks_eager() -> None:
    """A failing compiler stack (here: a backend torch does not have) is reported in one line naming the
    setting that skips it, and no block is touched."""
    layers = _model("gpt2-tiny").pipeline_layers()
    done = compile_blocks(layers, [1, 2], CPU, backend="no-such-backend")
    assert done.compiled == 0 and done.fallback is not None
    line = done.describe()
    assert "\n" not in line and "no-such-backend" in line and "set model.compile=false" in line
    assert all(layers[i].block._compiled_call_impl is None for i in (1, 2))


def test_the_lightning_module_compiles_the_blocks_when_fitting_starts() -> None:
    """``model.compile`` reaches the module the recipe trains (pipelines and baselines alike): it lists the
    blocks while it holds every layer and compiles them once, when fitting starts."""
    model = _model("llama-tiny")
    eager = PipelineModule(_model("llama-tiny"))
    module = PipelineModule(model, compile_blocks=True)
    assert (eager.blocks_to_compile, module.blocks_to_compile) == ([], [1, 2])
    module.on_fit_start()
    layers = model.pipeline_layers()
    assert all(layers[i].layer._compiled_call_impl is not None for i in (1, 2))  # LlamaDecoderLayer, in place
    assert module.blocks_to_compile == []


def _compiled_pipeline_vs_eager(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """One training step of gpt2-tiny (two blocks) under each case's schedule, blocks compiled, against the
    single-process eager model's loss and gradients."""
    import torch.distributed as dist

    from pipeline_recipes.strategies.runtime.engine import build_engine
    from pipeline_recipes.strategies.schedules import derive_layout

    out = []
    for case in cases:
        model = _model("gpt2-tiny")
        reference = copy.deepcopy(model)
        N, B = case["N"], 2
        batch = gpt2_batch(seed=1, batch=N * B, labels=True)
        ref_loss = sequential_loss(reference, batch)
        ref_loss.backward()
        ref_grads = _grads(reference)
        names = {id(p): n for n, p in model.named_parameters()}
        blocks = repeated_blocks(model.pipeline_layers())  # before the engine drops the remote layers
        layout = derive_layout(case["schedule"], world, world, N * B, B=B, recompute=case["recompute"])
        engine = build_engine(model, layout, CPU, timeout_s=60.0)
        done = compile_blocks(model.pipeline_layers(), blocks, CPU, backend=CAPTURE)
        loss = engine.train_step(batch).item()
        err = max((p.grad - ref_grads[names[id(p)]]).abs().max().item() for p in engine.local_parameters())
        out.append({**case, "loss": loss, "ref_loss": ref_loss.item(), "grad_err": err,
                    "compiled": done.compiled, "eager_linears": done.eager_linears})
        dist.barrier()
    return out


@pytest.mark.slow
def test_compiled_pipelines_equal_the_eager_single_process_step() -> None:
    """W = 1, D = 2: ZB-H1 (stage 1 splits its backward into I and W) and GPipe recomputing every stage."""
    cases = [{"schedule": "zb_h1", "N": 2, "recompute": "none"}, {"schedule": "gpipe", "N": 2, "recompute": "always"}]
    results = run_world(2, _compiled_pipeline_vs_eager, cases)
    for rank, rank_results in enumerate(results):
        for r in rank_results:
            assert r["compiled"] == 1, r  # each rank holds one of the two blocks
            assert r["grad_err"] < 1e-5, r
            assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5), r
    zb = [r for rank_results in results for r in rank_results if r["schedule"] == "zb_h1"]
    assert [r["eager_linears"] for r in zb] == [1, 1]  # both stages split their backward (the first one too)


def test_model_compile_setting_is_checked_before_launch() -> None:
    cpu = resolve_accelerator({"accelerator": "cpu"}, NodeDevices())
    gpu = resolve_accelerator({"accelerator": "auto"}, NodeDevices(cuda_devices=8, bf16=True, gpu_name="NVIDIA H100"))
    assert (resolve_compile("auto", "cpu"), resolve_compile("auto", "gpu"), resolve_compile(True, "cpu")) == (
        False, True, True)
    assert resolve_compile(False, "gpu") is False
    assert with_compile(gpu, "auto").describe().endswith("compiled blocks (model.compile=auto)")
    assert with_compile(cpu, "auto").describe() == cpu.describe()  # the CPU's default says nothing
    assert with_compile(gpu, False).describe().endswith("eager blocks (model.compile=false)")
    with pytest.raises(ConfigError, match=r"model.compile = 'atuo' is not one of auto, true or false .*did you mean "
                                          r"'auto'\? set model.compile=auto"):
        resolve_compile("atuo", "gpu")
    with pytest.raises(ConfigError, match=r"model.compile = 1 .*set model.compile to one of \[auto, true, false\]"):
        resolve_compile(1, "gpu")
