"""What ``scripts/plan.py --compare`` prints for a described cluster: each schedule's best layout once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ("gpipe", "dapple", "chimera")


@pytest.mark.slow
def test_compare_prints_one_table_with_a_row_per_schedule() -> None:
    """``--compare`` prints its own table (with the all-reduce column) and not the ranked one besides: every
    schedule asked for starts exactly one line."""
    cmd = [sys.executable, str(ROOT / "scripts" / "plan.py"), "cluster=piz-daint", "model=gpt2", "trainer.devices=8",
           "data.global_batch_size=8", "--schedules", ",".join(SCHEDULES), "--recompute", "none", "--compare"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("schedule ") and "all-red s" in line for line in lines) == 1
    assert not any(line.startswith("# | strategy") for line in lines)
    assert {name: sum(line.split()[:1] == [name] for line in lines) for name in SCHEDULES} == dict.fromkeys(SCHEDULES, 1)
