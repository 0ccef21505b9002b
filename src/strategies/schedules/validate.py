"""Structural check of a schedule before it is simulated, drawn or executed (Chimera §3.1).

:func:`validate` raises :class:`ValueError` with a worker × step grid marking the fault when
an action runs on the wrong worker or is out of range, when the placement leaves a worker without
a stage or gives it one stage twice, when a (pipeline, micro-batch, stage) lacks exactly one
forward and one backward — a full ``B``, or an input-gradient ``I`` and a weight-gradient ``W``
(Zero Bubble Pipeline Parallelism §2: B ≡ I + W), per half when halved — when forward groups
differ between stages, when a backward precedes its forward or a ``W`` its ``I``, or when the
schedule deadlocks.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from pipeline_recipes.strategies.schedules.actions import Action, Schedule
from pipeline_recipes.strategies.schedules.graph import dependencies, index_actions
from pipeline_recipes.strategies.schedules.grid import format_grid
from pipeline_recipes.strategies.schedules.simulate import simulate


def _fail(schedule: Schedule, problem: str, marks: list[tuple[int, int]]) -> ValueError:
    return ValueError(f"schedule '{schedule.name}' is invalid: {problem}\n{format_grid(schedule, marks)}")


def _check_placement(schedule: Schedule) -> None:
    S, P = schedule.stages, schedule.num_workers
    if P < 1:
        raise ValueError(f"schedule '{schedule.name}' has no workers")
    held: dict[int, list[int]] = defaultdict(list)
    for pipe, row in enumerate(schedule.placement):
        if len(row) != S or any(not 0 <= w < P for w in row):
            raise ValueError(f"schedule '{schedule.name}': pipeline {pipe} must place its {S} stages on workers "
                             f"0…{P - 1}, got {row}")
        for stage, w in enumerate(row):
            held[w].append(stage)
    for w in range(P):
        if not held[w]:
            raise ValueError(f"schedule '{schedule.name}': worker {w} holds no stage (placement {schedule.placement})")
        if len(set(held[w])) != len(held[w]):
            raise ValueError(f"schedule '{schedule.name}': worker {w} holds stage copies {sorted(held[w])}; a worker "
                             f"may hold each stage index once")


def _check_backward_parts(schedule: Schedule, where: dict[Action, tuple[int, int]], pipe: int, stage: int, m: int,
                          parts: list[Action], forward: Action) -> None:
    """One B, or one I and one W (Zero Bubble §2: B ≡ I + W), per half; W after its I; both after F."""
    by_half: dict[int | None, Counter] = defaultdict(Counter)
    for a in parts:
        by_half[a.half][a.kind] += 1
    whole = set(by_half) in ({None}, {0, 1})
    if not whole or any(k not in (Counter("B"), Counter("IW")) for k in by_half.values()):
        raise _fail(
            schedule, f"micro-batch {m} needs one backward B (or an I and a W; or halves 0 and 1 of either) on "
            f"pipeline {pipe} stage {stage}, found {[str(a) for a in parts] or 'none'}", [where[a] for a in parts],
        )
    for b in parts:
        if where[b][1] < where[forward][1]:
            raise _fail(schedule, f"{b} runs before its forward {forward}", [where[b], where[forward]])
        if b.kind == "W":
            i = next(a for a in parts if a.kind == "I" and a.half == b.half)
            if where[b][1] < where[i][1]:
                raise _fail(schedule, f"{b} runs before its input-gradient pass {i}", [where[b], where[i]])


def _check_overlap(schedule: Schedule, acts: tuple[Action, ...], w: int, i: int) -> None:
    """An overlapped pair (DualPipeV) is two actions run together: independent of each other, and
    never a chain of three."""
    a = acts[i]
    if i == 0:
        raise _fail(schedule, f"{a} is marked as overlapped with the action before it, but is first", [(w, i)])
    before = acts[i - 1]
    if before.overlap:
        raise _fail(schedule, f"{before} and {a} chain three overlapped actions; a pair is two", [(w, i - 1), (w, i)])
    if before in dependencies(a, index_actions(acts), schedule.stages):
        raise _fail(schedule, f"{a} needs {before}, so the two cannot run overlapped", [(w, i - 1), (w, i)])


def validate(schedule: Schedule) -> Schedule:
    """Return ``schedule`` unchanged if it is valid; raise ``ValueError`` pointing at the fault."""
    S, N, P = schedule.stages, schedule.micro_batches, schedule.pipelines
    _check_placement(schedule)
    where: dict[Action, tuple[int, int]] = {}
    for w, acts in enumerate(schedule.workers):
        for i, a in enumerate(acts):
            if not (0 <= a.pipe < P and 0 <= a.stage < S and all(0 <= m < N for m in a.mbs)):
                raise _fail(schedule, f"{a} is out of range (pipelines {P}, stages {S}, micro-batches {N})", [(w, i)])
            if schedule.placement[a.pipe][a.stage] != w:
                raise _fail(
                    schedule, f"{a} runs on worker {w}, but pipeline {a.pipe} places stage {a.stage} on worker "
                    f"{schedule.placement[a.pipe][a.stage]}", [(w, i)],
                )
            if a in where:
                raise _fail(schedule, f"{a} appears twice", [where[a], (w, i)])
            if a.overlap:
                _check_overlap(schedule, acts, w, i)
            where[a] = (w, i)

    forward_groups: dict[tuple[int, int], dict[int, tuple[int, ...]]] = defaultdict(dict)
    forward_of: dict[tuple[int, int, int], Action] = {}
    backward_parts: dict[tuple[int, int, int], list[Action]] = defaultdict(list)
    for a in where:
        for m in a.mbs:
            if a.kind == "F":
                if m in forward_groups[(a.pipe, a.stage)]:
                    raise _fail(schedule, f"micro-batch {m} is forwarded twice on pipeline {a.pipe} stage {a.stage}", [where[a]])
                forward_groups[(a.pipe, a.stage)][m] = a.mbs
                forward_of[(a.pipe, a.stage, m)] = a
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
        for stage in range(S):
            groups = forward_groups[(pipe, stage)]
            if m not in groups:
                raise _fail(schedule, f"micro-batch {m} has no forward on pipeline {pipe} stage {stage}", [])
            if groups[m] != forward_groups[(pipe, 0)][m]:
                raise _fail(
                    schedule, f"micro-batch {m} is forwarded as {groups[m]} on stage {stage} but as "
                    f"{forward_groups[(pipe, 0)][m]} on stage 0", [],
                )
            _check_backward_parts(schedule, where, pipe, stage, m, backward_parts.get((pipe, stage, m), []),
                                  forward_of[(pipe, stage, m)])
    simulate(schedule, 1.0, 1.0)  # raises DeadlockError (a ValueError) with the stuck actions marked
    return schedule
