"""The memory pre-flight under the run's precision, ``preflight=report``, and the fitting layouts it lists.

The expected peaks are measurements: of ``max_memory_reserved`` on one GPU (figures below), and of the CPU
allocator's bytes during a real ``bf16-mixed`` step (torch's profiler, ``profile_memory=True``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30

# Measured on one H200 (torch 2.11, bf16-mixed, eager), model=gpt2, data.global_batch_size=16,
# trainer=gpu trainer.devices=1: torch.cuda.max_memory_reserved of the run with preflight=false.
H200_MEASURED_GIB = {
    ("strategy=single",): 99.7,
    ("strategy=gpipe", "strategy.D=1", "strategy.micro_batch_size=16"): 94.2,
    ("strategy=dapple", "strategy.D=1", "strategy.micro_batch_size=4"): 43.7,
}
# The model as it was measured: GPT-2's python GELU and a head that returns the whole logits.
COMMON = ("trainer=gpu", "trainer.devices=1", "model=gpt2", "data.global_batch_size=16", "logger=none",
          "model.activation_function=gelu_new", "model.loss_chunk_tokens=null")


def _config(overrides: tuple[str, ...]) -> tuple[dict[str, Any], Any]:
    from pipeline_recipes.recipe.launch.main import num_layers
    from pipeline_recipes.recipe.check.settings import resolve_layout

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)
    layout = resolve_layout(cfg["strategy"], cfg["trainer"], cfg["data"]["global_batch_size"], num_layers(cfg["model"]))
    return cfg, layout


@pytest.mark.parametrize("layout_overrides", list(H200_MEASURED_GIB), ids=lambda o: o[0].split("=")[1])
def test_report_predicts_the_measured_gpu_peaks_within_ten_percent(layout_overrides: tuple[str, ...]) -> None:
    """bf16-mixed on CUDA, predicted on this machine without a GPU (fake tensors, CPU autocast plus
    CUDA's kernels); an fp32 estimate of the activations was about twice too high."""
    from pipeline_recipes.planner.preflight import predict_layout

    cfg, layout = _config((*COMMON, *layout_overrides))
    assert cfg["trainer"]["precision"] == "bf16-mixed"
    report = predict_layout(cfg, layout)
    assert report["device"] == "cuda" and report["precision"] == "bf16-mixed"
    (peak,) = report["predicted_peak_bytes_per_rank"]
    measured = H200_MEASURED_GIB[layout_overrides] * GIB
    assert abs(peak - measured) <= 0.10 * measured, f"predicted {peak / GIB:.1f} GiB, measured {measured / GIB} GiB"
    # autocast's bf16 copies of the blocks' and the head's weight matrices, once: 2 bytes per parameter
    assert report["autocast_weight_copies_bytes"] == pytest.approx(2 * (64 * 12 * 1280**2 + 50257 * 1280), rel=1e-3)


def test_report_lists_every_rank() -> None:
    from pipeline_recipes.planner.preflight import predict_layout

    cfg, layout = _config(("trainer=gpu", "trainer.devices=4", "model=gpt2-tiny", "strategy=dapple", "strategy.D=2",
                           "data.global_batch_size=8", "logger=none"))
    report = predict_layout(cfg, layout, budget_bytes=GIB)
    assert len(report["predicted_peak_bytes_per_rank"]) == 4 and report["fits"] is True
    assert json.loads(json.dumps(report)) == report


def _measured_cpu_peak(model_cfg: dict[str, Any], batch_size: int) -> int:
    """Bytes of tensors alive at the peak of the second bf16-mixed training step on CPU (fused AdamW):
    the weights and AdamW moments alive at its start plus the CPU allocator's highest net allocation
    during the step, from the profiler's memory events."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pipeline_recipes.models import build_model
    from pipeline_recipes.planner.profile import make_batch
    from pipeline_recipes.core.pipeline_model import sequential_loss

    model = build_model({**model_cfg, "init_seed": 0}, device="cpu")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = make_batch(model, batch_size)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sequential_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # creates the AdamW moments
    tensors = [*model.parameters(), *(v for state in opt.state.values() for v in state.values() if torch.is_tensor(v))]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    net = top = 0
    for _, nbytes in events:
        net += nbytes
        top = max(top, net)
    return held + top


@pytest.mark.slow
def test_cpu_bf16_mixed_step_peak_within_ten_percent_of_the_prediction() -> None:
    from pipeline_recipes.models import hydra_config
    from pipeline_recipes.planner.estimate import estimate_costs
    from pipeline_recipes.planner.memory import predict_memory
    from pipeline_recipes.planner.predict import Candidate

    model_cfg = {**hydra_config("gpt2-tiny"), "n_layer": 2, "n_embd": 256, "n_head": 4, "seq_len": 128,
                 "n_positions": 128, "vocab_size": 4096, "resid_pdrop": 0.1, "attn_pdrop": 0.1}
    model_cfg.pop("_target_")
    B = 8
    measured = _measured_cpu_peak(model_cfg, B)
    costs = estimate_costs(model_cfg, precision="bf16-mixed", device="cpu")
    predicted = predict_memory(costs, Candidate.of("gpipe", 1, 1, B, 1), keep_sends=True).max_rank
    assert abs(measured - predicted) <= 0.10 * predicted, f"measured {measured / 2**20:.0f} MiB, " \
                                                         f"predicted {predicted / 2**20:.0f} MiB"
    fp32 = predict_memory(estimate_costs(model_cfg, device="cpu"), Candidate.of("gpipe", 1, 1, B, 1),
                          keep_sends=True).max_rank
    assert fp32 - measured > 0.10 * fp32  # the fp32 estimate, the pre-flight's before, is not within 10 %


@pytest.mark.slow
def test_fitting_options_are_those_of_every_layout_in_order() -> None:
    """The pruned, early-stopping search lists what predicting every layout and sorting gives (the configured
    layout's schedule first, then no recomputation, then its own optimizer sharding, then the largest B)."""
    from pipeline_recipes.models import hydra_config
    from pipeline_recipes.planner.estimate import estimate_costs
    from pipeline_recipes.planner.memory import Budget, predict_memory
    from pipeline_recipes.planner.predict import Candidate, candidates
    from pipeline_recipes.planner.preflight import _fitting_options

    costs = estimate_costs(hydra_config("gpt2-tiny"))
    cand = Candidate.of("dapple", 1, 4, 1, 16)
    for budget in (Budget(host=20 * 2**20), Budget(per_rank=5 * 2**20), Budget(host=GIB)):
        every = []
        for c in candidates(4, 16, costs.num_layers):
            peaks = predict_memory(costs, c, keep_sends=True).per_rank
            if budget.fits(peaks, 4):
                every.append((c, max(peaks)))
        every.sort(key=lambda x: (x[0].strategy != "dapple", x[0].recompute != "none", x[0].shard_optimizer, -x[0].B,
                                  x[1]))
        assert _fitting_options(costs, cand, budget, 4, True, 5) == every[:5]


@pytest.mark.slow
def test_train_preflight_report_prints_one_json_line_and_launches_nothing(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}", "trainer=gpu", "trainer.devices=1",
           "model=gpt2", "strategy=single", "data.global_batch_size=16", "preflight=report", "logger=none"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    report = json.loads(lines[0])
    peaks = report["predicted_peak_bytes_per_rank"]
    assert isinstance(peaks, list) and len(peaks) == 1 and peaks[0] > 20 * GIB
    assert report["device"] == "cuda" and report["fits"] is None  # no GPU here to compare with
    assert not (tmp_path / "logs").exists() and not (tmp_path / "job.yaml").exists()  # no worker started
    assert not (tmp_path / "results.json").exists()


def test_planner_costs_take_the_memory_of_the_runs_precision() -> None:
    """A profile (times, memory measured without autocast) keeps its times and takes the bf16-mixed
    estimate's memory fields; an fp32 run keeps the profile's."""
    from dataclasses import replace

    from pipeline_recipes.models import hydra_config
    from pipeline_recipes.planner.costs import LinearFit
    from pipeline_recipes.planner.estimate import estimate_costs, with_run_memory

    cfg = hydra_config("gpt2-tiny")
    fp32 = estimate_costs(cfg, device="cuda")
    profiled = replace(fp32, kind="profile",
                       layers=tuple(replace(layer, fwd=LinearFit(1e-3, 2e-3)) for layer in fp32.layers))
    bf16 = estimate_costs(cfg, precision="bf16-mixed", device="cuda")
    mixed = with_run_memory(profiled, cfg, precision="bf16-mixed", device="cuda")
    assert [layer.fwd for layer in mixed.layers] == [LinearFit(1e-3, 2e-3)] * len(fp32.layers)
    assert [(m.stored_added, m.cast_bytes) for m in mixed.layers] == [(e.stored_added, e.cast_bytes)
                                                                       for e in bf16.layers]
    assert sum(m.cast_bytes for m in mixed.layers) > 0
    assert with_run_memory(profiled, cfg, precision="32-true", device="cuda") is profiled


def _bench_row(record: dict[str, Any], model: str, micro_batch: str, mode: str) -> dict[str, Any]:
    (row,) = [r for r in record["rows"] if (r["model"], r["micro_batch"], r["system"], r["mode"])
              == (model, micro_batch, "stage", mode)]
    return row


def test_cuda_graph_pools_are_predicted_as_measured_on_one_h200() -> None:
    """The GPU benchmark's D = 1 stage path (benchmarks/bench_gpu.json: the model as conf builds it, DAPPLE,
    micro-batch 4 × 4, bf16 autocast, fused AdamW) measured on one H200 with and without
    ``strategy.cuda_graphs``: the pre-flight's peak with the graphs within 10 % of the measured peak, and
    its pools within 10 % of what the graphs added to the eager row's peak."""
    from pipeline_recipes.planner.preflight import predict_layout

    record = json.loads((ROOT / "benchmarks" / "bench_gpu.json").read_text())
    eager = _bench_row(record, "gpt2", "4x4", "eager")["peak_reserved_bytes"]
    graphs = _bench_row(record, "gpt2", "4x4", "eager+cuda_graphs")["peak_reserved_bytes"]
    assert "H200" in record["meta"]["device_name"]
    cfg, layout = _config(("trainer=gpu", "trainer.devices=1", "model=gpt2", "data.global_batch_size=16",
                           "logger=none", "strategy=dapple", "strategy.D=1", "strategy.micro_batch_size=4",
                           "strategy.cuda_graphs=true"))
    report = predict_layout(cfg, layout)
    (peak,) = report["predicted_peak_bytes_per_rank"]
    pools = report["cuda_graph_pools_bytes"]
    assert abs(peak - graphs) <= 0.10 * graphs, f"predicted {peak / GIB:.2f} GiB, measured {graphs / GIB:.2f} GiB"
    assert abs(pools - (graphs - eager)) <= 0.10 * (graphs - eager), \
        f"predicted pools {pools / GIB:.2f} GiB, the graphs added {(graphs - eager) / GIB:.2f} GiB"
    eager_layout = dataclasses.replace(layout, cuda_graphs=False)  # the pre-flight reads the layout, not the config
    assert predict_layout(cfg, eager_layout)["predicted_peak_bytes_per_rank"][0] == pytest.approx(peak - pools)


@pytest.mark.slow
def test_a_refusal_with_cuda_graphs_counts_their_pools_and_suggests_what_they_can_run() -> None:
    """The message names the pools; every suggested layout can run with ``strategy.cuda_graphs=true`` (no
    recomputation, no split backward, synchronous) and is predicted with its pools."""
    from pipeline_recipes.planner.costs import format_bytes
    from pipeline_recipes.planner.preflight import PreflightError, candidate_of, predict_layout, preflight
    from pipeline_recipes.strategies.compute.cuda_graph_rules import cuda_graphs_error
    from pipeline_recipes.strategies.schedules import get_spec

    overrides = ("trainer=gpu", "trainer.devices=4", "model=gpt2-tiny", "strategy=dapple", "strategy.D=2",
                 "strategy.micro_batch_size=4", "data.global_batch_size=32", "logger=none",
                 "strategy.cuda_graphs=true")
    cfg, layout = _config(overrides)
    need = predict_layout(cfg, layout)["predicted_peak_bytes_per_rank"]
    with pytest.raises(PreflightError) as err:
        preflight(cfg, layout, budget_bytes=int(max(need) * 0.9))
    message = str(err.value)
    assert "CUDA graph pools (strategy.cuda_graphs)" in message
    suggested = [line.split("#")[0].split() for line in message.splitlines() if line.startswith("  strategy=")]
    assert suggested, message
    for line in suggested:
        settings = dict(item.split("=", 1) for item in line)
        name, D = settings["strategy"], int(settings["strategy.D"])
        cfg_s, layout_s = _config((*overrides, *line))
        schedule = candidate_of(layout_s).schedule()
        assert (schedule.name, schedule.stages) == (name, D * len(schedule.stages_of(0))), line
        assert cuda_graphs_error(True, get_spec(name), settings["strategy.recompute"], schedule) is None, line
        report = predict_layout(cfg_s, layout_s)
        assert report["cuda_graph_pools_bytes"] > 0 and max(report["predicted_peak_bytes_per_rank"]) <= max(need) * 0.9
    # this layout fits once its pools are gone: the message says so, with the peak predicted without them
    cfg_e, layout_e = _config((*overrides[:-1], "strategy.cuda_graphs=false"))
    eager = max(predict_layout(cfg_e, layout_e)["predicted_peak_bytes_per_rank"])
    assert eager <= max(need) * 0.9
    assert (f"without CUDA graphs this layout is predicted to fit (peak {format_bytes(eager)}/rank): "
            "strategy.cuda_graphs=false") in message.splitlines()


@pytest.mark.slow
def test_a_refusal_that_no_layout_with_cuda_graphs_fits_lists_layouts_without_them() -> None:
    """A budget below every layout that CUDA graphs can run, but above some without them (recomputation,
    split backwards, or no pools): the message says so and lists those, each predicted to fit, pools-free."""
    from pipeline_recipes.planner.preflight import PreflightError, predict_layout, preflight

    overrides = ("trainer=gpu", "trainer.devices=4", "model=gpt2-tiny", "strategy=dapple", "strategy.D=2",
                 "strategy.micro_batch_size=4", "data.global_batch_size=32", "logger=none")
    cfg_e, layout_e = _config((*overrides, "strategy.cuda_graphs=false"))
    budget = int(0.6 * max(predict_layout(cfg_e, layout_e)["predicted_peak_bytes_per_rank"]))
    cfg, layout = _config((*overrides, "strategy.cuda_graphs=true"))
    with pytest.raises(PreflightError) as err:
        preflight(cfg, layout, budget_bytes=budget)
    lines = str(err.value).splitlines()
    assert any(line.startswith("no layout of 4 processes with global batch 32 with strategy.cuda_graphs=true is "
                               "predicted to fit") for line in lines), lines
    assert "without CUDA graphs, layouts predicted to fit:" in lines
    suggested = [line.split("#")[0].split() for line in lines if line.startswith("  strategy=")]
    assert suggested
    for line in suggested:
        assert line[-1] == "strategy.cuda_graphs=false", line
        report = predict_layout(*_config((*overrides, *line)))
        assert report["cuda_graph_pools_bytes"] == 0 and max(report["predicted_peak_bytes_per_rank"]) <= budget, line
