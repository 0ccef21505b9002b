"""The console commands of ``[project.scripts]``: each runs a script of the checkout it was installed from.

``pipeline-train`` is ``python train.py``, ``pipeline-schedule`` is ``python scripts/schedule.py`` and so on,
with the same arguments. The scripts read the checkout's ``conf/`` (Hydra's config directory) and
``recipes/``, so the commands work for an installation from a checkout (``pip install -e .``); an
installation without one gets an error naming the script it could not find.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable
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


def _command(name: str) -> Callable[[], None]:
    """The console entry point ``name``: runs its script of the checkout with this process's arguments."""

    def run() -> None:
        run_script(COMMANDS[name])

    run.__name__ = run.__qualname__ = name.removeprefix("pipeline-").replace("-", "_")
    return run


train = _command("pipeline-train")
schedule = _command("pipeline-schedule")
plan = _command("pipeline-plan")
compare = _command("pipeline-compare")
consolidate_ckpt = _command("pipeline-consolidate-ckpt")
export_hf = _command("pipeline-export-hf")
bench = _command("pipeline-bench")
