"""Model FLOPs per token, device peaks and model FLOPs utilisation (MFU).

Training a transformer of N matrix-multiply parameters, L layers of width d on sequences of T
tokens costs, per token, ``6·N`` FLOPs for the weight matmuls (forward 2N, backward 4N) plus
``12·L·d·T`` for the attention scores and their weighted sum (forward ``4·L·d·T``, backward twice
that) — the "model FLOPs" of PaLM (Chowdhery et al., "PaLM: Scaling Language Modeling with
Pathways", Appendix B) and of Megatron-LM (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", §5.1). Recomputation is not counted: MFU compares the
work the model needs, not the work done, with the hardware's peak.

N counts every parameter that takes part in a matrix multiply (Llama's SwiGLU MLP: three matrices;
grouped-query attention: the smaller key/value projections, as built): embedding tables used only as
look-ups (positions, token types, an untied input embedding) are left out, a word embedding tied to
the output head is counted once (nanoGPT's convention). The job's FLOPs are spread over all W·D
devices: ``TFLOP/s per device = flops_per_token · tokens/s / (W·D)``, ``MFU = that / peak``.

Peaks are dense bf16/fp16 tensor-core figures from the vendors' data sheets (fp32 for ``32``
precision); ``trainer.peak_tflops`` overrides them, and an unknown device (a CPU) gives no MFU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn

from pipeline_recipes.models.families import transformer_shape

# Dense peak TFLOP/s per device: (bf16/fp16 tensor cores, fp32), from the vendors' data sheets.
# Matched against torch.cuda.get_device_name() in this order (first substring that matches wins).
PEAK_TFLOPS: tuple[tuple[str, str, float, float], ...] = (
    # (substring of the lower-cased device name, label, half precision, fp32)
    ("gh200", "GH200", 989.0, 67.0),
    ("h200", "H200", 989.0, 67.0),
    ("h100 nvl", "H100 NVL", 835.0, 60.0),
    ("h100 pcie", "H100 PCIe", 756.0, 51.0),
    ("h100", "H100 SXM", 989.0, 67.0),
    ("h800", "H800", 989.0, 67.0),
    ("b200", "B200", 2250.0, 80.0),
    ("a100", "A100", 312.0, 19.5),
    ("a800", "A800", 312.0, 19.5),
    ("a10g", "A10G", 125.0, 31.2),
    ("a10", "A10", 125.0, 31.2),
    ("a30", "A30", 165.0, 10.3),
    ("a40", "A40", 149.7, 37.4),
    ("a6000", "RTX A6000", 154.8, 38.7),
    ("l40s", "L40S", 362.0, 91.6),
    ("l40", "L40", 181.0, 90.5),
    ("l4", "L4", 121.0, 30.3),
    ("v100s", "V100S", 130.0, 16.4),
    ("v100-pcie", "V100 PCIe", 112.0, 14.0),
    ("v100", "V100 SXM", 125.0, 15.7),  # fp16: V100 has no bf16
    ("t4", "T4", 65.0, 8.1),
    ("mi300x", "MI300X", 1307.4, 163.4),
    ("mi250x", "MI250X", 383.0, 47.9),
)


def lookup_peak_tflops(device_name: str, half_precision: bool = True) -> tuple[str, float] | None:
    """``(label, peak TFLOP/s)`` of a device by its name, or None when the table does not know it."""
    name = device_name.lower()
    for pattern, label, half, fp32 in PEAK_TFLOPS:
        if pattern in name:
            return label, half if half_precision else fp32
    return None


def is_half_precision(precision: str | int | None) -> bool:
    """Lightning's ``precision``: ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ... (fp8 counts as bf16)."""
    text = str(precision or "32")
    return "16" in text or "transformer-engine" in text or "8" in text


def device_peak_tflops(device: torch.device, precision: str | int | None) -> tuple[str, float] | None:
    """The table's peak for a CUDA device at this precision; None on CPUs and unknown devices."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return lookup_peak_tflops(torch.cuda.get_device_name(device), is_half_precision(precision))


def matmul_parameters(module: nn.Module) -> int:
    """Parameters that take part in matrix multiplies (each tensor once): all of them except
    embedding tables used only as look-ups (a table shared with another module, the tied output
    head, counts)."""
    lookup_only: dict[int, int] = {}
    elsewhere: set[int] = set()
    sizes: dict[int, int] = {}
    for owner in module.modules():
        for p in owner.parameters(recurse=False):
            sizes[id(p)] = p.numel()
            if isinstance(owner, nn.Embedding):
                lookup_only[id(p)] = p.numel()
            else:
                elsewhere.add(id(p))
    return sum(n for key, n in sizes.items() if key not in lookup_only or key in elsewhere)


def flops_per_token(params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """Training FLOPs per token: ``6·N + 12·L·d·T`` (forward and backward; see the module docstring)."""
    return 6 * int(params) + 12 * int(n_layer) * int(d_model) * int(seq_len)


def model_flops_per_token(model_cfg: Mapping[str, Any], seq_len: int | None = None,
                          model: nn.Module | None = None) -> int | None:
    """FLOPs per training token of the model a ``conf/model`` config builds (on the meta device: no
    memory, no random numbers drawn; ``model`` is counted instead when its builder takes no ``device``), with
    the layers and attention width of its family's FLOP shape
    (:func:`~pipeline_recipes.models.families.transformer_shape`); None when the config gives no shape."""
    shape = transformer_shape(model_cfg)
    seq = seq_len if seq_len is not None else model_cfg.get("seq_len")
    if shape is None or seq is None:
        return None
    try:
        with torch.random.fork_rng(devices=[]):
            built = instantiate(dict(model_cfg), device="meta")
    except (TypeError, InstantiationException):
        if model is None:
            raise
        built = model
    return flops_per_token(matmul_parameters(built), *shape, int(seq))


@dataclass(frozen=True)
class Utilisation:
    """Achieved TFLOP/s per device and MFU from a token rate, for a job of ``devices`` processes."""

    flops_per_token: int | None
    devices: int
    peak_tflops: float | None = None
    peak_label: str = ""

    def tflops_per_device(self, tokens_per_s: float | None) -> float | None:
        if self.flops_per_token is None or tokens_per_s is None:
            return None
        return self.flops_per_token * float(tokens_per_s) / self.devices / 1e12

    def mfu(self, tokens_per_s: float | None) -> float | None:
        achieved = self.tflops_per_device(tokens_per_s)
        if achieved is None or not self.peak_tflops:
            return None
        return achieved / self.peak_tflops


def resolve_utilisation(flops: int | None, devices: int, device: torch.device, precision: str | int | None,
                        peak_tflops: float | None = None) -> Utilisation:
    """``trainer.peak_tflops`` when set, else the table's peak for ``device`` (none on CPUs)."""
    if peak_tflops is not None:
        if float(peak_tflops) <= 0:
            raise ValueError(f"trainer.peak_tflops must be positive (TFLOP/s per device), got {peak_tflops}")
        return Utilisation(flops, devices, float(peak_tflops), "trainer.peak_tflops")
    found = device_peak_tflops(device, precision)
    return Utilisation(flops, devices, found[1] if found else None, found[0] if found else "")
