#!/usr/bin/env python
"""Checkpoint saves in the foreground and in the background (``checkpoint.async_save``), against no saves.

    python scripts/bench_checkpoint.py --out benchmarks/bench_checkpoint.json   # gpt2-small, 2 CPU ranks (minutes)
    python scripts/bench_checkpoint.py --quick --out /tmp/bench_checkpoint.json # gpt2-tiny, a smoke test
    python scripts/bench_checkpoint.py --gpu --out OUT/bench_checkpoint.json    # one GPU (bash scripts/gpu_check.sh
                                                                                # OUT checkpoint runs it)

``train.py`` as a user runs it (Chimera D = 2 on 2 gloo ranks; ``--gpu``: DAPPLE D = 1 on one GPU, bf16-mixed; fused
AdamW, the default logger off) three times with
the same seed and data: without checkpoints, saving every 5 steps in the foreground, and saving every 5 steps in the
background. A callback (:class:`StepClock`, added through ``+trainer.callbacks``) stamps the end of every training
step on rank 0; a save runs after the step it saves (Lightning puts checkpoint callbacks last), so its cost to training
falls in the next step's interval. Throughput: steps per second from the end of the warm-up step to the end of the
last step. From each saving run's ``results.json``: ``checkpoint_saves`` (the seconds training was held by each
save, the seconds until its files were complete, its bytes).

JSON: ``{"runs": {"none" | "sync" | "async": {"steps_per_s", "step_ends", "checkpoint_saves", "loss_history"}},
"ratios": {"async_blocking_over_sync": median blocking async ÷ median blocking sync, "sync_throughput": sync ÷ none,
"async_throughput": async ÷ none}, "meta": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from bench import machine

ROOT = Path(__file__).resolve().parents[1]
CPU_LAYOUT = ["strategy=chimera", "strategy.D=2", "trainer.devices=2"]
SIZES = {"full": {"model": "gpt2-small", "overrides": ["model.seq_len=256", "data.global_batch_size=4", *CPU_LAYOUT],
                  "steps": 16},
         "quick": {"model": "gpt2-tiny", "overrides": ["data.global_batch_size=8", *CPU_LAYOUT], "steps": 8},
         "gpu": {"model": "gpt2-small", "overrides": ["model.seq_len=1024", "data.global_batch_size=8", "trainer=gpu",
                                                      "trainer.devices=1", "strategy=dapple", "strategy.D=1"],
                 "steps": 16}}
EVERY = 5
WARMUP = 1  # steps before the clock starts (the first step builds buffers)
VARIANTS = {"none": [], "sync": [f"checkpoint.every_n_steps={EVERY}", "checkpoint.async_save=false"],
            "async": [f"checkpoint.every_n_steps={EVERY}", "checkpoint.async_save=true"]}


class StepClock(Callback):
    """Rank 0 writes the ``time.perf_counter()`` of every training step's end to ``path`` when training ends."""

    def __init__(self, path: str) -> None:
        self.path, self.ends = path, []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.ends))


def run(variant: str, size: dict[str, Any], work: Path) -> dict[str, Any]:
    out, clock = work / variant, work / f"{variant}.steps.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={out}", f"model={size['model']}", *size["overrides"],
           "logger=none", "preflight=false",
           f"trainer.max_steps={size['steps']}", "checkpoint.keep=all", *VARIANTS[variant],
           f"+trainer.callbacks=[{{_target_:bench_checkpoint.StepClock,path:'{clock}'}}]"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{variant}: train.py exited {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
    ends = json.loads(clock.read_text())
    result = json.loads((out / "results.json").read_text())
    return {"steps_per_s": (len(ends) - WARMUP) / (ends[-1] - ends[WARMUP - 1]), "step_ends": ends,
            "checkpoint_saves": result["checkpoint_saves"], "loss_history": result["loss_history"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="gpt2-tiny, few steps (smoke test)")
    parser.add_argument("--gpu", action="store_true", help="gpt2-small at sequence 1024 on one GPU")
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "gpu" if args.gpu else "full"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        runs = {variant: run(variant, size, Path(tmp)) for variant in VARIANTS}
    blocking = {v: statistics.median(s["blocking_s"] for s in runs[v]["checkpoint_saves"]) for v in ("sync", "async")}
    ratios = {"async_blocking_over_sync": blocking["async"] / blocking["sync"],
              "sync_throughput": runs["sync"]["steps_per_s"] / runs["none"]["steps_per_s"],
              "async_throughput": runs["async"]["steps_per_s"] / runs["none"]["steps_per_s"]}
    meta = {"machine": machine(), "size": size, "every_n_steps": EVERY, "wall_s": round(time.perf_counter() - started, 1),
            "command": "python scripts/bench_checkpoint.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs, "ratios": ratios, "meta": meta}, indent=1))
    for variant, data in runs.items():
        saves = data["checkpoint_saves"]
        said = (f"; saves: blocking median {statistics.median(s['blocking_s'] for s in saves):.3f} s, written in "
                f"{statistics.median(s['write_s'] for s in saves):.3f} s, {saves[0]['bytes'] / 2**20:.0f} MiB"
                if saves else "")
        print(f"{variant:6s} {data['steps_per_s']:.4f} steps/s{said}")
    print(f"async blocking ÷ sync {ratios['async_blocking_over_sync']:.3f}; throughput with saves ÷ without: sync "
          f"{ratios['sync_throughput']:.3f}, async {ratios['async_throughput']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
