"""Train a model with a pipeline schedule: ``python train.py strategy=chimera model=gpt2 trainer.devices=8``.

Hydra composes ``conf/`` once; :func:`pipeline_recipes.recipe.launch.main.run` checks the command
(:func:`pipeline_recipes.recipe.check.command.check_command`: the layout W, D, B, N and every other setting) before any
process starts, starts fresh worker processes for the job (or joins torchrun/SLURM),
and writes ``results.json`` next to the logs. Sweeps work the same way:
``python train.py -m strategy=gpipe,dapple,chimera strategy.D=2,4 trainer.devices=4``.
A misspelled key (``model.n_layr=4``) is refused in one line with the key it resembles
(:mod:`pipeline_recipes.recipe.check.command_line`).
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a stop signal during the imports and checks below is a clean stop, not a death
    from pipeline_recipes.core.signals import install_early

    install_early()

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import pipeline_recipes.recipe  # noqa: F401 - registers the config's resolvers (recipe/check/resolvers.py)
from pipeline_recipes.recipe.check.command_line import before_compose, run_app

CONFIG_PATH, CONFIG_NAME = "conf", "config"  # as in @hydra.main below
CONF_DIR = Path(__file__).resolve().parent / CONFIG_PATH


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> float | None:
    from pipeline_recipes.recipe.launch.main import run

    return run(cfg)


if __name__ == "__main__":
    sys.argv[1:] = before_compose(sys.argv[1:], CONF_DIR)  # the launcher's plugin; strategy=auto's layout
    run_app(main, sys.argv[1:], CONF_DIR)  # Hydra composes once; what it refuses is said in one line
