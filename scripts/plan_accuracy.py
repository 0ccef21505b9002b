#!/usr/bin/env python
"""Accuracy of the planner: predicted vs measured iteration time and peak memory.

    python scripts/plan_accuracy.py --out plan_accuracy.json        # 24 layouts × 3 repeats, ~16 minutes
    python scripts/plan_accuracy.py --quick --out /tmp/acc.json     # 5 layouts, one repeat (smoke)

Two models (real and emulated compute):

* the tiny GPT-2 (``conf/model/gpt2-tiny.yaml``, real compute), profiled as ``scripts/plan.py`` does;
* an 8-layer :class:`pipeline_recipes.strategies.harness.emulated.EmulatedPipeline` (each layer holds the core-free time of a
  forward/backward and sends real activations), profiled by the same
  :func:`pipeline_recipes.planner.profile.profile_pipeline`, so that D = 4 and 8 run faithfully on a 2-core machine.

Profiles are re-measured at the start of each run (``--cached`` reuses the planner's cache): the
speed of a shared machine drifts by more than the accuracy being measured. For the same reason the
whole profile-then-measure sequence runs ``--repeats`` times (3) and each layout's median predicted
and median measured time count (:func:`merge_repeats`): a slow spell between a profile and its
measurements then moves one repeat, not the result. Each layout is then
predicted (:func:`pipeline_recipes.planner.recommend.plan_one`) and measured by
running :class:`pipeline_recipes.strategies.runtime.engine.PipelineEngine` directly in spawned gloo processes (one CPU thread
each, :func:`pipeline_recipes.strategies.harness.spawn.run_world`): the wall time of ``train_step`` + ``AdamW.step`` (barrier
before and after) as the best of ``--rounds`` interleaved rounds' medians (on a shared machine other
users' load only slows a round down; the profile's medians are likewise taken over samples spread
in time), and each rank's peak memory = parameters + AdamW state + the gradient buckets (live tensors) +
the median over 3 profiled steps of the peak of its CPU allocations in the step (``torch.profiler``
memory events).

JSON: ``{"profile": {compute: [per repeat]}, "rows": [{layout..., "predicted_s", "measured_s", "time_error",
"predicted_peak_bytes", "measured_peak_bytes", "memory_error", "repeats"}], "summary": {...}, "meta": {...}}``
(``meta``: the machine and commit, the command, when it started, its wall time and the load average
before and after, as ``scripts/bench.py`` records them) where errors are
``|pred − meas| / meas`` (memory: the largest over the ranks). Real-compute layouts with more
ranks than cores (``oversubscribed``) are measured and reported, but kept out of the accuracy
summary: the planner models one device per rank, which they do not have (their errors are
summarised apart, ``oversubscribed_time_error_*``). ``summary.by_compute`` splits the counted errors
by compute kind, with the median signed error (below zero: under-predicted).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "gpt2-tiny"
# (schedule, W, D, B, N, pipelines, concat, recompute, grad_sync)
LAYOUTS = [
    ("gpipe", 1, 2, 4, 4, 1, "direct", "none", "end"),
    ("dapple", 1, 2, 4, 4, 1, "direct", "none", "end"),
    ("chimera", 1, 2, 4, 4, 2, "direct", "none", "end"),
    ("dapple", 1, 2, 2, 8, 1, "direct", "none", "end"),
    ("chimera", 1, 2, 2, 8, 2, "direct", "none", "end"),
    ("chimera", 1, 2, 2, 8, 2, "backward_halving", "none", "end"),
    ("gpipe", 1, 2, 8, 2, 1, "direct", "always", "end"),
    ("chimera", 1, 2, 8, 4, 2, "direct", "none", "eager"),
    ("gpipe", 1, 4, 2, 4, 1, "direct", "none", "end"),
    ("dapple", 1, 4, 2, 8, 1, "direct", "none", "end"),
    ("chimera", 1, 4, 2, 4, 2, "direct", "none", "end"),
    ("chimera", 1, 4, 1, 8, 2, "forward_doubling", "none", "end"),
    ("dapple", 1, 4, 4, 4, 1, "direct", "always", "end"),
    ("dapple", 2, 2, 2, 4, 1, "direct", "none", "end"),
]
# emulated compute: 8 layers of t_f = 5 ms per sample (t_b = 2 t_f), 64 KiB activations, 256 KiB of weights
EMULATED = {"stages": 8, "t_f": 0.005, "activation_numel": 16384, "param_numel": 65536}
EMULATED_LAYOUTS = [
    ("gpipe", 1, 4, 1, 4, 1, "direct", "none", "end"),
    ("dapple", 1, 4, 1, 8, 1, "direct", "none", "end"),
    ("gems", 1, 4, 1, 4, 2, "direct", "none", "end"),
    ("chimera", 1, 4, 1, 4, 2, "direct", "none", "end"),
    ("chimera", 1, 4, 1, 8, 2, "forward_doubling", "none", "end"),
    ("chimera", 1, 4, 1, 8, 2, "direct", "none", "eager_opt"),
    ("gpipe", 2, 4, 1, 4, 1, "direct", "none", "end"),
    ("dapple", 1, 8, 1, 8, 1, "direct", "none", "end"),
    ("chimera", 1, 8, 1, 8, 2, "direct", "none", "end"),
    ("chimera", 1, 8, 2, 8, 4, "direct", "none", "end"),
]
QUICK = [LAYOUTS[1], LAYOUTS[2], LAYOUTS[13]]
QUICK_EMULATED = [EMULATED_LAYOUTS[1], EMULATED_LAYOUTS[3]]


def build_measured_model(spec: str | dict[str, Any]) -> Any:
    """A preset name (real compute) or :data:`EMULATED`'s settings."""
    if isinstance(spec, str):
        from pipeline_recipes.models import build_model

        return build_model(spec)
    from pipeline_recipes.strategies.harness.emulated import EmulatedPipeline

    return EmulatedPipeline(**spec)


def batch_of(model: Any, size: int, seed: int) -> dict[str, Any]:
    from pipeline_recipes.planner.profile import make_batch
    from pipeline_recipes.strategies.harness.emulated import EmulatedPipeline

    return model.batch(size) if isinstance(model, EmulatedPipeline) else make_batch(model, size, seed=seed)


def profile(spec: str | dict[str, Any], args: argparse.Namespace, log: Any) -> Any:
    """The profile the planner predicts with: measured now (default) or the planner's cache."""
    from pipeline_recipes.planner.comm_profile import load_or_measure_comm
    from pipeline_recipes.planner.profile import DEFAULT_CACHE, load_or_profile, profile_pipeline

    cache = Path(args.cache) if args.cache else DEFAULT_CACHE
    if isinstance(spec, str):
        return load_or_profile(spec, cache_dir=cache, refresh=not args.cached, reps=args.reps, log=log)
    import torch

    log(f"profile: measuring the emulated pipeline {spec} ...")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_measured_model(spec)
        costs = profile_pipeline(model, lambda size: batch_of(model, size, 0), "emulated", batch_sizes=(1, 2),
                                 reps=args.reps, shares_cores=False)
    cache.mkdir(parents=True, exist_ok=True)
    return costs.with_comm(load_or_measure_comm(cache, costs.device, log=log))


def _measure_worker(rank: int, world: int, spec: str | dict[str, Any], layouts: list[tuple], steps: int,
                    warmup: int, rounds: int, memory_steps: int = 3) -> list[dict[str, Any]]:
    """Runs in every rank: ``rounds`` interleaved rounds of ``steps`` timed iterations per layout (the
    best round's median is kept: background load on a shared machine only ever slows a round down),
    then ``memory_steps`` profiled iterations per layout for memory, of which the median peak counts
    (a single profiled step once measured 0.75 MiB above its mirror rank and every repeat)."""
    import torch
    import torch.distributed as dist

    from pipeline_recipes.models.partition import balanced_partition
    from pipeline_recipes.planner.profile import _peak_in_ranges
    from pipeline_recipes.strategies.runtime.engine import build_engine
    from pipeline_recipes.strategies.schedules import derive_layout

    runs = []
    for name, W, D, B, N, pipes, concat, recompute, sync in layouts:
        torch.manual_seed(0)
        model = build_measured_model(spec)
        layout = derive_layout(name, W * D, D, W * B * N, B=B, pipelines=pipes, concat=concat, recompute=recompute,
                               grad_sync=sync)
        partition = (model.partition(D) if hasattr(model, "partition")
                     else balanced_partition([1.0] * len(model.pipeline_layers()), D))  # = planner.runtime_partition
        engine = build_engine(model, layout, torch.device("cpu"), partition=partition)
        params = engine.local_parameters()
        opt = torch.optim.AdamW(params, lr=1e-4)
        full = batch_of(model, W * B * N, seed=1)
        replica = rank // D
        batch = {k: v[replica * B * N : (replica + 1) * B * N] for k, v in full.items()}

        def step(engine: Any = engine, opt: Any = opt, batch: Any = batch) -> None:
            engine.train_step(batch)
            opt.step()

        runs.append((engine, params, opt, step))

    def timed(step: Any, count: int) -> list[float]:
        times = []
        for _ in range(count):
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - start)
        return times

    medians: list[list[float]] = [[] for _ in runs]
    samples: list[list[float]] = [[] for _ in runs]
    for _, _, _, step in runs:
        timed(step, warmup)
    for _ in range(rounds):
        for k, (_, _, _, step) in enumerate(runs):
            times = timed(step, steps)
            medians[k].append(statistics.median(times))
            samples[k] += times
    out = []
    from torch.profiler import ProfilerActivity, profile, record_function

    for k, (engine, params, opt, step) in enumerate(runs):
        held = {id(p): p for p in params}
        held.update({id(t): t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)})
        held.update({id(t): t for t in engine.synchronizer.buffers()})  # gradient buckets, kept across steps
        base = sum(t.numel() * t.element_size() for t in held.values())
        windows = []
        for _ in range(memory_steps):
            for p in params:
                p.grad = None
            dist.barrier()
            with open(os.devnull, "w") as devnull:
                stderr, sys.stderr = sys.stderr, devnull
                try:
                    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                        with record_function("plan::step"):
                            step()
                finally:
                    sys.stderr = stderr
            windows.append(_peak_in_ranges(prof, ["plan::step"])["plan::step"])
        out.append({"time_s": min(medians[k]), "round_medians": medians[k], "times": samples[k],
                    "peak_bytes": base + statistics.median(windows), "states_bytes": base,
                    "step_peaks": windows,
                    "stored_peak": engine.last_record.peak_stored_bytes})
        dist.barrier()
    return out


def _row(compute: str, costs: Any, layout: tuple, results: list[dict]) -> dict[str, Any]:
    """One layout's prediction next to what every rank measured."""
    from pipeline_recipes.planner.predict import Candidate
    from pipeline_recipes.planner.recommend import plan_one

    name, W, D, B, N, pipes, concat, recompute, sync = layout
    cand = Candidate.of(name, W, D, B, N, pipes, concat, recompute, sync)
    plan = plan_one(costs, cand)
    measured_s = max(r["time_s"] for r in results)
    measured_peak = [int(r["peak_bytes"]) for r in results]
    predicted_peak = plan.memory.per_rank
    return {"compute": compute, "layout": cand.label(), "W": W, "D": D, "B": B, "N": N, "pipelines": pipes,
            "concat": concat, "recompute": recompute, "grad_sync": sync,
            "oversubscribed": bool(costs.cores) and W * D > costs.cores,
            "predicted_s": plan.time.iteration_s, "measured_s": measured_s,
            "time_error": abs(plan.time.iteration_s - measured_s) / measured_s,
            "measured_round_medians": results[0]["round_medians"], "measured_step_times": results[0]["times"],
            "predicted_peak_bytes": predicted_peak, "measured_peak_bytes": measured_peak,
            "measured_states_bytes": [int(r["states_bytes"]) for r in results],
            "measured_stored_peak": [int(r["stored_peak"]) for r in results],
            "memory_error": max(abs(pp - mp) / mp for pp, mp in zip(predicted_peak, measured_peak))}


def merge_repeats(repeats: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per layout from independent repeats (each re-profiled and re-measured, so a slow
    spell of a shared machine between a profile and its measurements moves one repeat, not the
    result): the median predicted and the median measured time, errors recomputed from them; peak
    memory (deterministic) from the first repeat."""
    out = []
    for rows in zip(*repeats):
        first = dict(rows[0])
        predicted = statistics.median(r["predicted_s"] for r in rows)
        measured = statistics.median(r["measured_s"] for r in rows)
        first.update({"predicted_s": predicted, "measured_s": measured,
                      "time_error": abs(predicted - measured) / measured,
                      "repeats": [{"predicted_s": r["predicted_s"], "measured_s": r["measured_s"],
                                   "time_error": r["time_error"]} for r in rows]})
        out.append(first)
    return out


def _describe(row: dict[str, Any]) -> str:
    repeats = row.get("repeats") or []
    errors = ", ".join(f"{r['time_error']:.1%}" for r in repeats)
    per_repeat = f" [repeats: {errors}]" if len(repeats) > 1 else ""
    return (f"  {row['compute']:8s} {row['layout']:28s} W={row['W']} D={row['D']} B={row['B']} N={row['N']}: time "
            f"{row['predicted_s'] * 1e3:7.2f} ms predicted, {row['measured_s'] * 1e3:7.2f} ms measured "
            f"({row['time_error']:.1%}{', oversubscribed' if row['oversubscribed'] else ''}){per_repeat}; peak/rank "
            f"{max(row['predicted_peak_bytes']) / 2**20:.2f} vs {max(row['measured_peak_bytes']) / 2**20:.2f} MiB "
            f"({row['memory_error']:.1%})")


def recommendation_check(rows: list[dict]) -> list[dict]:
    """Per model, process count and global batch measured with several layouts (the choice
    ``plan.py model=... trainer.devices=K data.global_batch_size=B̂`` makes): the measured time of the
    layout the planner predicts fastest ÷ the fastest measured one (the planner's target: within 5 %)."""
    groups: dict[tuple[str, int, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r.get("compute", "real"), r["W"] * r["D"], r["W"] * r["B"] * r["N"]), []).append(r)
    out = []
    for (compute, devices, batch), group in sorted(groups.items()):
        if len(group) < 2:
            continue
        pick = min(group, key=lambda r: r["predicted_s"])
        best = min(group, key=lambda r: r["measured_s"])
        out.append({"compute": compute, "devices": devices, "global_batch_size": batch, "layouts": len(group),
                    "recommended": _name(pick), "best_measured": _name(best),
                    "ratio": pick["measured_s"] / best["measured_s"]})
    return out


def time_error_stats(rows: list[dict], prefix: str = "") -> dict[str, float]:
    """``{prefix}layouts``, ``{prefix}time_error_median`` and ``{prefix}time_error_max`` of ``rows``."""
    errors = [r["time_error"] for r in rows]
    return {f"{prefix}layouts": len(rows), f"{prefix}time_error_median": statistics.median(errors),
            f"{prefix}time_error_max": max(errors)}


def errors_by_compute(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per compute kind (real, emulated): :func:`time_error_stats` and the median signed error
    ``(pred − meas) / meas`` (below zero: under-predicted), so a bias of one kind cannot hide behind
    the other's accuracy in the overall median."""
    kinds: dict[str, list[dict]] = {}
    for r in rows:
        kinds.setdefault(r.get("compute", "real"), []).append(r)
    return {kind: {**time_error_stats(group),
                   "signed_error_median": statistics.median((r["predicted_s"] - r["measured_s"]) / r["measured_s"]
                                                            for r in group)}
            for kind, group in sorted(kinds.items())}


def _name(row: dict) -> str:
    return f"{row['layout']} W={row['W']} D={row['D']} B={row['B']}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="plan_accuracy.json")
    p.add_argument("--cache", default=None, help="profile cache directory (default: the planner's)")
    p.add_argument("--steps", type=int, default=5, help="timed iterations per layout and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best round's median counts")
    p.add_argument("--repeats", type=int, default=3,
                   help="independent profile + measurement repeats; per layout the medians count")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=7, help="profiling repetitions")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cached", action="store_true", help="reuse the planner's cached profiles instead of re-profiling")
    p.add_argument("--models", default="real,emulated", help="comma-separated: real (tiny GPT-2), emulated")
    args = p.parse_args(argv)

    from bench import machine  # scripts/bench.py: CPU, cores, memory, versions, commit

    from pipeline_recipes.strategies.harness.spawn import run_world

    began, load_before = time.perf_counter(), list(os.getloadavg())
    meta = {"machine": machine(), "command": " ".join(["python scripts/plan_accuracy.py", *(argv or sys.argv[1:])]),
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average_before": load_before}
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    kinds = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = sorted(set(kinds) - {"real", "emulated"})
    if unknown:
        p.error(f"--models takes real and/or emulated, got {unknown}")
    suites = []
    if args.quick:
        args.repeats = 1
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if "real" in kinds:
        suites.append(("real", MODEL, QUICK if args.quick else LAYOUTS))
    if "emulated" in kinds:
        suites.append(("emulated", dict(EMULATED), QUICK_EMULATED if args.quick else EMULATED_LAYOUTS))
    repeats: list[list[dict[str, Any]]] = []
    profiles: dict[str, list[dict[str, Any]]] = {}
    cores = 0
    for repeat in range(args.repeats):
        rows = []
        for compute, spec, layouts in suites:
            log(f"repeat {repeat + 1}/{args.repeats}, {compute} compute:")
            costs = profile(spec, args, log)
            cores = max(cores, costs.cores)
            profiles.setdefault(compute, []).append({"device": costs.device, "comm": costs.comm.to_json()})
            by_world: dict[int, list[tuple]] = {}
            for layout in layouts:
                by_world.setdefault(layout[1] * layout[2], []).append(layout)
            for world, group in sorted(by_world.items()):
                log(f"measuring {len(group)} {compute}-compute layouts on {world} gloo processes ...")
                results = run_world(world, _measure_worker, spec, group, args.steps, args.warmup, args.rounds,
                                    timeout=900)
                for k, layout in enumerate(group):
                    rows.append(_row(compute, costs, layout, [r[k] for r in results]))
                    log(_describe(rows[-1]))
        repeats.append(rows)
    rows = merge_repeats(repeats)
    log(f"every layout, median over {args.repeats} repeat(s) (each re-profiled and re-measured; the per-repeat "
        "errors in brackets):")
    for row in rows:
        log(_describe(row))
    counted = [r for r in rows if not r["oversubscribed"]]
    apart = [r for r in rows if r["oversubscribed"]]
    m_err = [r["memory_error"] for r in rows]
    picks = recommendation_check(rows)
    summary = {**time_error_stats(counted),
               "memory_error_median": statistics.median(m_err), "memory_error_max": max(m_err),
               "by_compute": errors_by_compute(counted),
               "recommended_vs_best": picks, "cores": cores, "load_average": list(os.getloadavg())}
    summary.update(time_error_stats(rows, "all_"))  # every row, the oversubscribed ones included
    if apart:
        summary.update(time_error_stats(apart, "oversubscribed_"))
    for pick in picks:
        log(f"{pick['compute']} compute, {pick['devices']} processes, B̂ = {pick['global_batch_size']}: the planner's pick {pick['recommended']} measures "
            f"{pick['ratio']:.3f}× the best measured ({pick['best_measured']}) of {pick['layouts']} layouts")
    meta.update(load_average_after=list(os.getloadavg()), wall_s=round(time.perf_counter() - began, 1))
    Path(args.out).write_text(json.dumps({"profile": profiles, "rows": rows, "summary": summary, "meta": meta},
                                         indent=1))
    log(f"time error over {len(counted)} layouts: median {summary['time_error_median']:.1%}, "
        f"max {summary['time_error_max']:.1%}; memory error: median {summary['memory_error_median']:.1%}, "
        f"max {summary['memory_error_max']:.1%} (load average {os.getloadavg()[0]:.1f} on {cores} cores); "
        f"wrote {args.out}")
    for kind, e in summary["by_compute"].items():
        log(f"  {kind} compute, {e['layouts']} layouts: time error median {e['time_error_median']:.1%}, max "
            f"{e['time_error_max']:.1%}; median signed error {e['signed_error_median']:+.1%}")
    log(f"all {summary['all_layouts']} layouts, the oversubscribed ones included: time error median "
        f"{summary['all_time_error_median']:.1%}, max {summary['all_time_error_max']:.1%}")
    if apart:
        log(f"not counted: {len(apart)} real-compute layouts with more ranks than the {cores} cores: time error "
            f"median {summary['oversubscribed_time_error_median']:.1%}, max {summary['oversubscribed_time_error_max']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
