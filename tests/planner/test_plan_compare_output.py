"""What ``scripts/plan.py --compare`` prints for a described cluster: each schedule's best layout once, then once more
with its step and peak in parts."""

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
    schedule asked for starts exactly one line of it, and one of the "why" table below, whose parts add up to the
    step time and the peak of its row above (to the printed rounding)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "plan.py"), "cluster=piz-daint", "model=gpt2", "trainer.devices=8",
           "data.global_batch_size=8", "--schedules", ",".join(SCHEDULES), "--recompute", "none", "--compare"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("schedule ") and "all-red s" in line for line in lines) == 1
    assert not any(line.startswith("# | strategy") for line in lines)
    why = next(i for i, line in enumerate(lines) if line.startswith("why: "))
    table, parts = lines[:why], lines[why:]
    for name in SCHEDULES:
        [row] = [line.split() for line in table if line.split()[:1] == [name]]
        [split] = [line.split() for line in parts if line.split()[:1] == [name]]
        compute, bubble, p2p, allreduce, _, step, weights, grads, optim, acts, _, peak = split[1:]
        assert float(step) == pytest.approx(float(row[6]), abs=1e-3)  # the step time column
        assert sum(map(float, (compute, bubble, p2p, allreduce))) == pytest.approx(float(step), abs=3e-3)
        assert float(peak) == pytest.approx(float(row[10]), abs=1e-2)  # peak GiB
        assert sum(map(float, (weights, grads, optim, acts))) == pytest.approx(float(peak), abs=3e-2)
