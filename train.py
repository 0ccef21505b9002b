"""Train a model with a pipeline schedule: ``python train.py strategy=chimera model=gpt2 trainer.devices=8``.

Hydra composes ``conf/``; :func:`recipe.launch.run` derives and checks the layout (W, D, B, N)
before any process starts, starts fresh worker processes for the job (or joins torchrun/SLURM),
and writes ``results.json`` next to the logs. Sweeps work the same way:
``python train.py -m strategy=gpipe,dapple,chimera strategy.D=2,4 trainer.devices=4``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

AUTO = "strategy=auto"


def resolve_auto_strategy(argv: list[str]) -> list[str]:
    """``strategy=auto``: the planner profiles the model (cached), predicts every layout of the
    configured devices and global batch (Chimera §3.4) and puts its best one in place."""
    if AUTO not in argv:
        return argv
    if "-m" in argv or "--multirun" in argv:
        sys.exit("error: strategy=auto picks one layout; it cannot be part of a -m sweep")
    from pipeline_recipes.planner.auto import auto_overrides

    config_overrides = [a for a in argv if "=" in a and not a.startswith(("-", "hydra.", "hydra/"))]
    others = [a for a in argv if a not in config_overrides]
    chosen = auto_overrides(config_overrides, Path(__file__).parent / "conf", log=print)
    return others + chosen


SUBMITIT_LAUNCHERS = ("slurm", "submitit_slurm", "submitit_local")  # conf/hydra/launcher/slurm.yaml and the plugin's


def check_launcher_plugin(argv: list[str]) -> None:
    """``hydra/launcher=slurm`` needs Hydra's submitit plugin; without it Hydra composes the preset
    and then fails on launch with "Unknown plugin class", so say what to install instead."""
    chosen = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "hydra/launcher"]
    inspecting = any(a in ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help") for a in argv)
    if not chosen or chosen[-1] not in SUBMITIT_LAUNCHERS or inspecting:  # --cfg hydra shows it without a run
        return
    if "-m" not in argv and "--multirun" not in argv:  # Hydra uses a launcher in multirun mode only
        print(f"error: hydra/launcher={chosen[-1]} submits jobs in Hydra's multirun mode only; add -m (one job is a "
              "sweep of one), otherwise the job would run here", file=sys.stderr)
        sys.exit(2)
    import importlib.util

    try:
        found = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        print(f"error: hydra/launcher={chosen[-1]} needs Hydra's submitit launcher plugin, which is not installed; "
              'pip install -e ".[slurm]" (hydra-submitit-launcher)', file=sys.stderr)
        sys.exit(2)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from pipeline_recipes.recipe.launch import run

    return run(cfg)


if __name__ == "__main__":
    check_launcher_plugin(sys.argv[1:])
    sys.argv[1:] = resolve_auto_strategy(sys.argv[1:])
    main()
