"""What a CPU can check of the one-command GPU check (``scripts/gpu_check.sh``) and the GPU benchmark
(``scripts/bench.py --parts gpu``, ``scripts/bench_gpu.py``): the hand-written anchor computes the
transformers model's loss and gradients (with the whole logits and with the stage's chunked loss), the
compiled rows compute what the eager ones do and leave the shared blocks eager outside their steps, the
benchmark's rows run on tiny models on the CPU (the compiled rows with ``aot_eager``, the same graphs
without generating kernels: inductor's code generation for the eight graphs of the tiny run takes
about 100 s more on a 2-core machine), and the check stops, naming what is missing, where it cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench  # noqa: E402
import bench_gpu  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")

LLAMA3_LIKE = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64},
               "max_position_embeddings": 256, "tie_word_embeddings": True, "head_dim": 32}


@pytest.mark.parametrize("name, overrides", [("gpt2-tiny", {}), ("gpt2-tiny", {"tie_word_embeddings": False}),
                                             ("llama-tiny", {}), ("llama-tiny", LLAMA3_LIKE)],
                         ids=["gpt2-tiny", "gpt2-tiny-untied", "llama-tiny", "llama-tiny-llama3-rope-tied"])
def test_handwritten_model_computes_the_transformers_loss_and_gradients(name: str, overrides: dict) -> None:
    """fp32 on the CPU, the same weights: the loss, the logits and every weight's gradient of the
    hand-written model equal those of the ``transformers`` model (its fused QKV gradient: the q, k and v
    projections' gradients stacked)."""
    from pipeline_recipes.models import build_model
    from pipeline_recipes.models.causal_lm import causal_lm_loss

    hf = build_model(name, init_seed=0, **overrides).reference()
    hand = bench_gpu.handwritten(hf)
    ids = torch.randint(0, hf.config.vocab_size, (3, 32), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {id(p): p.grad.clone() for p in hf.parameters()}
    hf.zero_grad(set_to_none=True)
    logits = hand(ids)
    loss = causal_lm_loss(logits, ids)
    loss.backward()
    assert torch.allclose(logits, ref.logits, atol=1e-5, rtol=0)
    assert loss.item() == pytest.approx(ref.loss.item(), abs=1e-6)
    own = 0
    for p in hand.parameters():
        if id(p) in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[id(p)], atol=1e-6, rtol=1e-5)
        else:  # Llama's fused QKV
            own += 1
            assert p.grad is not None
    for block, layer in zip(getattr(hand, "blocks"), getattr(getattr(hf, "model", None), "layers", [])):
        a = layer.self_attn
        stacked = torch.cat([ref_grads[id(a.q_proj.weight)], ref_grads[id(a.k_proj.weight)],
                             ref_grads[id(a.v_proj.weight)]])
        torch.testing.assert_close(block.qkv_w.grad, stacked, atol=1e-6, rtol=1e-5)
    assert own == (hf.config.num_hidden_layers if hf.config.model_type == "llama" else 0)
    hand.zero_grad(set_to_none=True)
    chunked = bench_gpu.handwritten_loss(hand, ids, 7)  # the stage's loss, 7 tokens' logits at a time
    chunked.backward()
    assert chunked.item() == pytest.approx(ref.loss.item(), abs=1e-6)
    for p in hand.parameters():
        if id(p) in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[id(p)], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.slow
def test_compiled_rows_compute_the_eager_loss_and_gradients_and_switch_off(name: str) -> None:
    """fp32 on the CPU, ``aot_eager``: the stage model's blocks compiled by ``compile_blocks`` run compiled
    only inside the row's context (the transformers model shares them), and give the loss and gradients
    of the transformers model; the hand-written model's compiled blocks give its eager loss and gradients."""
    from pipeline_recipes.models import build_model
    from pipeline_recipes.strategies.compute.compile import BACKEND, compile_target, repeated_blocks
    from pipeline_recipes.core.pipeline_model import sequential_loss

    assert bench_gpu.COMPILE_BACKEND == BACKEND  # the benchmark compiles as training does
    model = build_model(name, init_seed=0)
    hf = model.reference()
    ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    ref = hf(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {id(p): p.grad.clone() for p in hf.parameters()}
    hf.zero_grad(set_to_none=True)

    compiled, line = bench_gpu.compile_stage(model, torch.device("cpu"), "aot_eager")
    assert compiled is not None and "4 repeated blocks compiled" in line
    layers = model.pipeline_layers()
    targets = [compile_target(layers[i]) for i in repeated_blocks(layers)]
    assert all(t._compiled_call_impl is None for t in targets)
    batch = {"input_ids": ids}
    with compiled():
        assert all(t._compiled_call_impl is not None for t in targets)
        loss = sequential_loss(model, batch)
        loss.backward()
    assert all(t._compiled_call_impl is None for t in targets)
    assert loss.item() == pytest.approx(ref.loss.item(), abs=1e-5)
    for p in hf.parameters():
        torch.testing.assert_close(p.grad, ref_grads[id(p)], atol=1e-5, rtol=1e-4)
    hf.zero_grad(set_to_none=True)

    hand = bench_gpu.handwritten(hf)
    eager = bench_gpu.handwritten_loss(hand, ids, 7)
    eager.backward()
    eager_grads = {id(p): p.grad.clone() for p in hand.parameters()}
    hand.zero_grad(set_to_none=True)
    fast = bench_gpu.handwritten_loss(hand, ids, 7, bench_gpu.compiled_blocks(hand, "aot_eager"))
    fast.backward()
    assert fast.item() == pytest.approx(eager.item(), abs=1e-5)
    for p in hand.parameters():
        torch.testing.assert_close(p.grad, eager_grads[id(p)], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_gpu_benchmark_rows_run_on_tiny_models_on_the_cpu(tmp_path: Path) -> None:
    """``--parts gpu --device cpu --tiny`` (the compiled rows with ``aot_eager``: see the module
    docstring): every row of both models, the ones this version lacks listed as such; figures present
    and consistent with their definitions, no graph compiled in a timed round (no timing assertions)."""
    out = tmp_path / "gpu.json"
    argv = ["--parts", "gpu", "--device", "cpu", "--tiny", "--out", str(out)]
    code = ("import functools, sys; sys.path.insert(0, 'scripts'); import bench, bench_gpu; "
            "bench_gpu.run = functools.partial(bench_gpu.run, compile_backend='aot_eager'); "
            f"sys.exit(bench.main({argv!r}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    rows = record["rows"]
    rounds = record["settings"]["rounds"]
    assert {r["model"] for r in rows} == {"gpt2-tiny", "llama-tiny"}
    assert set(record["models"]) == {"gpt2-tiny", "llama-tiny"}
    assert record["settings"]["compile_backend"] == "aot_eager"
    for model, info in record["models"].items():
        for micro_batch in ("16x1", "4x4"):
            mine = {(r["system"], r["mode"]): r for r in rows
                    if r["model"] == model and r["micro_batch"] == micro_batch}
            assert set(mine) == {("stage", m) for m in bench_gpu.STAGE_MODES} | {
                ("transformers", "eager"), ("handwritten", "eager"), ("handwritten", "compiled"),
                ("handwritten", bench_gpu.WHOLE_LOGITS)}
            whole = mine[("handwritten", bench_gpu.WHOLE_LOGITS)]
            assert whole["status"] == ("ok" if micro_batch == "4x4" else bench_gpu.WHOLE_LOGITS_TOO_LARGE)
            for mode in ("eager+cuda_graphs", "compiled+cuda_graphs"):  # CUDA graphs replay on a GPU only
                assert mine[("stage", mode)]["status"] == bench_gpu.NEEDS_CUDA
                assert "tokens_per_s" not in mine[("stage", mode)]
            ran = [("stage", "eager"), ("stage", "compiled"), ("transformers", "eager"), ("handwritten", "eager"),
                   ("handwritten", "compiled")]
            if micro_batch == "4x4":
                ran.append(("handwritten", bench_gpu.WHOLE_LOGITS))
            for key in ran:
                row = mine[key]
                assert row["status"] == "ok", row
                assert len(row["times_s"]) == rounds
                assert row["tokens_per_s"] == pytest.approx(16 * info["seq_len"] / row["step_s"])
                assert row["forward_s"] > 0 and row["backward_s"] > 0
                assert row["mfu"] is None and row["peak_reserved_bytes"] is None  # a CPU: no peak, no CUDA memory
        assert info["loss_chunk_tokens"] == 4096 and info["graphs_compiled_in_timed_rounds"] == 0
    assert "| gpt2-tiny | 4x4 | handwritten | eager |" in result.stdout
    assert "| llama-tiny | 16x1 | stage | compiled |" in result.stdout


def test_gpu_part_without_cuda_exits_2_and_bad_combinations_are_refused(capsys: pytest.CaptureFixture) -> None:
    if not torch.cuda.is_available():
        assert bench.main(["--parts", "gpu"]) == 2
        assert "no CUDA GPU" in capsys.readouterr().err
    for argv, words in ((["--parts", "gpu,overhead"], "run gpu on its own"),
                        (["--parts", "gpu", "--device", "cpu", "--tiny"], "give --out FILE"),
                        (["--parts", "gpu", "--quick", "--out", "x.json"], "--device cpu --tiny"),
                        (["--parts", "overhead", "--tiny", "--out", "x.json"], "belong to --parts gpu"),
                        (["--parts", "overhead"], "--out is required")):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2
        assert words in capsys.readouterr().err, argv


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5" time="12.0">
<testcase classname="tests.test_gpu" name="test_a" time="1.0"/>
<testcase classname="tests.test_gpu" name="test_b" time="1.0"/>
<testcase classname="tests.test_gpu" name="test_c[x]" time="1.0"><failure message="assert 1 == 2">trace</failure>
</testcase>
<testcase classname="tests.test_gpu" name="test_d" time="1.0"><error message="fixture broke">trace</error></testcase>
<testcase classname="tests.test_gpu" name="test_e" time="0.0"><skipped message="needs two GPUs"/></testcase>
</testsuite></testsuites>
"""


def test_summary_merges_the_pytest_report_and_the_benchmark_record(tmp_path: Path) -> None:
    (tmp_path / "pytest.xml").write_text(JUNIT)
    (tmp_path / "bench_gpu.json").write_text(json.dumps({"rows": [{"model": "gpt2"}]}))
    assert bench_gpu.main(["--summary", str(tmp_path), "tests=1", "bench=0", "wall_s=420"]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    tests = summary["tests"]
    assert (tests["tests"], tests["passed"], tests["failures"], tests["errors"], tests["skipped"]) == (5, 2, 1, 1, 1)
    assert [(f["test"], f["kind"], f["message"]) for f in tests["failed"]] == [
        ("tests.test_gpu::test_c[x]", "failure", "assert 1 == 2"), ("tests.test_gpu::test_d", "error", "fixture broke")]
    assert summary["bench"] == {"rows": [{"model": "gpt2"}]} and summary["wall_s"] == 420.0 and not summary["ok"]
    (tmp_path / "pytest.xml").write_text(JUNIT.replace('errors="1" failures="1"', 'errors="0" failures="0"')
                                         .replace('<failure message="assert 1 == 2">trace</failure>', "")
                                         .replace('<error message="fixture broke">trace</error>', ""))
    assert bench_gpu.main(["--summary", str(tmp_path), "tests=0", "bench=0"]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["ok"]
    (tmp_path / "bench_gpu.json").unlink()  # the benchmark did not finish
    assert bench_gpu.main(["--summary", str(tmp_path), "tests=0", "bench=124"]) == 1


def _gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


@pytest.mark.slow
@no_cuda
def test_gpu_check_without_cuda_says_so_and_exits_2(tmp_path: Path) -> None:
    result = _gpu_check(tmp_path / "out")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no CUDA" in result.stderr and "nothing was run" in result.stdout
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["gpu_check.log", "summary.json"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert not summary["ok"] and "no CUDA" in summary["environment"][0]
    assert "no CUDA" in (tmp_path / "out" / "gpu_check.log").read_text()
    usage = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: bash scripts/gpu_check.sh OUT_DIR" in usage.stderr
    other = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "x"), "bench"],
                           capture_output=True, text=True)
    assert other.returncode == 2 and "OUT_DIR [checkpoint]" in other.stderr  # the one part it can run alone
    checkpoint = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "ckpt"), "checkpoint"],
                                capture_output=True, text=True, timeout=300)
    assert checkpoint.returncode == 2 and "no CUDA" in checkpoint.stderr  # the same environment check first


@pytest.mark.slow
def test_gpu_check_names_a_missing_package(tmp_path: Path) -> None:
    """An interpreter that lacks omegaconf (hidden by a ``sitecustomize`` on ``PYTHONPATH``): the check
    names it and runs nothing."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n\n\n"
        "class HideOmegaconf:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'omegaconf':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "        return None\n\n\n"
        "sys.meta_path.insert(0, HideOmegaconf())\n")
    path = os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))
    result = _gpu_check(tmp_path / "out", PYTHONPATH=path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "missing: omegaconf." in result.stderr
    assert not (tmp_path / "out" / "pytest.xml").exists()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert any("missing: omegaconf." in line for line in summary["environment"])


def _bench_row(mb: str, system: str, mode: str, tokens: float, peak: float = 1.0, fwd: float = 1.0,
               bwd: float = 2.0, status: str = "ok") -> dict:
    return {"model": "m", "micro_batch": mb, "system": system, "mode": mode, "status": status,
            "tokens_per_s": tokens, "peak_reserved_bytes": peak, "forward_s": fwd, "backward_s": bwd}


def test_targets_table_reads_the_ratios_of_the_rows_and_the_spread_of_two_runs() -> None:
    """Hand-computed: 16 x 1 stage/hand-written 90/100 = 0.900 (< 0.95: not met) and memory 105/100 = 1.050;
    at 4 x 4 the fastest stage row is the graph row (300; the out-of-memory row is ignored), 300/200 = 1.500
    of the hand-written compiled row and 300/100 = 3.000 of the eager stage, forward/backward 1/4 = 0.250;
    the second run's graph row 330: spread 30/300 = 0.100 (> 0.05: not met). The bound: the most tokens/s
    of any row that ran (300, then 330; not the out-of-memory row's) ÷ the eager stage's 100."""
    def record(graphs: float) -> dict:
        return {"models": {"m": {}}, "rows": [
            _bench_row("16x1", "stage", "eager", 90, peak=105), _bench_row("16x1", "handwritten", "eager", 100, peak=100),
            _bench_row("16x1", "stage", "compiled", 99), _bench_row("16x1", "handwritten", "compiled", 100),
            _bench_row("4x4", "stage", "eager", 100), _bench_row("4x4", "stage", "compiled", 150),
            _bench_row("4x4", "stage", "compiled+cuda_graphs", graphs, fwd=1.0, bwd=4.0),
            _bench_row("4x4", "stage", "eager+cuda_graphs", 1e9, status="out of memory: ..."),
            _bench_row("4x4", "handwritten", "compiled", 200)]}

    assert bench_gpu.fastest_stage_mode(record(300), "m", "4x4") == "compiled+cuda_graphs"
    lines = bench_gpu.target_table(record(300), record(330)).splitlines()
    assert "| m | 16x1 | stage eager ÷ hand-written eager, tokens/s | >= 0.95 | 0.900 | 0.900 | no |" in lines
    assert "| m | 16x1 | stage compiled ÷ hand-written compiled, tokens/s | >= 0.95 | 0.990 | 0.990 | yes |" in lines
    assert "| m | 16x1 | stage eager ÷ hand-written eager, peak reserved | <= 1.1 | 1.050 | 1.050 | yes |" in lines
    assert ("| m | 4x4 | stage compiled+cuda_graphs ÷ hand-written compiled, tokens/s | >= 0.95 | 1.500 | 1.650 "
            "| yes |") in lines
    assert "| m | 4x4 | stage compiled+cuda_graphs ÷ stage eager, tokens/s | >= 1.4 | 3.000 | 3.300 | yes |" in lines
    assert "| m | 4x4 | stage compiled+cuda_graphs: forward ÷ backward | <= 0.6 | 0.250 | 0.250 | yes |" in lines
    assert "| m | 4x4 | stage compiled+cuda_graphs: run-to-run spread of tokens/s | <= 0.05 | 0.100 | | no |" in lines
    assert "| m | 4x4 | bound: the most tokens/s of any row ÷ stage eager | - | 3.000 | 3.300 | - |" in lines
    one_run = bench_gpu.target_table(record(300)).splitlines()
    assert one_run[0] == "| model | micro-batch | target | goal | run 1 | met |" and len(one_run) == 2 + 6 + 1
    assert one_run[-1] == "| m | 4x4 | bound: the most tokens/s of any row ÷ stage eager | - | 3.000 | - |"


def test_the_committed_gpu_records_are_two_runs_of_one_command() -> None:
    """benchmarks/bench_gpu.json and bench_gpu_run2.json (BENCHMARKS.md §7): the same rows and settings, on
    one GPU model, from one commit, so their spread says what a rerun does."""
    first, second = (json.loads((ROOT / "benchmarks" / name).read_text())
                     for name in ("bench_gpu.json", "bench_gpu_run2.json"))
    assert first["settings"] == second["settings"] and first["meta"]["git_commit"] == second["meta"]["git_commit"]
    assert [(r["model"], r["micro_batch"], r["system"], r["mode"]) for r in first["rows"]] == \
        [(r["model"], r["micro_batch"], r["system"], r["mode"]) for r in second["rows"]]
    assert first["meta"]["device_name"] == second["meta"]["device_name"] and not first["settings"]["tiny"]
