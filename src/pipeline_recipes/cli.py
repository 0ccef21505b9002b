"""The console commands of ``[project.scripts]``: each runs a script of the checkout it was installed from.

``pipeline-train`` is ``python train.py``, ``pipeline-schedule`` is ``python scripts/schedule.py`` and so on,
with the same arguments. The scripts read the checkout's ``conf/`` (Hydra's config directory) and
``recipes/``, so the commands work for an installation from a checkout (``pip install -e .``); an
installation without one gets an error naming the script it could not find.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # src/pipeline_recipes/cli.py -> the checkout

COMMANDS = {
    "pipeline-train": "train.py",
    "pipeline-schedule": "scripts/schedule.py",
    "pipeline-plan": "scripts/plan.py",
    "pipeline-compare": "scripts/compare.py",
    "pipeline-consolidate-ckpt": "scripts/consolidate_ckpt.py",
    "pipeline-export-hf": "scripts/export_hf.py",
    "pipeline-bench": "scripts/bench.py",
}


def run_script(relative: str, root: Path = ROOT) -> None:
    """Run ``root/relative`` as ``__main__`` with this process's arguments (its exit status becomes ours)."""
    script = root / relative
    if not script.is_file():
        sys.exit(f"error: {script} not found: the {Path(relative).stem} command runs the script of the checkout "
                 "the package was installed from; install it from a checkout with `pip install -e .`")
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")


def train() -> None:
    run_script(COMMANDS["pipeline-train"])


def schedule() -> None:
    run_script(COMMANDS["pipeline-schedule"])


def plan() -> None:
    run_script(COMMANDS["pipeline-plan"])


def compare() -> None:
    run_script(COMMANDS["pipeline-compare"])


def consolidate_ckpt() -> None:
    run_script(COMMANDS["pipeline-consolidate-ckpt"])


def export_hf() -> None:
    run_script(COMMANDS["pipeline-export-hf"])


def bench() -> None:
    run_script(COMMANDS["pipeline-bench"])
