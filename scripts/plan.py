#!/usr/bin/env python
"""Plan a run: profile the model here, predict time and memory of every layout, recommend one.

    python scripts/plan.py model=gpt2-small trainer.devices=8 data.global_batch_size=64
    python scripts/plan.py model=gpt2-tiny trainer.devices=4 --json plan.json --budget 2GiB
    python scripts/plan.py model=gpt2-tiny --partition memory --schedules chimera,dapple
    python scripts/plan.py cluster=piz-daint model=gpt2 trainer.devices=2048 data.global_batch_size=2048 --compare

``cluster=<name>`` (``conf/cluster/``; default ``local``: profile this machine) plans for a described cluster without
its hardware: ``trainer.devices`` is then the total number of devices, times derived from FLOPs at an efficiency
calibrated on ``benchmarks/bench_gpu.json`` (said in the output), memory from the fake-tensor estimate, the network
from the description (intra- vs inter-node links, its all-reduce algorithm).

Positional arguments are ``train.py``'s Hydra overrides (same ``conf/``); options:

* ``--json FILE``: write every candidate as ``{"strategy", "W", "D", "B", "N", "pipelines", "concat",
  "recompute", "shard_optimizer", "predicted_iteration_s", "predicted_peak_bytes_per_rank", "fits"}``, best first;
* ``--cache DIR``: profile cache (default ``~/.cache/pipeline-recipes/planner``); ``--refresh`` re-profiles;
* ``--profile-batches 1,2``, ``--reps 5``, ``--profile-seconds 30``: profiling micro-batch sizes, the most
  timed repetitions per layer and size, and their time budget (at least 1 repetition runs); identical
  layers (the transformer blocks) are profiled once; progress lines on stderr estimate the time left;
* ``--comm measure|default|none``: 2-process gloo micro-benchmarks (cached), built-in constants, or none;
* ``--budget 8GiB``: memory budget (per rank on GPU, per node on CPU) instead of the device's;
* ``--partition runtime|time|memory``: the split used for predictions (``runtime``: what train.py runs; for a
  described cluster ``runtime`` or ``time``, whose ``best_per_schedule`` rows give the split as ``split_overrides``);
* ``--schedules``, ``--recompute``, ``--grad-sync``, ``--top``: the search space and the table length;
* ``--shard-optimizer false,true``: the ``strategy.shard_optimizer`` choices compared (default both; sharded only
  where some stage has copies, ZeRO stage 1 across them: docs/planner.md, "Sharded optimizer state");
* ``--compare``: the best layout of every schedule (W, D, B, recomputation, samples/s, step time, bubble, unhidden
  gradient sync time, exposed parameter all-gather, peak memory, variant: e.g. ``shard_optim``), then why: each one's
  step split into compute, bubble, messages and unhidden collectives, and its fullest rank's peak into weights,
  gradients, optimizer state and activations; with ``--json`` the file is ``{"cluster", "best_per_schedule": {name:
  {...}}, "rows"}`` (each with ``shard_optimizer``; each best with ``time_split: {compute_s, bubble_s, p2p_s,
  allreduce_s}`` summing to ``step_s`` and ``memory_split: {weights, gradients, optimizer, activations}`` in bytes,
  summing to ``peak_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", dest="json_path", help="write the ranked candidates to this JSON file")
    p.add_argument("--cache", help="profile cache directory")
    p.add_argument("--refresh", action="store_true", help="re-profile even if cached")
    p.add_argument("--profile-batches", default="1,2", help="micro-batch sizes to profile at (two or more)")
    p.add_argument("--reps", type=int, default=5, help="most timed repetitions per layer and size")
    p.add_argument("--profile-seconds", type=float, default=30.0,
                   help="time budget of the timed repetitions (at least 1 runs); 0: no budget")
    p.add_argument("--comm", default="measure", choices=("measure", "default", "none"))
    p.add_argument("--budget", help="memory budget, e.g. 16GiB (per rank on GPU, per node on CPU)")
    p.add_argument("--partition", default="runtime", choices=("runtime", "time", "memory"))
    p.add_argument("--schedules", help="comma-separated schedules of the registry (default: every synchronous one)")
    p.add_argument("--recompute", default="none,always")
    p.add_argument("--grad-sync", default="end", choices=("end", "eager", "eager_opt"))
    p.add_argument("--shard-optimizer", default="false,true",
                   help="strategy.shard_optimizer choices to compare: false, true or false,true")
    p.add_argument("--top", type=int, default=15, help="rows of the table (0: all)")
    p.add_argument("--compare", action="store_true", help="the best layout of every schedule")
    return p


def compose_config(overrides: list[str]):  # -> DictConfig
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        _parser().error(f"unknown option(s) {bad}")
    if args.reps < 1 or args.profile_seconds < 0:
        _parser().error(f"--reps must be at least 1 and --profile-seconds at least 0 (0: no budget), "
                        f"got {args.reps} and {args.profile_seconds}")
    args.shard_choices = _shard_choices(args.shard_optimizer)
    from omegaconf import OmegaConf

    from pipeline_recipes.core.node import GPU_NAMES
    from pipeline_recipes.models.partition import format_partition_table
    from pipeline_recipes.planner.costs import format_bytes, parse_bytes
    from pipeline_recipes.planner.estimate import with_run_memory
    from pipeline_recipes.planner.memory import device_budget
    from pipeline_recipes.planner.partition_search import partition_overrides, recommend_partition
    from pipeline_recipes.planner.profile import load_or_profile
    from pipeline_recipes.planner.recommend import format_table, plan_all, plan_rows
    from pipeline_recipes.recipe.check.accelerator import choose_accelerator

    cfg = compose_config(overrides)
    from pipeline_recipes.planner.cluster import ClusterSpec

    spec = ClusterSpec.from_config(cfg.cluster)
    if not spec.measure:
        return _plan_cluster(cfg, spec, args)
    trainer = choose_accelerator(OmegaConf.to_container(cfg.trainer, resolve=True)).trainer  # trainer=auto: this node
    accelerator = str(trainer.get("accelerator", "cpu"))
    per_node, nodes = int(trainer.get("devices", 1)), int(trainer.get("num_nodes", 1))
    devices = per_node * nodes
    global_batch = int(cfg.data.global_batch_size)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    costs = load_or_profile(cfg.model, cache_dir=args.cache, refresh=args.refresh, comm=args.comm,
                            batch_sizes=[int(b) for b in args.profile_batches.split(",")], reps=args.reps,
                            device="cuda" if accelerator in GPU_NAMES else "cpu", log=log,
                            budget_s=args.profile_seconds or None)
    # the profile runs without autocast; a bf16-mixed run's activations and weight copies come from the estimate
    costs = with_run_memory(costs, OmegaConf.to_container(cfg.model, resolve=True), precision=trainer.get("precision"),
                            device="cuda" if accelerator in GPU_NAMES else "cpu")
    budget = device_budget(accelerator, override=parse_bytes(args.budget) if args.budget else None,
                           process_bytes=costs.comm.process_bytes)
    plans = plan_all(costs, devices, global_batch, budget, ranks_per_node=per_node,
                     schedules=[s for s in args.schedules.split(",") if s] if args.schedules else None,
                     recompute=[r for r in args.recompute.split(",") if r], grad_sync=args.grad_sync,
                     partition=args.partition, shard_optimizer=args.shard_choices)
    c = costs.comm
    print(f"model {costs.model}: {costs.num_layers} pipeline layers on {costs.device}; p2p α={c.p2p.alpha * 1e6:.0f} µs "
          f"β={c.p2p.beta * 1e9:.3f} s/GB, all-reduce α={c.allreduce.alpha * 1e6:.0f} µs β={c.allreduce.beta * 1e9:.3f} s/GB"
          f", runtime {c.action_s * 1e6:.0f} µs/action")
    print(f"{len(plans)} layouts of {devices} processes for global batch {global_batch}; budget {budget.describe()}")
    print(format_table(plans, args.top or None))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(plan_rows(plans), indent=1))
        print(f"wrote {len(plans)} rows to {args.json_path}")
    if not plans:
        print("no layout: the global batch must be divisible by the replicas W")
        return 1
    best = plans[0]
    if best.candidate.D > 1:
        names = [layer.name for layer in costs.layers]
        counts = [layer.params for layer in costs.layers]
        for objective in ("time", "memory"):
            part = recommend_partition(costs, best.candidate, objective)
            peaks = " ".join(format_bytes(p) for p in _peaks(costs, best.candidate, part))
            print(f"\npartition by {objective} for #1 (peak per worker: {peaks}):")
            print(format_partition_table(part, names, counts))
            hint = partition_overrides(part, costs.meta.get("layer_costs") or [1.0] * costs.num_layers)
            if hint:
                print("  train.py: " + " ".join(hint))
    if best.fits:
        extra = []
        if args.partition != "runtime" and best.candidate.D > 1:
            hint = partition_overrides(best.partition, costs.meta.get("layer_costs") or [1.0] * costs.num_layers)
            extra = hint or []
            if not hint:
                print(f"(the {args.partition}-balanced split above has no model.embedding_cost/head_cost equivalent; "
                      "the command runs train.py's own split)")
        print("\nbest: python train.py " + " ".join(overrides + best.candidate.overrides() + extra))
        return 0
    print(f"\nnothing fits {budget.describe()}; smallest predicted peak per rank "
          f"{format_bytes(min(p.memory.max_rank for p in plans))}")
    return 1


def _plan_cluster(cfg, spec, args) -> int:
    """Plan for a described cluster (no profiling here): see the module docstring."""
    import time

    from pipeline_recipes.planner.derived_costs import described_budget, described_costs, run_precision
    from pipeline_recipes.planner.recommend import best_per_schedule, best_plans, format_table, plan_rows

    if args.partition == "memory":
        print(f"error: --partition memory is not searched for cluster={spec.name} (a memory walk per split and "
              "layout); use --partition time or runtime", file=sys.stderr)
        return 2
    start = time.perf_counter()
    precision = run_precision(spec, cfg.trainer.get("precision"))
    devices = int(cfg.trainer.get("devices", 1)) * int(cfg.trainer.get("num_nodes", 1) or 1)
    global_batch = int(cfg.data.global_batch_size)
    costs = described_costs(cfg.model, spec, precision)
    budget = described_budget(spec)
    from pipeline_recipes.strategies.schedules import names

    every = names() if args.compare else None  # --compare: the asynchronous schedules too
    requested = [s for s in args.schedules.split(",") if s] if args.schedules else every
    plans = best_plans(costs, devices, global_batch, budget, ranks_per_node=spec.devices_per_node, schedules=requested,
                       recompute=[r for r in args.recompute.split(",") if r], grad_sync=args.grad_sync,
                       partition=args.partition, shard_optimizer=args.shard_choices)
    print(f"cluster {spec.name}: {devices} x {spec.device} ({spec.nodes(devices)} nodes of {spec.devices_per_node}), "
          f"all-reduce {spec.allreduce}; model {costs.model}, {costs.num_layers} pipeline layers, precision {precision}")
    print(f"NOTE: {costs.meta['derived']}")
    print(f"the best layout of each of {len(plans)} schedules for global batch {global_batch}; budget {budget.describe()}")
    if not args.compare:  # --compare prints the same layouts once, with more columns, below
        print(format_table(plans, args.top or None))
    best = best_per_schedule(plans, costs)
    if args.partition != "runtime":  # how train.py runs each schedule's split (None: no model.*_cost pair gives it)
        from pipeline_recipes.planner.partition_search import partition_overrides

        weights = costs.meta.get("layer_costs") or [1.0] * costs.num_layers
        for plan in plans:  # best_plans: one plan per schedule
            best[plan.candidate.strategy]["split_overrides"] = partition_overrides(plan.partition, weights)
    for name in [n for n in (requested or names()) if n not in best]:  # e.g. dualpipev needs N >= 2D
        best[name] = {"W": None, "D": None, "B": None, "recompute": None, "shard_optimizer": None,
                      "samples_per_s": None, "peak_bytes": None,
                      "no_layout": f"no layout of {devices} devices for global batch {global_batch} passes {name}'s "
                                   "rules (python scripts/schedule.py explains them)"}
    if args.compare:
        print(_format_compare(best))
    elapsed = time.perf_counter() - start
    print(f"planned in {elapsed:.1f} s")
    if args.json_path:
        out = {"cluster": spec.name, "model": costs.model, "devices": devices, "global_batch_size": global_batch,
               "cost_source": costs.meta["derived"], "planning_s": elapsed, "best_per_schedule": best,
               "rows": plan_rows(plans[: args.top or None])}
        Path(args.json_path).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json_path}")
    return 0 if plans and plans[0].fits else 1


def _shard_choices(text: str) -> tuple[bool, ...]:
    """``--shard-optimizer``: ``false``, ``true`` or both, comma-separated."""
    values = {"false": False, "true": True}
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if not words or any(w not in values for w in words):
        _parser().error(f"--shard-optimizer takes false, true or false,true, got {text!r}")
    return tuple(dict.fromkeys(values[w] for w in words))


def _variant(row: dict) -> str:
    """What the layout sets beyond the schedule's defaults (its label after the schedule's name), e.g.
    ``forward_doubling+shard_optim``; ``-`` for none."""
    label = row.get("label") or ""
    return label.split("+", 1)[1] if "+" in label else "-"


def _format_compare(best: dict) -> str:
    lines = [f"{'schedule':<22} {'W':>5} {'D':>3} {'B':>3} {'recompute':>9} {'samples/s':>10} {'step s':>8} "
             f"{'bubble':>6} {'all-red s':>9} {'gather s':>8} {'peak GiB':>8} fits variant"]
    for name, row in sorted(best.items(), key=lambda kv: -(kv[1]["samples_per_s"] or 0.0)):
        if row["samples_per_s"] is None:
            lines.append(f"{name:<22} {row['no_layout']}")
            continue
        lines.append(f"{name:<22} {row['W']:>5} {row['D']:>3} {row['B']:>3} {row['recompute']:>9} "
                     f"{row['samples_per_s']:>10.2f} {row['step_s']:>8.3f} {row['bubble']:>6.1%} "
                     f"{row['allreduce_s']:>9.3f} {row['gather_s']:>8.3f} {row['peak_bytes'] / 2**30:>8.2f} "
                     f"{'yes ' if row['fits'] else 'NO  '} {_variant(row)}")
    lines += ["", "why: each best layout's predicted step (seconds) and its fullest rank's peak (GiB), in parts",
              f"{'schedule':<22} {'compute':>8} {'bubble':>8} {'p2p':>8} {'all-red':>8} = {'step s':>8}   "
              f"{'weights':>7} {'grads':>7} {'optim':>7} {'acts':>7} = {'peak':>7}"]
    for name, row in sorted(best.items(), key=lambda kv: -(kv[1]["samples_per_s"] or 0.0)):
        if row["samples_per_s"] is None:
            continue
        time, memory = row["time_split"], {k: v / 2**30 for k, v in row["memory_split"].items()}
        lines.append(f"{name:<22} {time['compute_s']:>8.3f} {time['bubble_s']:>8.3f} {time['p2p_s']:>8.3f} "
                     f"{time['allreduce_s']:>8.3f} = {row['step_s']:>8.3f}   {memory['weights']:>7.2f} "
                     f"{memory['gradients']:>7.2f} {memory['optimizer']:>7.2f} {memory['activations']:>7.2f} = "
                     f"{row['peak_bytes'] / 2**30:>7.2f}")
    return "\n".join(lines)


def _peaks(costs, cand, part) -> list[float]:
    from pipeline_recipes.planner.partition_search import rank_peaks

    return rank_peaks(costs, cand, part, keep_sends=not costs.device.startswith("cuda"))


if __name__ == "__main__":
    sys.exit(main())
