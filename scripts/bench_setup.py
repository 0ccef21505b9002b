#!/usr/bin/env python
"""Set-up time and peak resident memory of each pipeline rank's model, before and after per-stage construction.

    python scripts/bench_setup.py --out benchmarks/setup_memory.json              # model=gpt2, D = 8
    python scripts/bench_setup.py --model gpt2-tiny --stages 4 --out /tmp/s.json  # smoke run, seconds

Each (mode, rank) runs in a fresh process, one after the other (eight full fp32 builds of the paper
GPT-2 would not fit in this machine's memory side by side), and does what a rank's set-up does with
the model, on the CPU, in fp32:

* ``full`` (before): build the whole model (every layer initialised), then drop the layers of other
  stages as ``PipelineEngine`` does; the unsplit HF reference still holds them, as it always did.
* ``meta`` (after): build on the meta device, materialise the rank's layers
  (:func:`pipeline_recipes.core.pipeline_model.materialize_local`, the engine's call), drop the other layers.

Per rank: ``setup_s`` (build + materialise + drop, wall clock; ``setup_cpu_s`` its CPU time, which
other users' load on a shared machine disturbs less), ``baseline_bytes`` (resident memory
after the imports, before the build), ``peak_bytes`` (the process's peak resident memory,
``ru_maxrss``), ``peak_minus_baseline_bytes``, ``held_bytes`` (real, non-meta parameter and buffer
bytes reachable from the model afterwards) and ``stage_param_bytes`` (the rank's layers alone).
The partition is the model's own (``model.partition(D)``, as ``train.py`` uses).

``--runs BASELINE RUN`` instead compares two finished ``train.py`` job directories: each rank's peak
resident memory (``results.json: peak_memory_bytes``) of RUN minus that of a tiny BASELINE run of the
same layout, against the fp32 bytes of RUN's whole model (from its ``job.yaml``, built on meta).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("full", "meta")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _child(model_name: str, stages: int, rank: int, mode: str) -> dict[str, Any]:
    """One rank's model set-up in this process (see the module docstring)."""
    import gc

    import torch
    from torch import nn

    from pipeline_recipes.models import build_model
    from pipeline_recipes.core.pipeline_model import materialize_local

    torch.set_num_threads(1)
    layout = build_model(model_name, device="meta")
    stage = layout.partition(stages)[rank]
    del layout
    gc.collect()
    baseline = _rss_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    model = build_model(model_name, init_seed=0, device=None if mode == "full" else "meta")
    materialize_local(model, stage, torch.device("cpu"))
    layers = model.pipeline_layers()
    kept = [layers[i] for i in stage]
    for i in range(len(layers)):
        if i not in stage:
            layers[i] = nn.Identity()
    gc.collect()
    setup_s, setup_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    ref = model.reference()

    def nbytes(tensors: Any) -> int:
        unique = {id(t): t for t in tensors if not t.is_meta}
        return sum(t.numel() * t.element_size() for t in unique.values())

    peak = _peak_bytes()
    return {"mode": mode, "rank": rank, "layers": [stage.start, stage.stop], "setup_s": round(setup_s, 3),
            "setup_cpu_s": round(setup_cpu_s, 3),
            "baseline_bytes": baseline, "peak_bytes": peak, "peak_minus_baseline_bytes": peak - baseline,
            "held_bytes": nbytes([*ref.parameters(), *ref.buffers()]),
            "stage_param_bytes": nbytes([t for layer in kept for t in (*layer.parameters(), *layer.buffers())])}


def _run_child(args: argparse.Namespace, rank: int, mode: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, __file__, "--child", mode, str(rank), "--model", args.model, "--stages", str(args.stages)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} rank {rank} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if mine:
            out[mode] = {"max_peak_bytes": max(r["peak_bytes"] for r in mine),
                         "max_peak_minus_baseline_bytes": max(r["peak_minus_baseline_bytes"] for r in mine),
                         "max_setup_s": max(r["setup_s"] for r in mine),
                         "max_setup_cpu_s": max(r["setup_cpu_s"] for r in mine),
                         "sum_peak_bytes": sum(r["peak_bytes"] for r in mine), "ranks": len(mine)}
    return out


def compare_runs(baseline: Path, run: Path) -> dict[str, Any]:
    """Per-rank peak memory of ``run`` above the tiny ``baseline`` run, and its ratio to the fp32 bytes
    of ``run``'s whole model."""
    from omegaconf import OmegaConf

    from pipeline_recipes.models import build_model

    base = json.loads((baseline / "results.json").read_text())["peak_memory_bytes"]
    peaks = json.loads((run / "results.json").read_text())["peak_memory_bytes"]
    if len(base) != len(peaks):
        raise ValueError(f"{baseline} has {len(base)} ranks, {run} has {len(peaks)}: compare the same layout")
    model_cfg = OmegaConf.to_container(OmegaConf.load(run / "job.yaml"), resolve=True)["config"]["model"]
    params = build_model(model_cfg, device="meta").num_parameters()
    model_bytes = 4 * params
    above = [p - b for p, b in zip(peaks, base)]
    return {"baseline_dir": str(baseline), "run_dir": str(run), "model": model_cfg.get("name"), "params": params,
            "model_fp32_bytes": model_bytes, "baseline_peak_bytes": base, "run_peak_bytes": peaks,
            "above_baseline_bytes": above, "above_baseline_over_model": [round(a / model_bytes, 4) for a in above],
            "max_over_model": round(max(above) / model_bytes, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_setup.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--model", default="gpt2", help="model preset (default: the paper's GPT-2)")
    parser.add_argument("--stages", type=int, default=8, help="D (default 8)")
    parser.add_argument("--ranks", default="all", help="ranks to measure, e.g. 0,7 (default all)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--runs", nargs=2, metavar=("BASELINE", "RUN"), help="compare two train.py job directories")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs:
        result = compare_runs(Path(args.runs[0]), Path(args.runs[1]))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
        return 0
    if args.child:
        print(json.dumps(_child(args.model, args.stages, int(args.child[1]), args.child[0])))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    if bad := sorted(set(modes) - set(MODES)):
        parser.error(f"unknown mode(s) {bad}; choose from {MODES}")
    ranks = list(range(args.stages)) if args.ranks == "all" else [int(r) for r in args.ranks.split(",")]
    rows = []
    for mode in modes:
        for rank in ranks:
            row = _run_child(args, rank, mode)
            rows.append(row)
            gib = {k: row[k] / 2**30 for k in ("peak_bytes", "baseline_bytes", "held_bytes", "stage_param_bytes")}
            print(f"{mode:4s} rank {rank}: layers {row['layers'][0]}-{row['layers'][1] - 1}, "
                  f"set-up {row['setup_s']:.2f} s ({row['setup_cpu_s']:.2f} s CPU), "
                  f"peak RSS {gib['peak_bytes']:.2f} GiB (baseline {gib['baseline_bytes']:.2f} GiB), "
                  f"held {gib['held_bytes']:.3f} GiB, stage {gib['stage_param_bytes']:.3f} GiB", flush=True)
    import torch

    given = argv if argv is not None else sys.argv[1:]
    result = {"command": "python scripts/bench_setup.py " + " ".join(given),
              "model": args.model, "stages": args.stages, "dtype": "float32", "device": "cpu",
              "machine": f"{platform.machine()} {os.cpu_count()} cores, "
                         f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB RAM",
              "torch": torch.__version__, "rows": rows, "summary": _summary(rows)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
