"""Communication micro-benchmarks with two gloo processes (Chimera §3.4: α and β "can be measured
using micro benchmarks").

* p2p: ping-pong of messages of several sizes; one-way time = half the round trip; a least-squares
  line ``t = α + β·L`` gives the p2p constants.
* all-reduce: two-process gradient all-reduces of the same sizes, run by the runtime's
  :class:`pipeline_recipes.strategies.runtime.grad_sync.GradientSynchronizer` (packing into its flat buffer and unpacking
  included), each after writing ``EVICT_BYTES`` elsewhere: in a step the all-reduce follows a
  backward pass that left other data in the caches (a 1–2 MB all-reduce took up to 1.8× longer
  then); with ``r = 2`` Rabenseifner's cost is ``2α + β·L``
  (:func:`pipeline_recipes.planner.costs.allreduce_from_pair`). Its median counts (``ALLREDUCE_QUANTILE``), not the
  lower quartile: a collective needs several round trips in which both ranks must wake up, so its spread is its own, not
  other users' load (on 2 gloo CPU ranks a 4 KiB all-reduce took 0.3–8 ms, median 2 ms), and a step pays the typical
  one (a whole-model 1.3 MB fused all-reduce lasted 2.9–3.6 ms inside Chimera steps; lower
  quartile 1.1 ms, median 1.5–3.2 ms).
* runtime overhead: D = 2 GPipe, DAPPLE and Chimera steps of
  :class:`pipeline_recipes.strategies.harness.emulated.EmulatedPipeline` (holding ``t_f``/``2 t_f`` per action, so the two ranks
  do not compete for cores) at three micro-batch counts, interleaved; what the simulated makespan
  (:func:`pipeline_recipes.strategies.schedules.simulate`) does not explain is the executor's own cost per action, per
  message on the critical path (posting a send, waking the receiver: more than a ping-pong's one-way time) and per step,
  fitted by non-negative least squares (:func:`calibrate_runtime`).
* process memory: resident set of one idle worker (interpreter, torch, gloo), for host-RAM budgets.

A repetition lasts until its slowest rank is done (the max over the two ranks, :func:`combine_ranks`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.distributed as dist

from pipeline_recipes.core.timeouts import COLLECTIVE_TIMEOUT_S
from pipeline_recipes.strategies.harness.emulated import EmulatedPipeline, hold
from pipeline_recipes.strategies.runtime.engine import build_engine
from pipeline_recipes.strategies.runtime.grad_sync import GradientSynchronizer
from pipeline_recipes.strategies.schedules import build_schedule, derive_layout, simulate, specs
from pipeline_recipes.strategies.harness.spawn import run_world

from .costs import AlphaBeta, allreduce_from_pair, quantile, robust_line
from .model_costs import CommCosts

SIZES = (4 * 1024, 16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
CALIBRATION_N = (2, 4, 8)
CALIBRATION_SCHEDULES = tuple(spec.name for spec in specs() if spec.calibrates)  # why these: ScheduleSpec
CALIBRATION_NUMEL = 256  # floats per sample of the calibration activations
CALIBRATION_T_F = 0.002  # seconds held per emulated forward (backward: twice)
SAMPLE_QUANTILE = 0.25  # of the p2p and step repetitions, as the layer profile (other users' load only slows them)
ALLREDUCE_QUANTILE = 0.5  # see the module docstring
EVICT_BYTES = 32 * 2**20  # written before each timed all-reduce: larger than the CPU caches
COMM_VERSION = 6  # part of the cache key: bumped when the measurement changes
MEASURE_S = 14.0  # about how long measure_comm takes on an idle machine (for the progress line)


def _timed_samples(run: Callable[[], Any], reps: int, before: Callable[[], Any] | None = None) -> list[float]:
    """``reps`` timings of ``run`` on this rank (after 2 untimed ones), each started after ``before``
    (untimed) and a barrier."""
    samples = []
    for r in range(reps + 2):
        if before is not None:
            before()
        dist.barrier()
        start = time.perf_counter()
        run()
        if r >= 2:
            samples.append(time.perf_counter() - start)
    return samples


def _comm_worker(rank: int, world: int, sizes: Sequence[int], reps: int, steps: int) -> dict[str, Any]:
    """Every rank's raw samples (seconds); :func:`combine_ranks` reduces them."""
    rss = psutil.Process().memory_info().rss
    evict = torch.zeros(EVICT_BYTES // 4)
    p2p, allreduce = {}, {}
    peer = 1 - rank
    for size in sizes:
        buf = torch.zeros(size // 4)

        def ping_pong(buf: torch.Tensor = buf) -> None:
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)

        p2p[size] = [t / 2 for t in _timed_samples(ping_pong, reps)]
        # as the runtime runs it: gradients packed into a flat buffer, all-reduced, unpacked
        weight = torch.nn.Parameter(torch.zeros(size // 4))
        weight.grad = torch.zeros_like(weight)
        sync = GradientSynchronizer({0: [weight]}, {0: dist.group.WORLD}, [], None,
                                    timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        # in a step the all-reduce follows a backward: its buffers are not in cache
        allreduce[size] = _timed_samples(sync.finish, reps, before=lambda: evict.add_(1.0))
    configs = []
    for name in CALIBRATION_SCHEDULES:
        for n in CALIBRATION_N:  # a layout has one N: an engine per N
            model = EmulatedPipeline(2, t_f=CALIBRATION_T_F, activation_numel=CALIBRATION_NUMEL, param_numel=1)
            engine = build_engine(model, derive_layout(name, 2, 2, n, B=1), torch.device("cpu"))
            configs.append((name, n, engine, model.batch(n)))
    steps_s: dict[str, dict[int, list[float]]] = {name: {} for name in CALIBRATION_SCHEDULES}
    for r in range(steps + 2):  # interleaved: a slow spell of the machine hits every configuration alike
        for name, n, engine, batch in configs:
            dist.barrier()
            start = time.perf_counter()
            engine.train_step(batch)
            if r >= 2:
                steps_s[name].setdefault(n, []).append(time.perf_counter() - start)
    over = []
    for _ in range(20):
        start = time.perf_counter()
        hold(CALIBRATION_T_F)
        over.append(time.perf_counter() - start - CALIBRATION_T_F)
    return {"p2p": p2p, "allreduce": allreduce, "steps": steps_s, "rss": rss, "t_f": CALIBRATION_T_F,
            "sleep_overshoot": statistics.median(over)}


def combine_ranks(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One value per measurement from every rank's samples: a repetition lasts until its slowest
    rank is done (the max over ranks, as a step does), then the quantile over repetitions
    (``SAMPLE_QUANTILE``; ``ALLREDUCE_QUANTILE`` for the all-reduce)."""

    def reduce(per_rank: Sequence[Sequence[float]], q: float) -> float:
        return quantile([max(ts) for ts in zip(*per_rank)], q)

    first = results[0]
    return {"p2p": {int(s): reduce([r["p2p"][s] for r in results], SAMPLE_QUANTILE) for s in first["p2p"]},
            "allreduce": {int(s): reduce([r["allreduce"][s] for r in results], ALLREDUCE_QUANTILE)
                          for s in first["allreduce"]},
            "steps": {name: {int(n): reduce([r["steps"][name][n] for r in results], SAMPLE_QUANTILE) for n in by_n}
                      for name, by_n in first["steps"].items()},
            "rss": max(int(r["rss"]) for r in results), "t_f": first["t_f"],
            "sleep_overshoot": statistics.median(r["sleep_overshoot"] for r in results)}


def fit_comm(result: dict[str, Any], *, measured: bool = True) -> CommCosts:
    """CommCosts from the micro-benchmark results, reduced over the ranks by :func:`combine_ranks`."""
    sizes = sorted(int(s) for s in result["p2p"])
    p2p_fit = robust_line(sizes, [result["p2p"][s] for s in sizes])
    p2p = AlphaBeta(max(p2p_fit.a, 0.0), max(p2p_fit.b, 0.0))
    allreduce = allreduce_from_pair(robust_line(sizes, [result["allreduce"][s] for s in sizes]))
    t_f = float(result.get("t_f", CALIBRATION_T_F))
    action, hop, step = calibrate_runtime(result["steps"], t_f, p2p(CALIBRATION_NUMEL * 4))
    action -= float(result.get("sleep_overshoot", 0.0))  # the hold's own lateness is not the runtime's
    return CommCosts(p2p, allreduce, max(action, 0.0), max(step, 0.0), int(result["rss"]), measured, max(hop, 0.0))


def calibrate_runtime(steps: Mapping[str, Mapping[int, float]], t_f: float, t_comm: float) -> tuple[float, float, float]:
    """(per-action overhead o, per-message latency λ, per-step cost) from emulated D = 2 steps.

    Each measured step ``T = step + sim(t_f, 2 t_f, t_comm) + o·M + λ·H``, where ``M`` and ``H`` are
    the actions and the messages on the simulated critical path (the makespan's derivatives in the
    action time and the message time); non-negative least squares over every schedule and N.
    """
    rows, ys = [], []
    eps = 1e-6
    for name, by_n in steps.items():
        for n, measured in by_n.items():
            schedule = build_schedule(name, 2, int(n))
            base = simulate(schedule, t_f, 2 * t_f, t_comm=t_comm).makespan
            m = (simulate(schedule, t_f + eps, 2 * t_f + eps, t_comm=t_comm).makespan - base) / eps
            h = (simulate(schedule, t_f, 2 * t_f, t_comm=t_comm + eps).makespan - base) / eps
            rows.append([1.0, m, h])
            ys.append(float(measured) - base)
    step, action, hop = nonnegative_lstsq(np.array(rows), np.array(ys))
    return action, hop, step


def nonnegative_lstsq(a: Any, b: Any) -> list[float]:
    """``argmin ‖a·x − b‖`` over ``x ≥ 0`` for a few unknowns: the best of the unconstrained
    least-squares solutions on every subset of the columns (the others held at zero) that come out
    non-negative. A cost that comes out negative is not a cost: the others absorb its share."""
    k = a.shape[1]
    best, best_x = float(np.sum(b**2)), [0.0] * k
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (sol < 0).any():
                continue
            x = [0.0] * k
            for c, v in zip(cols, sol):
                x[c] = float(v)
            residual = float(np.sum((a @ np.array(x) - b) ** 2))
            if residual < best - 1e-18:
                best, best_x = residual, x
    return best_x


def measure_comm(sizes: Sequence[int] = SIZES, reps: int = 30, steps: int = 16) -> CommCosts:
    """Run the micro-benchmarks in two spawned gloo processes (about 12 seconds; the calibration's
    ``steps`` rounds of 9 emulated steps take most of it)."""
    results = run_world(2, _comm_worker, list(sizes), reps, steps, timeout=300)
    return fit_comm(combine_ranks(results))


def load_or_measure_comm(cache_dir: Path, device: str, *, refresh: bool = False,
                         log: Callable[[str], None] | None = None) -> CommCosts:
    """Cached per device description (independent of the model)."""
    path = Path(cache_dir) / f"comm-{hashlib.sha1(f'{device}:v{COMM_VERSION}'.encode()).hexdigest()[:12]}.json"
    if path.exists() and not refresh:
        if log:
            log(f"comm: cached {path}")
        return CommCosts.from_json(json.loads(path.read_text()))
    if log:
        log(f"comm: measuring p2p / all-reduce latency and bandwidth with 2 gloo processes (about {MEASURE_S:.0f} s "
            "on an idle machine) ...")
    start = time.perf_counter()
    comm = measure_comm()
    path.write_text(json.dumps(comm.to_json(), indent=1))
    if log:
        log(f"comm: measured in {time.perf_counter() - start:.0f} s, saved {path}")
    return comm
