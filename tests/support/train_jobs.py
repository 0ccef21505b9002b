"""Run several ``train.py`` jobs side by side (most of each run is importing Lightning) and read their
``results.json``: the end-to-end tests that compare strategies over the same data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_train_jobs(tmp_path: Path, common: Sequence[str], jobs: Mapping[str, Sequence[str]],
                   timeout_s: float = 300) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``python train.py *common *jobs[name]`` for every job at once, each in ``tmp_path / name``; fails
    with a job's output tail when it exits non-zero, else returns every job's ``results.json`` and output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    procs = {}
    for name, args in jobs.items():
        (tmp_path / name).mkdir()
        procs[name] = subprocess.Popen([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / name}",
                                        *common, *args], cwd=tmp_path / name, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    outputs = {name: proc.communicate(timeout=timeout_s)[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        if proc.returncode != 0:
            raise AssertionError(f"train.py job {name} exited with {proc.returncode}:\n{outputs[name][-3000:]}")
    return {name: json.loads((tmp_path / name / "results.json").read_text()) for name in jobs}, outputs
