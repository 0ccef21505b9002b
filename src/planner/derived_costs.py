"""Per-layer times on a device that is not here, derived from FLOPs at a calibrated efficiency.

Chimera §3.4 needs each stage's forward and backward time; without the hardware (and without a measured cost table
under ``benchmarks/``) the planner derives them: a transformer block's forward costs ``2·P·s + 4·s²·h`` FLOPs per
sample (its ``P`` weights applied to ``s`` tokens, plus the ``QKᵀ`` and ``AV`` products; "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", §5.1), the head ``2·P·s``, the embeddings none; the
backward costs twice the forward. Seconds = FLOPs / (peak FLOP/s at the run's precision × efficiency), where the
efficiency is the fraction of peak a measured device reached on a whole training step: the H200 records of
``benchmarks/bench_gpu.json`` (forward + backward of the paper's GPT-2 at two micro-batch sizes, which also give a
fixed cost per micro-batch), the only measurement on a GPU here. The optimizer step is charged at the measured
seconds per parameter, scaled by the two devices' fp32 peaks.

Memory (stored activations, messages, model states) is the fake-tensor estimate of
:mod:`pipeline_recipes.planner.estimate`: it does not depend on the device.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline_recipes.models.families import candidate_keys, transformer_shape

from .cluster import ClusterSpec
from .costs import LinearFit, fit_line
from .estimate import estimate_costs
from .memory import Budget
from .model_costs import ModelCosts

BENCH_GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.json"  # the calibration's record
H200_FP32_TFLOPS = 67.0  # NVIDIA H200 datasheet: the optimizer step's scale (AdamW runs in fp32)


@dataclass(frozen=True)
class Calibration:
    """Fraction of peak FLOP/s a measured step reached, and the optimizer's seconds per parameter there."""

    efficiency: float
    opt_s_per_param: float
    source: str
    microbatch_overhead_s: float = 0.0  # per micro-batch of the whole model (forward + backward), any size

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1 or self.opt_s_per_param < 0:
            raise ValueError(f"Calibration: efficiency {self.efficiency} must be in (0, 1] and opt_s_per_param "
                             f"{self.opt_s_per_param} >= 0 ({self.source})")


def calibrate_from_bench(path: str | Path, model: str = "gpt2") -> Calibration:
    """The ``stage`` whole-step records of ``model`` in a ``scripts/bench_gpu.py`` JSON, as a line
    ``forward + backward seconds per micro-batch = a + b·B`` through its micro-batch sizes (16 × 1 and 4 × 4: the
    same samples per step), each at its fastest mode (compiled or CUDA graphs: the device's own time; the eager GPT-2
    rows at micro-batch 4 wait on the CPU's kernel launches, which a slower device hides): ``b`` gives the efficiency
    (the FLOPs of one sample / (b × the device's peak)), ``a`` the fixed cost of a micro-batch (short kernels that
    leave the device part idle, taken as the same on every device); the optimizer's share of the step
    (step − forward − backward) per parameter."""
    data = json.loads(Path(path).read_text())
    info = data["models"][model]
    peak = float(data["meta"]["peak_tflops"]) * 1e12
    rows = [r for r in data["rows"] if r.get("model") == model and r.get("system") == "stage"
            and r.get("status") == "ok" and r.get("forward_s") and r.get("backward_s")]
    if not rows:
        raise ValueError(f"{path} has no measured stage step of {model} to calibrate on")
    fastest: dict[int, dict[str, Any]] = {}
    for r in rows:
        size = int(r["micro_batch_size"])
        if size not in fastest or _compute_s(r) < _compute_s(fastest[size]):
            fastest[size] = r
    sizes = sorted(fastest)
    line = fit_line(sizes, [_compute_s(fastest[b]) for b in sizes]) if len(sizes) > 1 else LinearFit(
        0.0, _compute_s(fastest[sizes[0]]) / sizes[0])
    flops_per_sample = float(info["flops_per_token"]) * float(info["seq_len"])
    largest = fastest[sizes[-1]]
    opt_s = max(largest["step_s"] - largest["forward_s"] - largest["backward_s"], 0.0)
    modes = ", ".join(f"{b} {fastest[b]['mode']}" for b in sizes)
    return Calibration(flops_per_sample / (line.b * peak), opt_s / float(info["parameters"]),
                       f"{Path(path).name}: {model} at micro-batches {modes} on {data['meta'].get('device_name')}",
                       max(line.a, 0.0))


def _compute_s(row: Mapping[str, Any]) -> float:
    """Forward + backward seconds per micro-batch of a bench_gpu.py row."""
    return (row["forward_s"] + row["backward_s"]) / row["micro_batches"]


def run_precision(spec: ClusterSpec, precision: Any) -> str:
    """``trainer.precision`` on ``spec``'s device: ``auto`` is ``bf16-mixed`` where the device has bf16 units, else
    ``32-true`` (recipe.accelerator's rule for this machine)."""
    if str(precision or "auto") == "auto":
        return "bf16-mixed" if "bf16" in spec.peak_tflops else "32-true"
    return str(precision)


def precision_key(precision: Any) -> str:
    """The peak-FLOP/s unit a Lightning ``trainer.precision`` runs on."""
    text = str(precision or "32")
    if text.startswith("bf16"):
        return "bf16"
    if text.startswith("16"):
        return "fp16"
    return "fp32"


def layer_flops(costs: ModelCosts, model_cfg: Mapping[str, Any]) -> list[float]:
    """Forward FLOPs per sample of each layer (module docstring); ``h`` is the attention width of the model family's
    FLOP shape (:func:`~pipeline_recipes.models.families.transformer_shape`, the model FLOPs' too)."""
    s = float(model_cfg["seq_len"])
    shape = transformer_shape(model_cfg)
    h = float(shape[1]) if shape is not None else 0.0
    if h <= 0:
        raise ValueError(f"model {model_cfg.get('name')}: its config gives no attention width "
                         f"({' / '.join(candidate_keys(model_cfg, 'width_key'))}) to count attention FLOPs")
    out = []
    last = len(costs.layers) - 1
    for i, layer in enumerate(costs.layers):  # every adapter's layers: the embeddings, the blocks, the head
        if i == 0:
            out.append(0.0)
        elif i < last:
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
    launch = calibration.microbatch_overhead_s / 3.0 / max(estimate.num_layers, 1)  # per layer: 1 forward, 2 backward
    for layer, flops in zip(estimate.layers, layer_flops(estimate, model_cfg)):
        fwd = LinearFit(launch, flops / rate)
        layers.append(replace(layer, fwd=fwd, fwd_nograd=fwd, bwd=fwd.scale(2.0),
                              opt_s=layer.params * calibration.opt_s_per_param * opt_scale))
    note = (f"times derived from FLOPs at {calibration.efficiency:.0%} of {spec.name}'s "
            f"{precision_key(precision)} peak plus {calibration.microbatch_overhead_s * 1e3:.0f} ms per micro-batch "
            f"(calibrated on {calibration.source}); no measured table for {spec.device}")
    return replace(estimate, layers=tuple(layers), device=f"cuda:{spec.name}", kind="derived", cores=0,
                   comm=spec.comm_costs(), meta={**estimate.meta, "derived": note})


def described_costs(model_cfg: Any, spec: ClusterSpec, precision: Any, bench: str | Path = BENCH_GPU) -> ModelCosts:
    """The planner's costs of ``model_cfg`` on the described cluster ``spec``: its measured table where
    ``cluster.cost_table`` names one (a path under ``benchmarks/``), else the fake-tensor memory estimate under the
    run's precision (:func:`run_precision`) with FLOP-derived times calibrated on ``bench``."""
    from omegaconf import OmegaConf

    run = run_precision(spec, precision)
    if spec.cost_table:
        return measured_costs(spec, bench.parent / spec.cost_table if not Path(spec.cost_table).is_absolute()
                              else Path(spec.cost_table))
    plain = model_cfg if isinstance(model_cfg, Mapping) else OmegaConf.to_container(model_cfg, resolve=True)
    estimate = estimate_costs(model_cfg, (1, 2), precision=run, device="cuda")
    return derive_costs(estimate, plain, spec, run, calibrate_from_bench(bench))


def measured_costs(spec: ClusterSpec, table: Path) -> ModelCosts:
    """A measured device cost table (``scripts/bench_gpu.py --layer-table``) with ``spec``'s network."""
    if not table.is_file():
        raise ValueError(f"cluster.cost_table={spec.cost_table!r}: no such file {table}; write it on the device with "
                         "python scripts/bench_gpu.py --layer-table OUT.json MODEL, or set cluster.cost_table=null")
    costs = ModelCosts.from_json(json.loads(table.read_text()))
    note = f"times measured on {costs.meta.get('device_name', costs.device)} ({table.name})"
    return replace(costs, comm=spec.comm_costs(), cores=0, kind="measured", meta={**costs.meta, "derived": note})


def described_budget(spec: ClusterSpec) -> Budget:
    """Each device's memory of the described cluster, less what the estimate does not count (its reserved memory and
    allocator overhead)."""
    return Budget(per_rank=spec.device_memory, source=f"{spec.device} ({spec.name})", reserved=spec.reserved_memory,
                  allocator_overhead=spec.allocator_overhead)
