"""Discrete-event simulation of a schedule (Chimera §2, §3.4): start/end of every action,
makespan, bubble ratio, per-worker peak in-flight activations and per-stage micro-batches held
(the CUDA graph copies a stage needs).

Each worker runs its actions in order, each as soon as its worker is free and its
dependencies (:mod:`.graph`) are done (plus ``t_comm`` when the producer is another worker).
Costs are per micro-batch: a doubled forward costs ``2·t_f``, a halved backward ``t_b / 2``; a
split backward (Zero Bubble Pipeline Parallelism §2) costs ``t_b - t_w`` for its input-gradient
pass ``I`` and ``t_w`` for its weight-gradient pass ``W`` (by default ``t_w = t_b / 2``, the
paper's t_F = t_B = t_W at t_b = 2 t_f). ``t_f``, ``t_b`` and ``t_w`` may be one number or one
number per stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline_recipes.strategies.schedules.actions import Action, Schedule
from pipeline_recipes.strategies.schedules.graph import dependencies, index_actions
from pipeline_recipes.strategies.schedules.grid import format_grid

Cost = float | Sequence[float]


class DeadlockError(ValueError):
    """The schedule cannot run to completion: every remaining worker waits on another."""


@dataclass(frozen=True)
class TimedAction:
    action: Action
    worker: int
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` measures. ``bubble_ratio`` = idle time / (workers × makespan)."""

    timeline: tuple[tuple[TimedAction, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    bubble_ratio: float
    peak_activations: tuple[float, ...]

    def longest_wait(self, worker: int) -> tuple[int, float]:
        """``(i, wait)``: ``worker``'s longest idle time before one of its actions (its ``i``-th; the
        first of equal waits) and that time; ``(0, 0.0)`` for a worker without actions."""
        row, free, best = self.timeline[worker], 0.0, (0, 0.0)
        for i, timed in enumerate(row):
            if timed.start - free > best[1]:
                best = (i, timed.start - free)
            free = timed.end
        return best


def _per_stage(cost: Cost, stages: int, name: str) -> list[float]:
    values = [float(cost)] * stages if isinstance(cost, (int, float)) else [float(c) for c in cost]
    if len(values) != stages or any(v < 0 for v in values):
        raise ValueError(f"{name} must be one non-negative number or {stages} of them, got {cost!r}")
    return values


def action_cost(action: Action, t_f: Sequence[float], t_b: Sequence[float],
                t_w: Sequence[float] | None = None) -> float:
    """Time of ``action``: ``t_w`` (default half of ``t_b``) is the weight-gradient share of a backward."""
    if action.kind == "F":
        return t_f[action.stage] * len(action.mbs)
    part = 0.5 if action.half is not None else 1.0
    if action.kind == "B":
        return t_b[action.stage] * part
    weight = t_b[action.stage] / 2 if t_w is None else t_w[action.stage]
    return (weight if action.kind == "W" else t_b[action.stage] - weight) * part


def peak_activations(schedule: Schedule) -> tuple[float, ...]:
    """Per worker, the most micro-batches whose forward is done and backward is not.

    It depends on each worker's order only, not on timing.
    """
    peaks = []
    for acts in schedule.workers:
        live = peak = 0.0
        for a in acts:
            live += a.activation_delta
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def slots_needed(schedule: Schedule, worker: int) -> dict[int, int]:
    """Stage → the most micro-batches whose forward on ``worker`` ran and whose last backward there has not:
    the graph copies the stage needs. A micro-batch holds its slot from its forward (a doubled forward takes
    two) until the backward that completes its weight gradient (``B``, or ``W`` after ``I``)."""
    live: dict[int, set[tuple[int, int]]] = {}
    most: dict[int, int] = {}
    for action in schedule.workers[worker]:
        held = live.setdefault(action.stage, set())
        if action.kind == "F":
            held.update((action.pipe, mb) for mb in action.mbs)
        elif action.completes_weight_gradient and action.half in (None, 1):
            held.discard((action.pipe, action.mb))
        most[action.stage] = max(most.get(action.stage, 0), len(held))
    return most


def simulate(schedule: Schedule, t_f: Cost = 1.0, t_b: Cost = 2.0, *, t_w: Cost | None = None,
             t_comm: float = 0.0) -> Simulation:
    """Run ``schedule`` as soon as possible with the given per-micro-batch costs; ``t_comm`` is
    added when the producer is another worker (stages on one worker pass messages locally)."""
    stages = schedule.stages
    tf, tb = _per_stage(t_f, stages, "t_f"), _per_stage(t_b, stages, "t_b")
    tw = None if t_w is None else _per_stage(t_w, stages, "t_w")
    if tw is not None and any(w > b for w, b in zip(tw, tb)):
        raise ValueError(f"t_w (the weight-gradient share of a backward) must not exceed t_b, got {t_w!r} > {t_b!r}")
    known = index_actions(a for acts in schedule.workers for a in acts)
    worker_of = {a: w for w, acts in enumerate(schedule.workers) for a in acts}
    end: dict[Action, float] = {}
    timeline: list[list[TimedAction]] = [[] for _ in schedule.workers]
    free = [0.0] * schedule.num_workers
    position = [0] * schedule.num_workers
    remaining = sum(len(acts) for acts in schedule.workers)
    while remaining:
        progressed = False
        for w, acts in enumerate(schedule.workers):
            while position[w] < len(acts):
                a = acts[position[w]]
                deps = dependencies(a, known, stages)
                if any(d is None or d not in end for d in deps):
                    break
                ready = max(
                    [end[d] + (t_comm if worker_of[d] != w else 0.0) for d in deps] + [free[w]]  # type: ignore[index]
                )
                finish = ready + action_cost(a, tf, tb, tw)
                timeline[w].append(TimedAction(a, w, ready, finish))
                end[a] = free[w] = finish
                position[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [(w, position[w]) for w, acts in enumerate(schedule.workers) if position[w] < len(acts)]
            raise DeadlockError(
                f"schedule '{schedule.name}' deadlocks: every marked action waits for one that cannot run "
                f"first (missing, or later in its worker's order)\n{format_grid(schedule, stuck)}"
            )
    makespan = max(free, default=0.0)
    busy = tuple(sum(t.end - t.start for t in row) for row in timeline)
    idle = sum(makespan - b for b in busy)
    ratio = idle / (makespan * schedule.num_workers) if makespan else 0.0
    return Simulation(tuple(map(tuple, timeline)), makespan, busy, ratio, peak_activations(schedule))
