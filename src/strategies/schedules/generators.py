"""Schedule generators: GPipe (seed 001), DAPPLE / 1F1B with flushes, GEMS and Chimera (seed 004).

Pure functions from sizes to :class:`~strategies.schedules.actions.Schedule` data; no torch.

* GPipe: every stage runs all forwards, then all backwards (GPipe §2.2, Chimera Figure 2).
* DAPPLE: 1F1B with a flush per iteration: ``min(D - s - 1, N)`` warm-up forwards on stage
  ``s``, then one forward / one backward, then the cool-down backwards.
* Chimera (§3.1): ``2f`` pipelines through the same ``D`` workers. Down pipeline ``i`` maps
  stage ``s`` to worker ``(s + i·D/f) mod D`` (§3.6); up pipeline ``f + i`` is its exact
  reverse. Micro-batches are dealt to the pipelines in *basic units* of D (§3.5), each unit
  split evenly (Figure 3: 0, 1 down; 2, 3 up). All pipelines are then list-scheduled together
  at equal slot costs under 1F1B's activation bound per stage, which reproduces the merge of
  Figure 3 (N = D), Table 3 (2f pipelines), and lets the next unit's forwards fill the
  previous unit's tail bubbles (``direct`` concatenation, Figure 7b). ``forward_doubling``
  uses units of 2D micro-batches whose forwards run two at once; ``backward_halving`` units of
  D micro-batches whose backwards run in two halves; residual micro-batches form basic units.
* GEMS (Chimera §2, Table 2): two replicas in opposite directions on Chimera's placement with
  f = 1; micro-batches alternate between them and every worker runs micro-batch k's forward and
  backward before micro-batch k+1's, so at most two micro-batches are active and each worker holds
  one micro-batch of activations (Ma). With t_b = 2 t_f a micro-batch starts every 2D + 1 units:
  bubble ratio → (2D − 2)/(2D + 1) = (D − 1)/(D + ½).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .actions import Action, Schedule
from .asynchronous import ASYNC_SCHEDULES
from .asynchronous import run as async_run
from .graph import dependencies, forward_index

CONCAT_METHODS = ("direct", "forward_doubling", "backward_halving")


def _check_sizes(name: str, stages: int, micro_batches: int) -> None:
    for setting, value in (("stages", stages), ("micro_batches", micro_batches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {setting} must be a positive integer, got {value!r}; use 1 or more")


def _identity_placement(stages: int) -> tuple[tuple[int, ...], ...]:
    return (tuple(range(stages)),)


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe: all forwards, then all backwards, on every stage."""
    _check_sizes("gpipe", stages, micro_batches)
    workers = tuple(
        tuple(Action("F", 0, s, (m,)) for m in range(micro_batches))
        + tuple(Action("B", 0, s, (m,)) for m in range(micro_batches))
        for s in range(stages)
    )
    return Schedule("gpipe", stages, micro_batches, _identity_placement(stages), workers)


def _one_f_one_b(
    pipe: int,
    stage: int,
    stages: int,
    tasks: Sequence[tuple[int, ...]],
    pieces: Sequence[Action],
) -> list[Action]:
    """1F1B order of one stage: warm-up forwards, one forward / one backward, cool-down.

    ``tasks`` are the forward groups (one micro-batch, or two when doubled); ``pieces`` are the
    backward actions in order (one per micro-batch, or two halves).
    """
    forwards = [Action("F", pipe, stage, mbs) for mbs in tasks]
    warmup = min(stages - stage - 1, len(forwards))
    order = forwards[:warmup]
    backwards = iter(pieces)
    for forward in forwards[warmup:]:
        order.append(forward)
        order.append(next(backwards))
    order.extend(backwards)
    return order


def dapple(stages: int, micro_batches: int) -> Schedule:
    """DAPPLE: 1F1B with a pipeline flush at the end of every iteration."""
    _check_sizes("dapple", stages, micro_batches)
    tasks = [(m,) for m in range(micro_batches)]
    workers = tuple(
        tuple(_one_f_one_b(0, s, stages, tasks, [Action("B", 0, s, (m,)) for m in range(micro_batches)]))
        for s in range(stages)
    )
    return Schedule("dapple", stages, micro_batches, _identity_placement(stages), workers)


def chimera_placement(stages: int, pipelines: int) -> tuple[tuple[int, ...], ...]:
    """Stage → worker maps of Chimera's ``2f`` pipelines (§3.6): down pipes, then their reverses."""
    f = pipelines // 2
    down = [tuple((s + i * stages // f) % stages for s in range(stages)) for i in range(f)]
    up = [tuple(stages - 1 - w for w in row) for row in down]
    return tuple(down + up)


def _check_chimera(stages: int, micro_batches: int, pipelines: int, concat: str) -> None:
    _check_sizes("chimera", stages, micro_batches)
    if stages % 2:
        raise ValueError(
            f"chimera: stages (D) must be even to merge down and up pipelines without conflict "
            f"(§3.1), got D = {stages}; use an even D such as {sorted({max(stages - 1, 2), stages + 1})}"
        )
    half = stages // 2
    divisors = [2 * f for f in range(1, half + 1) if half % f == 0]
    if pipelines not in divisors:
        raise ValueError(
            f"chimera: pipelines must be 2f for a divisor f of D/2 = {half} (§3.6), got {pipelines}; "
            f"choose one of {divisors}"
        )
    if concat not in CONCAT_METHODS:
        raise ValueError(f"chimera: concat must be one of {', '.join(CONCAT_METHODS)}, got {concat!r}")


def _split_evenly(items: Sequence, parts: int) -> list[list]:
    """Contiguous shares, the first ``len(items) % parts`` one longer (Figure 3: 0,1 down; 2,3 up)."""
    base, extra = divmod(len(items), parts)
    shares, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        shares.append(list(items[start : start + size]))
        start += size
    return shares


def _list_schedule(
    stages: int,
    placement: tuple[tuple[int, ...], ...],
    forwards: dict[tuple[int, int], list[Action]],
    backwards: dict[tuple[int, int], list[Action]],
    caps: dict[tuple[int, int], float],
) -> list[list[Action]]:
    """Merge all pipelines into per-worker orders by list scheduling at one slot per action.

    Every (pipe, stage) keeps its forwards and its backwards in micro-batch order and may hold at
    most ``caps[(pipe, stage)]`` micro-batches of activations (1F1B's bound). Each slot, each
    worker runs, among its ready candidates, the one of the deepest stage (the stages on a worker
    are distinct), backward before forward. Equal slots for all actions follow §3.5's premise
    that doubled forwards and halved backwards equalise the workloads.
    """
    all_forwards = forward_index(a for acts in forwards.values() for a in acts)
    keys_of = {w: [k for k in forwards if placement[k[0]][k[1]] == w] for w in range(stages)}
    in_flight = dict.fromkeys(forwards, 0.0)
    done_at: dict[Action, int] = {}
    workers: list[list[Action]] = [[] for _ in range(stages)]
    remaining = sum(map(len, forwards.values())) + sum(map(len, backwards.values()))
    slot = 0
    while remaining:
        finished = []
        for w in range(stages):
            candidates = []
            for key in keys_of[w]:
                for queue in (forwards[key], backwards[key]):
                    if not queue:
                        continue
                    head = queue[0]
                    deps = dependencies(head, all_forwards, stages)
                    if any(d not in done_at for d in deps):
                        continue
                    if head.kind == "F" and in_flight[key] + head.activation_units > caps[key]:
                        continue
                    candidates.append(((-head.stage, head.kind != "B"), key, queue))
            if candidates:
                _, key, queue = min(candidates, key=lambda c: c[0])
                action = queue.pop(0)
                in_flight[key] += action.activation_units * (1 if action.kind == "F" else -1)
                workers[w].append(action)
                finished.append(action)
        if not finished:
            raise RuntimeError(f"Chimera list scheduling made no progress at slot {slot}: generator bug")
        slot += 1
        remaining -= len(finished)
        for action in finished:
            done_at[action] = slot
    return workers


def _unit_tasks(mbs: Sequence[int], method: str) -> list[tuple[tuple[int, ...], list[tuple[int, int | None]]]]:
    """Forward groups of one unit, each with its backward pieces as (micro-batch, half)."""
    if method == "forward_doubling":
        return [(tuple(mbs[i : i + 2]), [(m, None) for m in mbs[i : i + 2]]) for i in range(0, len(mbs), 2)]
    if method == "backward_halving":
        return [((m,), [(m, 0), (m, 1)]) for m in mbs]
    return [((m,), [(m, None)]) for m in mbs]


def _units(micro_batches: int, stages: int, concat: str) -> list[tuple[list[int], str]]:
    """Split ``range(N)`` into basic units: (micro-batches, method) in execution order."""
    unit_size = {"direct": stages, "forward_doubling": 2 * stages, "backward_halving": stages}[concat]
    units: list[tuple[list[int], str]] = []
    full = micro_batches // unit_size if concat != "direct" else 0
    for u in range(full):
        units.append((list(range(u * unit_size, (u + 1) * unit_size)), concat))
    for start in range(full * unit_size, micro_batches, stages):
        units.append((list(range(start, min(start + stages, micro_batches))), "direct"))
    return units


def chimera(stages: int, micro_batches: int, pipelines: int = 2, concat: str = "direct") -> Schedule:
    """Chimera: ``pipelines`` = 2f bidirectional pipelines, concatenated basic units for N > D."""
    _check_chimera(stages, micro_batches, pipelines, concat)
    placement = chimera_placement(stages, pipelines)
    keys = [(pipe, stage) for pipe in range(pipelines) for stage in range(stages)]
    forwards: dict[tuple[int, int], list[Action]] = {k: [] for k in keys}
    backwards: dict[tuple[int, int], list[Action]] = {k: [] for k in keys}
    for mbs, method in _units(micro_batches, stages, concat):
        for pipe, share in enumerate(_split_evenly(_unit_tasks(mbs, method), pipelines)):
            for stage in range(stages):
                forwards[(pipe, stage)] += [Action("F", pipe, stage, group) for group, _ in share]
                backwards[(pipe, stage)] += [
                    Action("B", pipe, stage, (m,), half) for _, pieces in share for m, half in pieces
                ]
    # 1F1B bound per stage for a unit's share of D/(2f) micro-batches; doubled when forwards are.
    share = max(stages // pipelines, 1)
    scale = 2 if concat == "forward_doubling" else 1
    caps = {(p, s): float(scale * min(stages - s, share)) for p, s in keys}
    workers = _list_schedule(stages, placement, forwards, backwards, caps)
    return Schedule(
        "chimera", stages, micro_batches, placement, tuple(map(tuple, workers)), concat
    )


def gems(stages: int, micro_batches: int) -> Schedule:
    """GEMS: two opposite replicas, micro-batches alternating, one micro-batch at a time per worker."""
    _check_sizes("gems", stages, micro_batches)
    if stages % 2:
        raise ValueError(
            f"gems: stages (D) must be even so that each worker holds two distinct stages, one per replica, "
            f"got D = {stages}; use an even D such as {sorted({max(stages - 1, 2), stages + 1})}"
        )
    placement = chimera_placement(stages, 2)
    workers = []
    for w in range(stages):
        acts: list[Action] = []
        for m in range(micro_batches):
            pipe = m % 2
            stage = placement[pipe].index(w)
            acts += [Action("F", pipe, stage, (m,)), Action("B", pipe, stage, (m,))]
        workers.append(tuple(acts))
    return Schedule("gems", stages, micro_batches, placement, tuple(workers))


ScheduleFactory = Callable[..., Schedule]

ASYNC_VIEW_STEPS = 3  # steps of an asynchronous schedule that build_schedule returns (then the drain)

SCHEDULES: dict[str, ScheduleFactory] = {
    "gpipe": gpipe, "dapple": dapple, "1f1b": dapple, "gems": gems, "chimera": chimera,
    **{name: (lambda stages, micro_batches, name=name: async_run(name, stages, micro_batches, ASYNC_VIEW_STEPS))
       for name in ASYNC_SCHEDULES},
}


def build_schedule(
    name: str, stages: int, micro_batches: int, pipelines: int | None = None, concat: str = "direct"
) -> Schedule:
    """Build a schedule by name; ``pipelines``/``concat`` apply to Chimera only (GEMS runs 2 pipelines).

    An asynchronous schedule (``pipedream_2bw``, ``pipedream``) comes as ``ASYNC_VIEW_STEPS`` steps of
    N micro-batches without flushes plus the final drain; the runtime runs it window by window
    (:mod:`strategies.schedules.asynchronous`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(sorted(SCHEDULES))}")
    if name == "chimera":
        return chimera(stages, micro_batches, 2 if pipelines is None else pipelines, concat)
    if name == "gems" and pipelines not in (None, 2):
        raise ValueError(f"gems: runs exactly 2 pipelines (two opposite replicas), got pipelines = {pipelines}; "
                         f"leave pipelines unset, or use chimera for 2f pipelines")
    if name != "gems" and pipelines not in (None, 1):
        raise ValueError(
            f"{name}: runs one pipeline, got pipelines = {pipelines}; leave pipelines unset (or 1), "
            f"or use chimera for several pipelines"
        )
    if concat != "direct":
        raise ValueError(f"{name}: concat applies to chimera only, got concat={concat!r}")
    return SCHEDULES[name](stages, micro_batches)
