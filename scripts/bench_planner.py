"""How long the planner and the memory pre-flight take, from the command line, with an empty cache.

Each command runs in a child process against a fresh profile cache (``PIPELINE_RECIPES_CACHE``), so
the layer profile and the communication micro-benchmarks are measured, not read; its wall time, CPU
time (user + system of the child and its own children) and peak resident set go into the JSON with
the machine's core count and load average::

    python scripts/bench_planner.py --out benchmarks/planner_time.json
    python scripts/bench_planner.py --quick            # gpt2-tiny only (seconds)

The commands are docs/planner.md's: ``scripts/plan.py model=gpt2-small trainer.devices=8
data.global_batch_size=64``, the Chimera paper's ``model=gpt2`` (it exits 1 on a machine whose RAM
fits no layout of 1.39 B parameters on 8 ranks, after a complete plan) and ``train.py model=gpt2
trainer.devices=8 preflight=report`` (the pre-flight alone, interpreter and imports included), and
docs/cluster-plans.md's plan for 2,048 Piz Daint nodes (no profiling: a described cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PLAN = [sys.executable, "scripts/plan.py", "trainer.devices=8", "data.global_batch_size=64", "--json"]
RUNS = {
    "plan gpt2-small": [*PLAN, "{tmp}/plan.json", "model=gpt2-small"],
    "plan gpt2": [*PLAN, "{tmp}/plan.json", "model=gpt2"],
    "preflight gpt2": [sys.executable, "train.py", "model=gpt2", "trainer.devices=8", "preflight=report"],
    "plan piz-daint 2048": [sys.executable, "scripts/plan.py", "cluster=piz-daint", "model=gpt2", "trainer.devices=2048",
                            "data.global_batch_size=2048", "--compare", "--json", "{tmp}/plan.json"],
}
QUICK = {"plan gpt2-tiny": [*PLAN, "{tmp}/plan.json", "model=gpt2-tiny", "--reps", "1"]}


def time_command(name: str, command: list[str]) -> dict[str, Any]:
    """Run ``command`` from the repository root with an empty cache: its wall and CPU seconds (user +
    system, its reaped children included), peak resident set (``wait4``'s: the largest of the process
    and its reaped children; Linux counts the caller's own peak there too, carried across ``exec``, so
    call this from a small process, as :func:`main` runs) and exit status."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [part.format(tmp=tmp) for part in command]
        env = {**os.environ, "PIPELINE_RECIPES_CACHE": tmp}
        log = Path(tmp) / "output.txt"
        with log.open("w") as out:
            start = time.perf_counter()
            child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(child.pid, 0)
            wall = time.perf_counter() - start
        tail = log.read_text().strip().splitlines()[-2:]
    return {"name": name, "command": " ".join(["python", *command[1:]]).replace("{tmp}/", ""),
            "wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_bytes": int(usage.ru_maxrss) * 1024, "returncode": os.waitstatus_to_exitcode(status),
            "last_lines": [line[:300] for line in tail]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON record here")
    parser.add_argument("--quick", action="store_true", help="gpt2-tiny only")
    args = parser.parse_args(argv)
    runs = QUICK if args.quick else RUNS
    results = []
    for name in runs:
        row = time_command(name, runs[name])
        print(f"{name}: {row['wall_s']} s wall, {row['cpu_s']} s CPU, peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB, "
              f"exit {row['returncode']}", flush=True)
        results.append(row)
    record = {"machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "load_average_after": os.getloadavg(), "runs": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
