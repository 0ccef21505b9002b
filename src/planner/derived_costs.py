"""Per-layer times on a device that is not here, derived from FLOPs at a calibrated efficiency.

Chimera §3.4 needs each stage's forward and backward time; without the hardware (and without a measured cost table
under ``benchmarks/``) the planner derives them: a transformer block's forward costs ``2·P·s + 4·s²·h`` FLOPs per
sample (its ``P`` weights applied to ``s`` tokens, plus the ``QKᵀ`` and ``AV`` products; "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", §5.1), the head ``2·P·s``, the embeddings none; the
backward costs twice the forward. Seconds = FLOPs / (peak FLOP/s at the run's precision × efficiency), where the
efficiency is the fraction of peak a measured device reached on a whole training step: the H200 records of
``benchmarks/bench_gpu.json`` (forward + backward of the paper's GPT-2), the only measurement on a GPU here. The
optimizer step is charged at the measured seconds per parameter, scaled by the two devices' fp32 peaks.

Memory (stored activations, messages, model states) is the fake-tensor estimate of
:mod:`pipeline_recipes.planner.estimate`: it does not depend on the device.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .cluster import ClusterSpec
from .costs import LinearFit
from .model_costs import ModelCosts

H200_FP32_TFLOPS = 67.0  # NVIDIA H200 datasheet: the optimizer step's scale (AdamW runs in fp32)


@dataclass(frozen=True)
class Calibration:
    """Fraction of peak FLOP/s a measured step reached, and the optimizer's seconds per parameter there."""

    efficiency: float
    opt_s_per_param: float
    source: str

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1 or self.opt_s_per_param < 0:
            raise ValueError(f"Calibration: efficiency {self.efficiency} must be in (0, 1] and opt_s_per_param "
                             f"{self.opt_s_per_param} >= 0 ({self.source})")


def calibrate_from_bench(path: str | Path, model: str = "gpt2") -> Calibration:
    """The fastest ``eager`` whole-step record of ``model`` in a ``scripts/bench_gpu.py`` JSON: efficiency = the
    step's forward + backward FLOPs / (forward + backward seconds × the device's peak); the optimizer's share of the
    step (step − forward − backward) per parameter."""
    data = json.loads(Path(path).read_text())
    info = data["models"][model]
    peak = float(data["meta"]["peak_tflops"]) * 1e12
    rows = [r for r in data["rows"] if r.get("model") == model and r.get("mode") == "eager" and r.get("status") == "ok"
            and r.get("forward_s") and r.get("backward_s")]
    if not rows:
        raise ValueError(f"{path} has no measured eager step of {model} to calibrate on")
    row = min(rows, key=lambda r: r["forward_s"] + r["backward_s"])
    flops = float(info["flops_per_token"]) * float(info["tokens_per_step"])
    compute_s = row["forward_s"] + row["backward_s"]
    opt_s = max(row["step_s"] - compute_s, 0.0)
    return Calibration(flops / (compute_s * peak), opt_s / float(info["parameters"]),
                       f"{Path(path).name}: {model} {row['micro_batch']} eager on {data['meta'].get('device_name')}")


def precision_key(precision: Any) -> str:
    """The peak-FLOP/s unit a Lightning ``trainer.precision`` runs on."""
    text = str(precision or "32")
    if text.startswith("bf16"):
        return "bf16"
    if text.startswith("16"):
        return "fp16"
    return "fp32"


def layer_flops(costs: ModelCosts, model_cfg: Mapping[str, Any]) -> list[float]:
    """Forward FLOPs per sample of each layer (module docstring)."""
    s = float(model_cfg["seq_len"])
    h = float(model_cfg.get("n_embd") or model_cfg.get("hidden_size") or 0)
    if h <= 0:
        raise ValueError(f"model {model_cfg.get('name')}: no n_embd / hidden_size to count attention FLOPs")
    out = []
    for layer in costs.layers:
        kind = layer.name.split(".")[0]
        if kind.startswith("embed"):
            out.append(0.0)
        elif kind == "block":
            out.append(2.0 * layer.params * s + 4.0 * s * s * h)
        else:
            out.append(2.0 * layer.params * s)
    return out


def derive_costs(estimate: ModelCosts, model_cfg: Mapping[str, Any], spec: ClusterSpec, precision: Any,
                 calibration: Calibration) -> ModelCosts:
    """``estimate`` (memory) with FLOP-derived times on ``spec``'s device and ``spec``'s network."""
    rate = spec.peak_flops(precision_key(precision)) * calibration.efficiency
    opt_scale = H200_FP32_TFLOPS * 1e12 / spec.peak_flops("fp32")
    layers = []
    for layer, flops in zip(estimate.layers, layer_flops(estimate, model_cfg)):
        fwd = LinearFit(0.0, flops / rate)
        layers.append(replace(layer, fwd=fwd, fwd_nograd=fwd, bwd=fwd.scale(2.0),
                              opt_s=layer.params * calibration.opt_s_per_param * opt_scale))
    note = (f"times derived from FLOPs at {calibration.efficiency:.0%} of {spec.name}'s "
            f"{precision_key(precision)} peak (calibrated on {calibration.source}); no measured table for {spec.device}")
    return replace(estimate, layers=tuple(layers), device=f"cuda:{spec.name}", kind="derived", cores=0,
                   comm=spec.comm_costs(), meta={**estimate.meta, "derived": note})
