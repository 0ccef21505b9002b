"""Train a model with a pipeline schedule: ``python train.py strategy=chimera model=gpt2 trainer.devices=8``.

Hydra composes ``conf/``; :func:`recipe.launch.run` derives and checks the layout (W, D, B, N)
before any process starts, starts fresh worker processes for the job (or joins torchrun/SLURM),
and writes ``results.json`` next to the logs. Sweeps work the same way:
``python train.py -m strategy=gpipe,dapple,chimera strategy.D=2,4 trainer.devices=4``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs; nothing waits on the network

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from recipe.launch import run

    return run(cfg)


if __name__ == "__main__":
    main()
