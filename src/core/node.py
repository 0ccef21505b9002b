"""What this node offers a job, probed once: its GPUs (torch only when asked), the processes an external
launcher started here, its CPUs per rank and the data loader's settings that follow from them. Shared by the
launcher (:mod:`pipeline_recipes.recipe.check.accelerator`) and the data modules, which set up their loaders from it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .fixes import ConfigError, values

AUTO = "auto"
GPU_NAMES = ("gpu", "cuda")  # the trainer.accelerator values that mean CUDA devices


@dataclass(frozen=True)
class NodeDevices:
    """What this node offers: CUDA devices, whether they compute bf16 natively, and how many
    processes an external launcher (torchrun, SLURM with several tasks per node) started here
    (None: this job starts its own)."""

    cuda_devices: int = 0
    bf16: bool = False
    gpu_name: str = ""
    launched_per_node: int | None = None
    gpu_memory_bytes: int = 0  # the first GPU's total memory (0: not known)


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
    import torch  # local: torch ≥1.2 s (python -X importtime); the launcher needs it only to count GPUs

    if not torch.cuda.is_available():
        return NodeDevices(launched_per_node=per_node)
    count = torch.cuda.device_count()
    return NodeDevices(count, bool(torch.cuda.is_bf16_supported(including_emulation=False)),
                       torch.cuda.get_device_name(0), per_node, int(torch.cuda.get_device_properties(0).total_memory))


LOADER_WORKERS_CUDA = 4  # data.num_workers=auto on CUDA: at most this many loader processes per rank


def cpus_per_rank(processes: int) -> int:
    """This process's CPUs (its affinity where the OS tells it) shared by ``processes`` ranks of the node."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus // max(processes, 1)


def loader_settings(num_workers: Any, pin_memory: Any, *, cuda: bool, cpus: int) -> tuple[int, bool]:
    """``data.num_workers`` and ``data.pin_memory`` as the loader takes them: as set, or under ``auto``
    (or null) on CUDA min(4, ``cpus`` per rank) loader processes and pinned host memory (the copy to the
    GPU can overlap), on CPU none and no pinning. The sampler stays in the rank's own process, so the
    batches and their order do not depend on the workers."""
    if num_workers in (AUTO, None):
        workers = min(LOADER_WORKERS_CUDA, max(cpus, 0)) if cuda else 0
    elif isinstance(num_workers, int) and not isinstance(num_workers, bool) and num_workers >= 0:
        workers = num_workers
    else:
        raise ConfigError(f"data.num_workers = {num_workers!r} is neither auto (on CUDA up to 4 per rank, 0 on CPU) "
                          "nor a number ≥ 0 of loader processes", [values("data.num_workers", [AUTO, 0])])
    if pin_memory in (AUTO, None):
        pin = cuda
    elif isinstance(pin_memory, bool):
        pin = pin_memory
    else:
        raise ConfigError(f"data.pin_memory = {pin_memory!r} must be auto, true or false (auto: pinned on CUDA)",
                          [values("data.pin_memory", [AUTO, True, False], keep=1)])
    return workers, pin
