"""Structural check of a schedule before it is simulated, drawn or executed (Chimera §3.1).

:func:`validate` raises :class:`ValueError` with a worker × step grid marking the fault when
an action runs on the wrong worker or is out of range, when a (pipeline, micro-batch, stage)
lacks exactly one forward and one backward (or both backward halves), when forward groups
differ between stages, when a backward precedes its forward, or when the schedule deadlocks.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from .actions import Action, Schedule
from .grid import format_grid
from .simulate import simulate


def _fail(schedule: Schedule, problem: str, marks: list[tuple[int, int]]) -> ValueError:
    return ValueError(f"schedule '{schedule.name}' is invalid: {problem}\n{format_grid(schedule, marks)}")


def validate(schedule: Schedule) -> Schedule:
    """Return ``schedule`` unchanged if it is valid; raise ``ValueError`` pointing at the fault."""
    D, N, P = schedule.stages, schedule.micro_batches, schedule.pipelines
    if len(schedule.workers) != D:
        raise ValueError(f"schedule '{schedule.name}' has {len(schedule.workers)} workers for {D} stages")
    for pipe, row in enumerate(schedule.placement):
        if sorted(row) != list(range(D)):
            raise ValueError(f"schedule '{schedule.name}': pipeline {pipe} must place its {D} stages on distinct workers, got {row}")
    where: dict[Action, tuple[int, int]] = {}
    for w, acts in enumerate(schedule.workers):
        for i, a in enumerate(acts):
            if not (0 <= a.pipe < P and 0 <= a.stage < D and all(0 <= m < N for m in a.mbs)):
                raise _fail(schedule, f"{a} is out of range (pipelines {P}, stages {D}, micro-batches {N})", [(w, i)])
            if schedule.placement[a.pipe][a.stage] != w:
                raise _fail(
                    schedule, f"{a} runs on worker {w}, but pipeline {a.pipe} places stage {a.stage} on worker "
                    f"{schedule.placement[a.pipe][a.stage]}", [(w, i)],
                )
            if a in where:
                raise _fail(schedule, f"{a} appears twice", [where[a], (w, i)])
            where[a] = (w, i)

    forward_groups: dict[tuple[int, int], dict[int, tuple[int, ...]]] = defaultdict(dict)
    backward_parts: dict[tuple[int, int, int], list[Action]] = defaultdict(list)
    for a in where:
        for m in a.mbs:
            if a.kind == "F":
                if m in forward_groups[(a.pipe, a.stage)]:
                    raise _fail(schedule, f"micro-batch {m} is forwarded twice on pipeline {a.pipe} stage {a.stage}", [where[a]])
                forward_groups[(a.pipe, a.stage)][m] = a.mbs
            else:
                backward_parts[(a.pipe, a.stage, m)].append(a)

    pipe_of_mb: dict[int, int] = {}
    for (pipe, stage), groups in forward_groups.items():
        for m in groups:
            if pipe_of_mb.setdefault(m, pipe) != pipe:
                raise _fail(schedule, f"micro-batch {m} runs on pipelines {pipe_of_mb[m]} and {pipe}", [])
    for m in range(N):
        if m not in pipe_of_mb:
            raise _fail(schedule, f"micro-batch {m} is never forwarded", [])
        pipe = pipe_of_mb[m]
        for stage in range(D):
            groups = forward_groups[(pipe, stage)]
            if m not in groups:
                raise _fail(schedule, f"micro-batch {m} has no forward on pipeline {pipe} stage {stage}", [])
            if groups[m] != forward_groups[(pipe, 0)][m]:
                raise _fail(
                    schedule, f"micro-batch {m} is forwarded as {groups[m]} on stage {stage} but as "
                    f"{forward_groups[(pipe, 0)][m]} on stage 0", [],
                )
            parts = backward_parts.get((pipe, stage, m), [])
            halves = Counter(a.half for a in parts)
            if not (halves == Counter({None: 1}) or halves == Counter({0: 1, 1: 1})):
                raise _fail(
                    schedule, f"micro-batch {m} needs one backward (or halves 0 and 1) on pipeline {pipe} "
                    f"stage {stage}, found {[str(a) for a in parts] or 'none'}", [where[a] for a in parts],
                )
            forward = next(a for a in where if a.kind == "F" and a.pipe == pipe and a.stage == stage and m in a.mbs)
            for b in parts:
                if where[b][1] < where[forward][1]:
                    raise _fail(schedule, f"{b} runs before its forward {forward}", [where[b], where[forward]])
    simulate(schedule, 1.0, 1.0)  # raises DeadlockError (a ValueError) with the stuck actions marked
    return schedule
