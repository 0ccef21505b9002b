#!/usr/bin/env python
"""Sharded optimizer state (``strategy.shard_optimizer``) against whole optimizers, side by side in one run.

    python scripts/bench_shard.py --out benchmarks/bench_shard.json           # gpt2-small on 2 CPU ranks (minutes)
    python scripts/bench_shard.py --quick --out /tmp/bench_shard.json         # gpt2-tiny, seconds (smoke test)

Each layout (Chimera D = 2, W = 1: every stage in two copies, its down and up pipelines; DAPPLE D = 1, W = 2: data
parallelism) is built twice on the same ranks, sharded and not, from the same weights, and trained step by step in
alternating order (the recipe's step: the schedule, clipping by the global norm at 1.0, fused AdamW with weight decay
on the matrices; sharded, its parameter gather). Per rank and variant: the median step time (a step lasts until the
slowest rank returns), the paired ratio sharded ÷ whole, the bytes the rank holds for weights, gradient buffers
and optimizer state, and its peak: those plus the step's peak of stored activations (the executor's count; CPU
processes have no allocator statistics, and both variants share each process); the losses of the two runs, which
must agree.

JSON: ``{"rows": [{"layout", "variant", "step_s", "step_s_by_rank", "parameter_bytes", "gradient_bytes",
"optimizer_state_bytes", "held_bytes", "activation_peak_bytes", "peak_bytes", "losses"}], "ratios": [{"layout",
"time_ratio", "optimizer_state_ratio", "held_ratio", "peak_ratio", "loss_difference"}], "meta": {...}}`` (byte figures
are lists by rank).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import _rounds, _timed_steps, machine, paired_ratio
from pipeline_recipes.strategies.harness.spawn import run_world

LAYOUTS = (("chimera", 2), ("dapple", 1))  # (schedule, D) on 2 ranks
SIZES = {"full": {"model": "gpt2-small", "seq": 256, "samples": 4, "rounds": 5, "warmup": 1},
         "quick": {"model": "gpt2-tiny", "seq": 64, "samples": 4, "rounds": 3, "warmup": 1}}


class _Run:
    """One variant's engine, optimizer and batch; calling it runs one training step as the recipe does."""

    def __init__(self, schedule: str, D: int, shard: bool, size: dict[str, Any], world: int) -> None:
        from functools import partial

        from pipeline_recipes.models import build_model
        from pipeline_recipes.strategies.lightning.optim import param_groups
        from pipeline_recipes.strategies.runtime.engine import build_engine
        from pipeline_recipes.strategies.schedules import derive_layout

        torch.manual_seed(0)
        model = build_model(size["model"], seq_len=size["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        layout = derive_layout(schedule, world, D, size["samples"], B=1, shard_optimizer=shard)
        self.engine = build_engine(model, layout, torch.device("cpu"))
        local = {id(p) for p in self.engine.local_parameters()}
        groups = [{**g, "params": [p for p in g["params"] if id(p) in local]} for g in param_groups(model, 0.1)]
        self.optimizer = self.engine.build_optimizer(partial(torch.optim.AdamW, lr=1e-4, fused=True), groups)
        g = torch.Generator().manual_seed(1)
        replica, N = self.engine.topology.replica_of(torch.distributed.get_rank()), layout.N
        ids = torch.randint(0, model.config.vocab_size, (size["samples"], size["seq"]), generator=g)
        self.batch = {"input_ids": ids[replica * N: (replica + 1) * N]}
        self.losses: list[float] = []

    def __call__(self) -> None:
        loss = self.engine.train_step(self.batch)
        self.engine.clip_grad_norm_(1.0)
        self.optimizer.step()
        self.losses.append(float(loss))

    def held(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.engine.local_parameters())
        grads = sum(b.numel() * b.element_size() for b in self.engine.synchronizer.buffers())
        state = sum(t.numel() * t.element_size() for entry in self.optimizer.state.values() for t in entry.values()
                    if isinstance(t, torch.Tensor))
        record = self.engine.last_record
        activations = record.peak_stored_bytes if record is not None else 0
        return {"parameter_bytes": params, "gradient_bytes": grads, "optimizer_state_bytes": state,
                "held_bytes": params + grads + state, "activation_peak_bytes": activations,
                "peak_bytes": params + grads + state + activations}


def _worker(rank: int, world: int, size: dict[str, Any]) -> list[dict]:
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a two-core machine
    rows = []
    for schedule, D in LAYOUTS:
        runs = {"whole": _Run(schedule, D, False, size, world), "sharded": _Run(schedule, D, True, size, world)}
        times = _rounds(runs, size["rounds"], size["warmup"])
        for variant, run in runs.items():
            mine = torch.tensor([statistics.median(times[variant])], dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            held = {k: [0] * world for k in run.held()}
            for k, v in run.held().items():
                value = torch.tensor([v], dtype=torch.int64)
                parts = [torch.zeros_like(value) for _ in range(world)]
                dist.all_gather(parts, value)
                held[k] = [int(p) for p in parts]
            rows.append({"layout": f"{schedule} D={D} W={world // D}", "variant": variant,
                         "step_s": statistics.median(times[variant]), "step_s_by_rank": [float(t) for t in every],
                         **held, "losses": run.losses, "_times": times[variant]})
        dist.barrier()
    return rows


def _ratios(rows: list[dict]) -> list[dict]:
    out = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        whole, sharded = (next(r for r in rows if r["layout"] == layout and r["variant"] == v)
                          for v in ("whole", "sharded"))
        out.append({"layout": layout, "time_ratio": paired_ratio(sharded["_times"], whole["_times"]),
                    "optimizer_state_ratio": max(s / w for s, w in zip(sharded["optimizer_state_bytes"],
                                                                       whole["optimizer_state_bytes"])),
                    "held_ratio": max(s / w for s, w in zip(sharded["held_bytes"], whole["held_bytes"])),
                    "peak_ratio": max(s / w for s, w in zip(sharded["peak_bytes"], whole["peak_bytes"])),
                    "loss_difference": max(abs(a - b) for a, b in zip(sharded["losses"], whole["losses"]))})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="gpt2-tiny, few steps (smoke test)")
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    began = time.perf_counter()
    rows = run_world(2, _worker, size, timeout=3600)[0]
    ratios = _ratios(rows)
    data = {"rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows], "ratios": ratios,
            "meta": {"machine": machine(), "size": size, "wall_s": round(time.perf_counter() - began, 1),
                     "command": " ".join(["python scripts/bench_shard.py", *(argv if argv is not None else sys.argv[1:])])}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    for r in data["rows"]:
        print(f"{r['layout']:<20} {r['variant']:<8} step {r['step_s']:.3f} s  peak/rank "
              f"{[round(b / 2**20) for b in r['peak_bytes']]} MiB  optimizer state "
              f"{[round(b / 2**20) for b in r['optimizer_state_bytes']]} MiB")
    for r in ratios:
        print(f"{r['layout']:<20} sharded/whole: step time {r['time_ratio']:.3f}, optimizer state "
              f"{r['optimizer_state_ratio']:.3f}, peak {r['peak_ratio']:.3f}, losses differ by {r['loss_difference']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
