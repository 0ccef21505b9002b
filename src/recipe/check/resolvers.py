"""The config's own resolvers (``${pipeline.…:…}``), registered when :mod:`pipeline_recipes.recipe` is imported.

``conf/hydra/launcher/slurm.yaml`` asks SLURM for what the trainer uses: GPUs only under ``trainer=gpu`` (a
CPU partition refuses a job that asks for GPUs: "Invalid generic resource (gres) specification"), and CPUs per
task that a node has (one per CPU rank, which runs one thread; more for a GPU rank's data loading).
"""

from __future__ import annotations

from omegaconf import OmegaConf

from pipeline_recipes.core.node import GPU_NAMES

CPUS_PER_GPU_TASK = 8  # a GPU rank's loader processes (data.num_workers=auto takes min(4, CPUs per rank)) and host side
CPUS_PER_CPU_TASK = 1  # a CPU rank runs one torch thread (recipe/worker/job.py)


def slurm_gpus_per_node(accelerator: str, devices: int) -> int | None:
    """GPUs per node to ask SLURM for: ``trainer.devices`` under ``trainer=gpu``, none otherwise."""
    return int(devices) if str(accelerator) in GPU_NAMES else None


def slurm_cpus_per_task(accelerator: str) -> int:
    """CPUs per task (one task is one rank): a CPU rank's one thread, or a GPU rank's loaders."""
    return CPUS_PER_GPU_TASK if str(accelerator) in GPU_NAMES else CPUS_PER_CPU_TASK


def register() -> None:
    for name, fn in (("pipeline.slurm_gpus_per_node", slurm_gpus_per_node),
                     ("pipeline.slurm_cpus_per_task", slurm_cpus_per_task)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
