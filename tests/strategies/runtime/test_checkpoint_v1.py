"""Checkpoints of the format before DCP (version 1: ``stage<k>.pt`` files, ``optim/rank<r>.pt`` pieces) still resume
and consolidate.

``tests/data/checkpoint_v1`` holds step 2 of two 4-step Chimera D = 2 runs of a small GPT-2 on 2 CPU ranks, written
by the code before DCP (``runs.json``: the commit, the overrides and both runs' losses): one with whole optimizers,
one with ``strategy.shard_optimizer=true``. Resumed under the same layout, today's code must continue with exactly
the losses those runs recorded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline_recipes.strategies import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "checkpoint_v1"
RUNS = json.loads((DATA / "runs.json").read_text())
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _old(tmp_path: Path, kind: str) -> Path:
    copy = tmp_path / kind / "step-000002.ckpt"
    shutil.copytree(DATA / kind / "step-000002.ckpt", copy)
    return copy


def test_the_old_checkpoints_are_of_the_old_format() -> None:
    for kind in ("whole", "sharded"):
        meta = ckpt.read_meta(DATA / kind / "step-000002.ckpt")
        assert meta["version"] == 1 and not ckpt.is_dcp(meta)
        ckpt.verify_checkpoint(DATA / kind / "step-000002.ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["whole", "sharded"])
def test_an_old_checkpoint_resumes_with_the_losses_its_run_recorded(tmp_path: Path, kind: str) -> None:
    old = _old(tmp_path, kind)
    out = tmp_path / "run"
    extra = RUNS["sharded_extra"] if kind == "sharded" else []
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={out}", *RUNS["overrides"], *extra,
                           f"ckpt_path={old}"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    losses = json.loads((out / "results.json").read_text())["loss_history"]
    assert losses == RUNS["loss_history"][kind]  # the same layout: exactly the old run's steps 3 and 4
    saved = out / "checkpoints" / "step-000004.ckpt"
    assert ckpt.is_dcp(ckpt.read_meta(saved))  # and it saves in today's format


@pytest.mark.slow
def test_old_sharded_and_whole_checkpoints_consolidate_to_the_same_state() -> None:
    whole, sharded = (ckpt.consolidate(DATA / kind / "step-000002.ckpt") for kind in ("whole", "sharded"))
    assert whole["pipeline"]["param_names"] == sharded["pipeline"]["param_names"]
    for key, value in whole["state_dict"].items():
        torch.testing.assert_close(sharded["state_dict"][key], value, rtol=0, atol=1e-6, msg=key)
    for i, entry in whole["optimizer_states"][0]["state"].items():
        torch.testing.assert_close(sharded["optimizer_states"][0]["state"][i]["exp_avg_sq"], entry["exp_avg_sq"],
                                   rtol=0, atol=1e-9)
