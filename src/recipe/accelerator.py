"""Which accelerator a job runs on: ``trainer=auto`` (the default) picks the node's GPUs when CUDA is
available and CPU processes over gloo otherwise; ``trainer=cpu`` / ``trainer=gpu`` force one.

:func:`resolve_accelerator` is pure: it takes what the node offers (:class:`NodeDevices`, from
:func:`probe_node` or a test's fake GPU node) and the ``trainer`` settings, and returns the concrete
Lightning arguments plus the reason that is printed with the layout, e.g. ``accelerator: gpu × 8,
bf16-mixed (auto: 8 CUDA devices found, NVIDIA H100 has bf16)``. Nothing here starts a process.

Precision under ``auto``: ``bf16-mixed`` where the GPU computes bf16 natively (Ampere and later),
fp32 elsewhere. ``16-mixed`` is not chosen, and refused for the pipeline schedules: Lightning scales
the loss for fp16 in its own backward, which the schedules replace by theirs (every backward runs
inside the pipeline step), so its GradScaler would unscale gradients that were never scaled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .layout import ConfigError

AUTO = "auto"
GPU_NAMES = ("gpu", "cuda")
CPU_DEVICES = 2  # `trainer=auto` without CUDA and without trainer.devices: the README's 2-process CPU job
FP16_MIXED = ("16-mixed", "16")  # Lightning's spellings of fp16 autocast with a GradScaler
BASELINES = ("ddp", "single")


@dataclass(frozen=True)
class NodeDevices:
    """What this node offers: CUDA devices, whether they compute bf16 natively, and how many
    processes an external launcher (torchrun, SLURM with several tasks per node) started here
    (None: this job starts its own)."""

    cuda_devices: int = 0
    bf16: bool = False
    gpu_name: str = ""
    launched_per_node: int | None = None


@dataclass(frozen=True)
class AcceleratorChoice:
    """The concrete ``trainer`` settings (Lightning's arguments: no ``auto`` left in accelerator,
    devices or precision) and why they were chosen."""

    trainer: dict[str, Any]
    reason: str
    node: NodeDevices = NodeDevices()

    @property
    def accelerator(self) -> str:
        return str(self.trainer["accelerator"])

    def describe(self) -> str:
        trainer = self.trainer
        precision = trainer.get("precision") or "32-true"
        return f"accelerator: {self.accelerator} × {trainer['devices']} per node, {precision} ({self.reason})"


def _count(value: str | None) -> int | None:
    return int(value) if value and value.strip().isdigit() else None


def probe_node(env: Mapping[str, str] | None = None, *, cuda: bool = True) -> NodeDevices:
    """What this node has: the launcher's processes from ``env``, and with ``cuda`` the GPUs, from
    torch (imported only then; no CUDA tensor is created)."""
    env = os.environ if env is None else env
    per_node = _count(env.get("LOCAL_WORLD_SIZE"))  # torchrun's --nproc_per_node
    slurm = _count(env.get("SLURM_NTASKS_PER_NODE"))
    if per_node is None and slurm is not None and slurm > 1:  # one SLURM task per node: train.py starts the workers
        per_node = slurm
    if not cuda:
        return NodeDevices(launched_per_node=per_node)
    import torch

    if not torch.cuda.is_available():
        return NodeDevices(launched_per_node=per_node)
    count = torch.cuda.device_count()
    return NodeDevices(count, bool(torch.cuda.is_bf16_supported(including_emulation=False)),
                       torch.cuda.get_device_name(0), per_node)


def _devices(value: Any, default: int, node: NodeDevices) -> Any:
    """``trainer.devices``: a number as given; ``auto`` (or null, -1) means the launcher's processes
    per node, else ``default``."""
    if value in (AUTO, None, -1):
        return node.launched_per_node or default
    return value


def resolve_accelerator(trainer: Mapping[str, Any], node: NodeDevices) -> AcceleratorChoice:
    """The concrete ``trainer`` settings for this node and why.

    - ``accelerator: auto``: ``gpu`` when the node has CUDA devices (``devices: auto`` = all of them),
      else ``cpu`` (``devices: auto`` = 2 processes);
    - ``accelerator: cpu`` / ``gpu``: kept, the user asked for it;
    - ``precision: auto``: ``bf16-mixed`` on a GPU with native bf16, else ``32-true``.

    A GPU asked for bf16 it lacks is refused here (:class:`ConfigError`), before any process starts.
    """
    out = dict(trainer)
    accelerator = str(out.get("accelerator", AUTO))
    if accelerator == AUTO:
        if node.cuda_devices > 0:
            out["accelerator"] = "gpu"
            why = f"auto: {node.cuda_devices} CUDA device{'s' if node.cuda_devices > 1 else ''} found"
        else:
            out["accelerator"] = "cpu"
            why = "auto: no CUDA"
    else:
        why = f"trainer.accelerator={accelerator}"
    gpu = out["accelerator"] in GPU_NAMES
    if gpu and node.cuda_devices == 0 and out.get("devices", AUTO) in (AUTO, None, -1):
        raise ConfigError(f"trainer.accelerator = {out['accelerator']} with trainer.devices = {out.get('devices')} but "
                          "this node has no CUDA device; use trainer=cpu (or trainer=auto, which picks the CPU here)")
    out["devices"] = _devices(out.get("devices", AUTO), node.cuda_devices if gpu else CPU_DEVICES, node)
    precision = out.get("precision", AUTO)
    if precision == AUTO or precision is None:
        bf16 = gpu and node.bf16
        out["precision"] = "bf16-mixed" if bf16 else "32-true"
        if gpu:
            name = node.gpu_name or "the GPU"
            why += f", {name} has bf16" if bf16 else f", no native bf16 on {name}: fp32"
    elif gpu and node.cuda_devices > 0 and not node.bf16 and str(precision).startswith("bf16"):
        raise ConfigError(f"trainer.precision = {precision} but {node.gpu_name or 'this GPU'} has no native bf16 "
                          "(it needs compute capability 8.0 or newer); set trainer.precision=32-true "
                          "(or trainer.precision=auto)")
    return AcceleratorChoice(out, why, node)


def choose_accelerator(trainer: Mapping[str, Any]) -> AcceleratorChoice:
    """:func:`resolve_accelerator` for this node. Only ``auto`` and GPU runs pay for importing torch
    (to look at the node's GPUs); ``trainer=cpu`` needs nothing."""
    accelerator = trainer.get("accelerator", AUTO)
    return resolve_accelerator(trainer, probe_node(cuda=accelerator == AUTO or accelerator in GPU_NAMES))


def check_precision(strategy: str, trainer: Mapping[str, Any], optim: Mapping[str, Any] | None = None) -> None:
    """fp16 autocast with a GradScaler (``16-mixed``) cannot run under the pipeline schedules (see
    the module docstring); bf16 needs no scaler. Under a baseline, Lightning cannot clip the gradients
    of a fused optimizer with a GradScaler (the fused step unscales them itself)."""
    precision = str(trainer.get("precision"))
    if precision in FP16_MIXED and (optim or {}).get("fused") and trainer.get("gradient_clip_val"):
        raise ConfigError(f"trainer.precision = {precision} with optim.fused = true and trainer.gradient_clip_val = "
                          f"{trainer.get('gradient_clip_val')}: Lightning cannot clip gradients that a fused optimizer "
                          "unscales inside its step; set optim.fused=null (torch's default AdamW), "
                          "trainer.gradient_clip_val=null, or trainer.precision=bf16-mixed")
    if strategy not in BASELINES and precision in FP16_MIXED:
        raise ConfigError(f"trainer.precision = {precision} (fp16 with loss scaling) is not supported by "
                          f"strategy={strategy}: the pipeline runs every backward itself, so Lightning's loss "
                          "scaler would unscale gradients that were never scaled; use trainer.precision=bf16-mixed "
                          "(Ampere GPUs or newer) or trainer.precision=32-true")
