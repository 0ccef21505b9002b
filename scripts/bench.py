#!/usr/bin/env python
"""Benchmarks of the pipeline runtime; writes one JSON file and prints tables.

    python scripts/bench.py --out bench.json                       # every part (minutes)
    python scripts/bench.py --out bench.json --parts efficiency    # one part; merged into the file
    python scripts/bench.py --quick --out /tmp/quick.json          # tiny sizes, < 1 min (smoke test)

Parts (``--parts``, comma-separated; default all):

* ``efficiency``: every schedule of the registry on emulated-compute stages
  (:mod:`pipeline_recipes.strategies.harness.emulated`: forward ``t_f``, backward ``2 t_f`` of sleep, real p2p tensors and
  all-reduces) at D ∈ {2, 4, 8} (those with several stages per worker or split backwards at D ∈ {2, 4}),
  N ∈ {D, 2D} where its rules allow, and PipeDream at N = 1: median measured step time ÷
  simulated makespan (:func:`pipeline_recipes.strategies.schedules.simulate`; the asynchronous ones: their steady
  no-flush step, each rank timing its own steps in a barrier-free stream, the slowest rank counted), and
  Chimera ÷ DAPPLE measured vs in theory.
* ``vs_torch``: the same GPT-2, split, micro-batches and D = 2 CPU ranks (one thread each) under
  ours (gpipe, dapple, chimera) and ``torch.distributed.pipelining`` (ScheduleGPipe, Schedule1F1B),
  interleaved in one invocation; ``throughput_ratio`` = their step time ÷ ours (> 1: ours faster).
* ``overhead``: D = 1 engine step vs a plain single-process step of the same model and batch.
* ``grad_sync``: end vs eager vs eager_opt gradient all-reduce (Chimera §3.2) on emulated Chimera.
* ``recompute``: peak stored activation bytes and step time of none / except_last / always on GPT-2.
* ``e2e``: ``train.py`` itself (Lightning strategy, data, metrics, logging) against ScheduleGPipe and
  Schedule1F1B in the job's own processes, and ``train.py strategy=single`` against a plain Lightning
  loop (``scripts/bench_e2e.py``).
* ``gpu`` (not in the default set; on its own): on one GPU, the D = 1 stage path against the plain
  transformers loop and a hand-written model of the same shape (``scripts/bench_gpu.py``), written to
  its own file (``--out``, default ``benchmarks/bench_gpu.json``); ``--device cpu --tiny`` is its smoke run.

JSON: ``{"schedule_efficiency": [...], "chimera_vs_dapple": [...], "vs_torch": [...],
"overhead_d1": float, "grad_sync": [...], "recompute": [...], "e2e_vs_torch": [...],
"e2e_overhead_d1": {...}, "details": {...}, "meta": {...}}`` (ratios are plain numbers). ``details``
holds what the tables print beyond the contract's columns (the efficiency rows' simulated action
times, medians, every round's times); ``meta`` the machine, its load average before and after each
part, each part's wall time and the command. ``python scripts/bench_tables.py FILE`` prints
BENCHMARKS.md's tables from the file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline_recipes.strategies.schedules import specs
from pipeline_recipes.strategies.harness.spawn import run_world
from torch_stages import same_schedule, stages_held

ROOT = Path(__file__).resolve().parents[1]

PARTS = ("efficiency", "vs_torch", "overhead", "grad_sync", "recompute", "e2e")
KEYS = ("schedule_efficiency", "chimera_vs_dapple", "vs_torch", "bidirectional", "overhead_d1", "grad_sync",
        "recompute", "e2e_vs_torch", "e2e_overhead_d1", "details", "meta")
EFFICIENCY_ROUNDS = 10  # measured rounds per efficiency row (fewer than before: the whole run fits ~20 min here)


# -- helpers (run inside the ranks) --------------------------------------------------------------


def _timed_steps(step: Callable[[], Any], steps: int, warmup: int) -> list[float]:
    """Wall time of ``steps`` calls after ``warmup`` untimed ones: every rank starts after a barrier
    and a step lasts until the slowest rank returns (the largest time over the ranks, reduced after
    the clock stopped, so no closing collective's latency is counted)."""
    import torch.distributed as dist

    times = []
    for i in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(elapsed, dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(elapsed))
    return times


class _Step:
    """One training step of ``engine`` on ``batch`` (callable; keeps the engine reachable)."""

    def __init__(self, engine: Any, batch: Any) -> None:
        self.engine, self.batch = engine, batch

    def __call__(self) -> Any:
        return self.engine.train_step(self.batch)


def _rounds(runners: dict[str, Callable[[], Any]], rounds: int, warmup: int,
            on_step: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Step times of every runner, ``rounds`` times, one step each per round in a rotating order.

    Comparing runners within a round (paired ratios) cancels most of the drift of a shared
    machine's background load.
    """
    names = list(runners)
    for name in names:
        _timed_steps(runners[name], 0, warmup)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name] += _timed_steps(runners[name], 1, 0)
            if on_step is not None:
                on_step(name)
    return times


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of numerator / denominator measured in the same round."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def _gpt2(size: dict[str, int]) -> Any:
    from pipeline_recipes.models import build_model

    torch.manual_seed(0)
    return build_model("gpt2-tiny", n_layer=size["layers"], n_embd=size["hidden"], n_head=size["heads"],
                       vocab_size=size["vocab"], n_positions=size["seq"], seq_len=size["seq"],
                       tie_word_embeddings=False, loss_chunk_tokens=None)  # torch's loss_fn takes logits


def _gpt2_batch(size: dict[str, int], samples: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, size["vocab"], (samples, size["seq"]), generator=g)}


def _by_rank(value: float) -> list[float]:
    """``value`` of every rank, by rank."""
    import torch.distributed as dist

    t = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return t.tolist()


# -- part workers (module level: the spawned ranks import them) ---------------------------------


ASYNC_STREAM, ASYNC_SETTLE = 6, 2  # consecutive asynchronous steps per round, the first ones not counted


class _Stream(_Step):
    """``ASYNC_STREAM`` consecutive steps with no barrier between them (an asynchronous schedule's
    stages are skewed by design: a barrier before each step would impose the line-up it avoids).
    Each rank times its own steps; the first ``ASYNC_SETTLE`` of a round re-establish the skew the
    round's opening barrier removed and are not counted."""

    def __init__(self, engine: Any, batch: Any) -> None:
        super().__init__(engine, batch)
        self.times: list[float] = []

    def __call__(self) -> Any:
        for k in range(ASYNC_STREAM):
            start = time.perf_counter()
            out = self.engine.train_step(self.batch)
            if k >= ASYNC_SETTLE:
                self.times.append(time.perf_counter() - start)
        return out

    def steady_step_s(self) -> float:
        """The slowest rank's median step time (a collective)."""
        import torch.distributed as dist

        value = torch.tensor([statistics.median(self.times)], dtype=torch.float64)
        dist.all_reduce(value, dist.ReduceOp.MAX)
        return float(value)


MODERN_DEPTHS = (2, 4)  # schedules with several stages per worker or split backwards run at these D only
# (8 ranks on 2 cores would double the part's time)


def efficiency_schedules(N: int) -> tuple[str, ...]:
    """The registry's schedules the efficiency part runs at N micro-batches per update: at N = 1 those
    that fix one per update (PipeDream), otherwise every schedule that leaves N free."""
    return tuple(s.name for s in specs() if (s.fixed_micro_batches == 1 if N == 1 else s.fixed_micro_batches is None))


def _efficiency_worker(rank: int, world: int, Ns: list[int], t_f: float, steps: int, warmup: int,
                       act: int, params: int) -> list[dict]:
    from pipeline_recipes.strategies.harness.emulated import EmulatedPipeline
    from pipeline_recipes.strategies.runtime.engine import PipelineConfig, build_engine
    from pipeline_recipes.strategies.schedules import ScheduleError, derive_layout

    rows = []
    for N in [*Ns, 1]:  # N = 1: PipeDream (one micro-batch per update)
        runners, simulated, stage_t_f = {}, {}, {}
        for name in efficiency_schedules(N):
            try:
                config = PipelineConfig(derive_layout(name, world, world, N, B=1))
                split = any(a.kind in "IW" for row in config.build(N).workers for a in row)
            except ScheduleError:  # N outside the schedule's rules (DualPipeV: N >= 2D)
                continue
            if (split or config.num_stages > world) and world not in MODERN_DEPTHS:
                continue
            chunks = config.num_stages // world  # a worker's compute is t_f + t_b per micro-batch whatever its chunks
            stage_t_f[name] = t_f / chunks
            model = EmulatedPipeline(config.num_stages, t_f=stage_t_f[name], activation_numel=act, param_numel=params,
                                     split_backward=split)
            engine = build_engine(model, config.layout, torch.device("cpu"))
            simulated[name] = _step_makespan(engine, N, stage_t_f[name], 2 * stage_t_f[name])
            runners[name] = (_Stream if engine.config.is_async else _Step)(engine, model.batch(N))
        durations: dict[str, dict[str, list[float]]] = {name: {k: [] for k in "FBIW"} for name in runners}
        engines = {name: getattr(runner, "engine", None) for name, runner in runners.items()}
        times = _rounds(runners, steps, warmup, on_step=lambda name: _collect(durations[name], engines[name]))
        for name, runner in runners.items():
            measured = runner.steady_step_s() if isinstance(runner, _Stream) else statistics.median(times[name])
            actions = _measured_action_times(durations[name])
            rows.append({"schedule": name, "D": world, "N": N, "measured_s": measured,
                         "simulated_s": simulated[name], "times_s": times[name],
                         "simulated_actions_s": _step_makespan(engines[name], N, *actions),
                         "hop_s": None if engines[name].config.is_async
                         else hop_seconds(engines[name].schedule_for(N), measured, *actions)})
    return rows


def hop_seconds(schedule: Any, measured_s: float, t_f: float, t_b: float, t_w: float | None = None) -> float:
    """The time per message between workers that makes the simulator's makespan of ``schedule`` (at the
    action times the ranks measured) equal the measured step: ``simulate(..., t_comm=c)`` solved for ``c``
    by bisection (0 if the step ran no slower than the simulation without messages). It is what the
    transport adds per hop of the step's critical path, so schedules with more hops between workers
    (several chunks per worker) read a higher ratio at the same ``c``."""
    from pipeline_recipes.strategies.schedules import simulate

    def makespan(c: float) -> float:
        return simulate(schedule, t_f, t_b, t_w=t_w, t_comm=c).makespan

    low, high = 0.0, max(measured_s, 1e-6)
    if makespan(low) >= measured_s:
        return 0.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if makespan(mid) < measured_s else (low, mid)
    return (low + high) / 2


def _step_makespan(engine: Any, N: int, t_f: float, t_b: float, t_w: float | None = None) -> float:
    """Simulated time of one step: the schedule's makespan, or an asynchronous schedule's steady step."""
    from pipeline_recipes.strategies.schedules import simulate
    from pipeline_recipes.strategies.schedules.asynchronous import steady_step_makespan

    config = engine.config
    if config.is_async:
        return steady_step_makespan(config.schedule, config.stages, N, t_f, t_b)
    return simulate(engine.schedule_for(N), t_f, t_b, t_w=t_w).makespan


def _collect(into: dict[str, list[float]], engine: Any) -> None:
    """This rank's per-micro-batch durations of each kind of action (F, B, I, W) of the step just run."""
    for action, start, end in engine.last_record.timeline:
        into[action.kind].append((end - start) / (len(action.mbs) if action.kind == "F" else 1.0))


def _measured_action_times(durations: dict[str, list[float]]) -> tuple[float, float, float | None]:
    """``(t_f, t_b, t_w)``: the mean durations every rank measured per kind of action (a split backward:
    t_b = mean I + mean W, t_w = mean W), for the simulator: measured / its makespan at these times = what
    scheduling and communication add beyond the actions' own times."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, durations)

    def mean(kind: str) -> float | None:
        values = [d for g in gathered for d in g[kind]]
        return statistics.mean(values) if values else None

    t_f, t_b, t_i, t_w = mean("F"), mean("B"), mean("I"), mean("W")
    if t_b is None:  # every backward split
        t_b = (t_i or 0.0) + (t_w or 0.0)
    return t_f, t_b, t_w if t_w is not None and t_w <= t_b else None


def _grad_sync_worker(rank: int, world: int, cases: list[dict], t_f: float, steps: int, warmup: int,
                      act: int, params: int) -> list[dict]:
    from pipeline_recipes.strategies.harness.emulated import EmulatedPipeline
    from pipeline_recipes.strategies.runtime.engine import build_engine
    from pipeline_recipes.strategies.schedules import derive_layout

    rows = []
    for case in cases:
        D, N = case["D"], case["N"]
        runners = {}
        for mode in ("end", "eager", "eager_opt"):
            model = EmulatedPipeline(D, t_f=t_f, activation_numel=act, param_numel=params)
            layout = derive_layout(case["schedule"], world, D, world // D * N, B=1, grad_sync=mode)
            engine = build_engine(model, layout, torch.device("cpu"))
            batch = model.batch(N)
            runners[mode] = (lambda e, b: lambda: e.train_step(b))(engine, batch)
        times = _rounds(runners, steps, warmup)
        for mode in runners:
            rows.append({**case, "W": world // D, "param_numel": params, "mode": mode,
                         "measured_s": statistics.median(times[mode]),
                         "ratio_vs_end": paired_ratio(times[mode], times["end"])})
    return rows


def _vs_torch_worker(rank: int, world: int, size: dict[str, int], samples: int, mbs: int, steps: int,
                     warmup: int, ours: tuple[str, ...], theirs: tuple[str, ...]) -> list[dict]:
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch import nn

    from pipeline_recipes.models.causal_lm import causal_lm_loss
    from pipeline_recipes.strategies.runtime.engine import build_engine, even_partition
    from pipeline_recipes.strategies.schedules import derive_layout

    batch = _gpt2_batch(size, samples)
    runners: dict[str, Callable[[], Any]] = {}
    for name in ours:
        model = _gpt2(size)
        engine = build_engine(model, derive_layout(name, world, world, samples, B=samples // mbs), torch.device("cpu"))
        runners[f"ours:{name}"] = (lambda e: lambda: e.train_step(batch))(engine)
    for label in theirs:
        model = _gpt2(size)
        layers = model.pipeline_layers()
        held = stages_held(label, rank, world)  # this rank's stage indices, the same placement as ours
        S = 2 * world if len(held) == 2 else world
        part = even_partition(len(layers), S)
        modules = {s: nn.Sequential(*[layers[i] for i in part[s]]) for s in held}
        stages = [pipelining.PipelineStage(modules[s], s, S, torch.device("cpu")) for s in held]
        cls = getattr(pipelining, label)
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)  # takes a list of stages
        schedule = cls(stages if multi else stages[0], mbs, loss_fn=causal_lm_loss)
        params = [p for m in modules.values() for p in m.parameters()]
        first, last = 0 in held, S - 1 in held

        def step(schedule=schedule, params=params, first=first, last=last) -> None:
            for p in params:
                p.grad = None
            args = (batch["input_ids"],) if first else ()
            schedule.step(*args, target=batch["input_ids"] if last else None, return_outputs=False)

        runners[f"theirs:{label}"] = step
    times = _rounds(runners, steps, warmup)
    dist.barrier()
    return [{"system": k, "median_s": statistics.median(v), "times_s": v} for k, v in times.items()]


def _overhead_worker(rank: int, world: int, size: dict[str, int], samples: int, steps: int, warmup: int) -> dict:
    from pipeline_recipes.core.pipeline_model import sequential_loss
    from pipeline_recipes.strategies.runtime.engine import build_engine
    from pipeline_recipes.strategies.schedules import derive_layout

    batch = _gpt2_batch(size, samples)
    plain_model = _gpt2(size)
    engine = build_engine(_gpt2(size), derive_layout("gpipe", 1, 1, samples, B=samples), torch.device("cpu"))

    def plain() -> None:
        for p in plain_model.parameters():
            p.grad = None
        sequential_loss(plain_model, batch).backward()

    def ours() -> None:
        engine.train_step(batch)

    times = _rounds({"plain": plain, "engine": ours}, steps, warmup)
    return {"plain_s": statistics.median(times["plain"]), "engine_s": statistics.median(times["engine"]),
            "ratio": paired_ratio(times["engine"], times["plain"])}


def _recompute_worker(rank: int, world: int, size: dict[str, int], schedule: str, samples: int, mbs: int,
                      steps: int, warmup: int) -> list[dict]:
    from pipeline_recipes.strategies.runtime.engine import build_engine
    from pipeline_recipes.strategies.schedules import derive_layout

    batch = _gpt2_batch(size, samples)
    engines = {}
    for mode in ("none", "except_last", "always"):
        layout = derive_layout(schedule, world, world, samples, B=samples // mbs, recompute=mode)
        engines[mode] = build_engine(_gpt2(size), layout, torch.device("cpu"))
    times = _rounds({m: (lambda e: lambda: e.train_step(batch))(e) for m, e in engines.items()}, steps, warmup)
    rows = []
    for mode, engine in engines.items():
        peaks = [int(b) for b in _by_rank(engine.last_record.peak_stored_bytes)]
        rows.append({"mode": mode, "schedule": schedule, "D": world, "N": mbs, "peak_stored_bytes_by_rank": peaks,
                     "peak_stored_bytes_max_rank": max(peaks), "measured_s": statistics.median(times[mode]),
                     "time_ratio": paired_ratio(times[mode], times["none"])})
    return rows


# -- parts (run in the parent) -------------------------------------------------------------------


def part_efficiency(quick: bool) -> dict[str, list[dict]]:
    t_f, steps, warmup = (0.005, 3, 1) if quick else (0.02, EFFICIENCY_ROUNDS, 2)
    depths = (2,) if quick else (2, 4, 8)
    rows = []
    for D in depths:
        rows += run_world(D, _efficiency_worker, [D] if quick else [D, 2 * D], t_f, steps, warmup, 16384, 65536)[0]
    times = {(r["schedule"], r["D"], r["N"]): r.pop("times_s") for r in rows}  # per round: details.efficiency_times
    for row in rows:
        row["ratio"] = row["measured_s"] / row["simulated_s"]
        row["ratio_actions"] = row["measured_s"] / row["simulated_actions_s"]
        row["hop_ms"] = None if row["hop_s"] is None else round(row["hop_s"] * 1e3, 2)
    by = {(r["schedule"], r["D"], r["N"]): r for r in rows}
    versus = []
    for (name, D, N), chimera in by.items():
        if name == "chimera" and ("dapple", D, N) in by:
            versus.append({"D": D, "N": N,
                           "measured_ratio": paired_ratio(times[(name, D, N)], times[("dapple", D, N)]),
                           "theory_ratio": chimera["simulated_s"] / by[("dapple", D, N)]["simulated_s"]})
    return {"schedule_efficiency": rows, "chimera_vs_dapple": versus, "_efficiency_rounds": steps,
            "_efficiency_times": [{"schedule": n, "D": D, "N": N, "times_s": t} for (n, D, N), t in times.items()]}


GPT2_BENCH = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 4096, "seq": 128}
GPT2_QUICK = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 1000, "seq": 32}


def part_vs_torch(quick: bool) -> dict[str, list[dict]]:
    size, samples, mbs, steps, warmup = (GPT2_QUICK, 4, 2, 2, 1) if quick else (GPT2_BENCH, 16, 4, 11, 2)
    torch_class = same_schedule()
    # each schedule against torch's class of the same schedule, then Chimera (+ zero bubble) against the
    # classes of the schedules it is measured with
    pairs = [*torch_class.items(), ("chimera", torch_class["dapple"]), ("chimera", torch_class["gpipe"]),
             ("chimera_zb", torch_class["zbv"]), ("chimera_zb", torch_class["dualpipev"])]
    if quick:
        pairs = [(ours, theirs) for ours, theirs in pairs if ours in ("dapple", "zbv")]
    ours = tuple(dict.fromkeys(p[0] for p in pairs))
    theirs = tuple(dict.fromkeys(p[1] for p in pairs))
    rows = run_world(2, _vs_torch_worker, size, samples, mbs, steps, warmup, ours, theirs)[0]
    t = {r["system"]: r["times_s"] for r in rows}  # kept in details.vs_torch_times: the ratios can be re-derived
    out = [{"ours": o, "theirs": th, "throughput_ratio": paired_ratio(t[f"theirs:{th}"], t[f"ours:{o}"])}
           for o, th in pairs]
    # Chimera + zero bubble against the other bidirectional / V-shaped schedules, measured in the same rounds
    versus = [{"schedule": "chimera_zb", "versus": other,
               "throughput_ratio": paired_ratio(t[f"ours:{other}"], t["ours:chimera_zb"])}
              for other in ("chimera", "zbv", "dualpipev") if f"ours:{other}" in t and "ours:chimera_zb" in t]
    return {"vs_torch": out, "bidirectional": versus, "_vs_torch_times": rows}


def part_overhead(quick: bool) -> dict[str, Any]:
    size, samples, steps, warmup = (GPT2_QUICK, 2, 3, 1) if quick else (GPT2_BENCH, 8, 15, 3)
    r = run_world(1, _overhead_worker, size, samples, steps, warmup)[0]
    return {"overhead_d1": r["ratio"], "_overhead_times": r}


def part_grad_sync(quick: bool) -> dict[str, list[dict]]:
    if quick:
        return {"grad_sync": run_world(2, _grad_sync_worker, [{"schedule": "chimera", "D": 2, "N": 2}],
                                       0.005, 2, 1, 4096, 65536)[0]}
    cases = [{"schedule": "chimera", "D": 4, "N": 4}, {"schedule": "chimera", "D": 2, "N": 4}]
    return {"grad_sync": run_world(4, _grad_sync_worker, cases, 0.02, 7, 2, 16384, 4 * 1024 * 1024)[0]}


def part_recompute(quick: bool) -> dict[str, list[dict]]:
    size, samples, mbs, steps, warmup = (GPT2_QUICK, 4, 2, 2, 1) if quick else (GPT2_BENCH, 16, 4, 7, 2)
    rows = run_world(2, _recompute_worker, size, "dapple", samples, mbs, steps, warmup)[0]
    base = next(r for r in rows if r["mode"] == "none")
    for r in rows:
        r["memory_ratio"] = r["peak_stored_bytes_max_rank"] / base["peak_stored_bytes_max_rank"]
    return {"recompute": rows}


def e2e_schedules() -> tuple[str, ...]:
    """Every synchronous schedule of the registry: ``train.py strategy=<name>`` for each."""
    return tuple(s.name for s in specs() if not s.asynchronous)


def part_e2e(quick: bool) -> dict[str, Any]:
    from bench_e2e import part_e2e as run_e2e

    if quick:
        return run_e2e(quick, ours=("dapple",), theirs=tuple(same_schedule()[name] for name in ("gpipe", "dapple")))
    return run_e2e(quick, ours=e2e_schedules(), without_logger=("dapple",))


RUNNERS = {"efficiency": part_efficiency, "vs_torch": part_vs_torch, "overhead": part_overhead,
           "grad_sync": part_grad_sync, "recompute": part_recompute, "e2e": part_e2e}


# -- output ---------------------------------------------------------------------------------------


def _table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


EFFICIENCY_KEYS = ("schedule", "D", "N", "measured_s", "simulated_s", "ratio")


def _contract(data: dict[str, Any]) -> dict[str, Any]:
    """The JSON file's exact keys; the efficiency rows' extra columns (``simulated_actions_s``,
    ``ratio_actions``, ``hop_s``, ``hop_ms``) go to ``details.schedule_efficiency``."""
    out = {k: data[k] for k in KEYS}
    out["schedule_efficiency"] = [{k: row[k] for k in EFFICIENCY_KEYS} for row in data["schedule_efficiency"]]
    if any(set(row) - set(EFFICIENCY_KEYS) for row in data["schedule_efficiency"]):
        out["details"] = {**out["details"], "schedule_efficiency": data["schedule_efficiency"]}
    return out


def machine() -> dict[str, Any]:
    """What ran the benchmark: CPU model, cores, memory, versions, commit."""
    import subprocess

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = None
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "python": platform.python_version(),
            "torch": torch.__version__, "git_commit": commit, "git_dirty": dirty}


def report(data: dict[str, Any]) -> str:
    out = []
    if data.get("schedule_efficiency"):
        out += ["schedule efficiency (emulated compute; ratio = measured / simulated)",
                _table(data["schedule_efficiency"], ["schedule", "D", "N", "measured_s", "simulated_s", "ratio", "simulated_actions_s", "ratio_actions", "hop_ms"]), ""]
    if data.get("chimera_vs_dapple"):
        out += ["chimera / dapple step time",
                _table(data["chimera_vs_dapple"], ["D", "N", "measured_ratio", "theory_ratio"]), ""]
    if data.get("vs_torch"):
        out += ["vs torch.distributed.pipelining (throughput_ratio > 1: ours faster)",
                _table(data["vs_torch"], ["ours", "theirs", "throughput_ratio"]), ""]
    if data.get("bidirectional"):
        out += ["Chimera + zero bubble vs the other bidirectional schedules (throughput_ratio > 1: chimera_zb faster)",
                _table(data["bidirectional"], ["schedule", "versus", "throughput_ratio"]), ""]
    if data.get("overhead_d1") is not None:
        out += [f"D=1 engine step / plain step: {data['overhead_d1']:.4f}", ""]
    if data.get("grad_sync"):
        out += ["gradient sync modes (emulated Chimera)",
                _table(data["grad_sync"], ["schedule", "D", "W", "N", "mode", "measured_s", "ratio_vs_end"]), ""]
    if data.get("recompute"):
        out += ["activation recomputation (GPT-2, DAPPLE)",
                _table(data["recompute"],
                       ["mode", "peak_stored_bytes_by_rank", "memory_ratio", "measured_s", "time_ratio"]), ""]
    if data.get("e2e_vs_torch"):
        out += ["train.py end to end vs torch.distributed.pipelining (throughput_ratio > 1: train.py faster)",
                _table(data["e2e_vs_torch"], ["ours", "theirs", "ours_median_s", "theirs_median_s", "throughput_ratio"]),
                ""]
    if data.get("e2e_overhead_d1"):
        e = data["e2e_overhead_d1"]
        out += [f"train.py strategy=single / plain Lightning loop: {e['ratio']:.4f} "
                f"({e['train_py_median_s']:.4f} s vs {e['plain_lightning_median_s']:.4f} s)", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file; parts not run keep their values from an existing file "
                                      "(--parts gpu: its own file, default benchmarks/bench_gpu.json)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}, "
                                                                 "or gpu on its own")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (smoke test)")
    parser.add_argument("--device", default="cuda", help="gpu part only: cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="gpu part only: gpt2-tiny and llama-tiny (smoke test)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS) - {"gpu"})
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}, or gpu on its own")
    if "gpu" in parts:
        return _gpu_part(parser, args, parts, argv)
    if args.out is None:
        parser.error("--out is required: the JSON file to write, e.g. --out bench.json")
    if args.tiny or args.device != "cuda":
        parser.error("--tiny and --device belong to --parts gpu")
    out = Path(args.out)
    data: dict[str, Any] = {"schedule_efficiency": [], "chimera_vs_dapple": [], "vs_torch": [], "bidirectional": [],
                            "overhead_d1": None,
                            "grad_sync": [], "recompute": [], "e2e_vs_torch": [], "e2e_overhead_d1": None,
                            "details": {}, "meta": {"parts": {}}}
    if out.exists() and not args.quick:
        data.update({k: v for k, v in json.loads(out.read_text()).items() if k in KEYS})
        data["schedule_efficiency"] = data["details"].get("schedule_efficiency", data["schedule_efficiency"])
    began = time.perf_counter()
    data["meta"] = {**data["meta"], "machine": machine(), "command": " ".join(["python scripts/bench.py", *(argv or sys.argv[1:])]),
                    "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    data["meta"].setdefault("parts", {})
    for part in parts:
        start, load = time.perf_counter(), os.getloadavg()
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        result = RUNNERS[part](args.quick)
        data["details"] = {**data["details"], **{k[1:]: v for k, v in result.items() if k.startswith("_")}}
        data.update({k: v for k, v in result.items() if not k.startswith("_")})
        wall = time.perf_counter() - start
        data["meta"]["parts"][part] = {"wall_s": round(wall, 1), "load_average_before": list(load),
                                       "load_average_after": list(os.getloadavg()), "started_utc": started,
                                       "git_commit": data["meta"]["machine"]["git_commit"]}
        print(f"[{part}: {wall:.1f}s, load average {load[0]:.1f} -> {os.getloadavg()[0]:.1f}]", file=sys.stderr)
    data["meta"]["wall_s"] = round(time.perf_counter() - began, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_contract(data), indent=2) + "\n")
    print(report(data))
    return 0


def _gpu_part(parser: argparse.ArgumentParser, args: argparse.Namespace, parts: list[str],
              argv: list[str] | None) -> int:
    """``--parts gpu``: the GPU benchmark (``scripts/bench_gpu.py``) into its own JSON file."""
    from bench_gpu import DEFAULT_OUT, run

    if parts != ["gpu"]:
        parser.error(f"--parts {args.parts}: run gpu on its own (it writes its own file, by default "
                     f"{DEFAULT_OUT.relative_to(ROOT)}), e.g. --parts gpu")
    if args.quick:
        parser.error("--quick does not apply to --parts gpu; its smoke run is --device cpu --tiny --out FILE")
    if args.out is None and (args.tiny or args.device != "cuda"):
        parser.error(f"--parts gpu --tiny / --device {args.device} is a smoke run: give --out FILE (the default, "
                     f"{DEFAULT_OUT.relative_to(ROOT)}, holds the GPU record)")
    if args.device.split(":")[0] not in ("cuda", "cpu"):
        parser.error(f"--device {args.device}: choose cuda (a GPU) or cpu (the smoke run)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"bench.py --parts gpu: no CUDA GPU (torch {torch.__version__}, torch.cuda.is_available() is False); "
              "run it on a GPU machine (bash scripts/gpu_check.sh OUT_DIR), or --device cpu --tiny --out FILE for the "
              "smoke run", file=sys.stderr)
        return 2
    command = " ".join(["python scripts/bench.py", *(argv if argv is not None else sys.argv[1:])])
    try:
        host = machine()
    except OSError as err:  # a copy of the tree without git, say: the record goes on without the commit
        host = {"machine_error": str(err)}
    run(Path(args.out) if args.out else DEFAULT_OUT, device=args.device, tiny=args.tiny, command=command, machine=host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
