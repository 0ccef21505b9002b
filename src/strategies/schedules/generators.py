"""Schedule generators: GPipe (Huang et al.), DAPPLE / 1F1B with flushes, GEMS and Chimera (Chimera, Li & Hoefler).

Pure functions from sizes to :class:`~pipeline_recipes.strategies.schedules.actions.Schedule` data; no torch,
no registry (:mod:`pipeline_recipes.strategies.schedules.registry` checks the layout rules first; called
directly, a generator refuses what it cannot build with the same rule's message).

* GPipe: every stage runs all forwards, then all backwards (GPipe §2.2, Chimera Figure 2).
* DAPPLE: 1F1B with a flush per iteration: ``min(D - s - 1, N)`` warm-up forwards on stage
  ``s``, then one forward / one backward, then the cool-down backwards
  (:func:`~pipeline_recipes.strategies.schedules.one_f_one_b.one_f_one_b`).
* Chimera (§3.1): ``2f`` pipelines through the same ``D`` workers. Down pipeline ``i`` maps
  stage ``s`` to worker ``(s + i·D/f) mod D`` (§3.6); up pipeline ``f + i`` is its exact
  reverse. Micro-batches are dealt to the pipelines in *basic units* of D (§3.5), each unit
  split evenly (Figure 3: 0, 1 down; 2, 3 up). All pipelines are then list-scheduled together
  at equal slot costs under 1F1B's activation bound per stage, which reproduces the merge of
  Figure 3 (N = D), Table 3 (2f pipelines). ``direct`` concatenation (Figure 7b) lets the next
  unit's forwards fill the previous unit's tail bubbles; with t_b = 2 t_f the backwards leave
  intermediate bubbles that equal slots do not see, so for N > D the units are also list-scheduled
  in time at t_b = 2 t_f under Chimera's activation bound (≤ D micro-batches in flight per worker,
  Table 2), by 1F1B's priority and by the longest remaining path, and the order that simulates
  fastest is kept. ``forward_doubling`` uses units of 2D micro-batches whose forwards run two at
  once; ``backward_halving`` units of D micro-batches whose backwards run in two halves; residual
  micro-batches form basic units. Which of the three is fastest "is not a priori" (§3.5):
  :func:`best_concat` simulates them.
* GEMS (Chimera §2, Table 2): two replicas in opposite directions on Chimera's placement with
  f = 1; micro-batches alternate between them and every worker runs micro-batch k's forward and
  backward before micro-batch k+1's, so at most two micro-batches are active and each worker holds
  one micro-batch of activations (Ma). With t_b = 2 t_f a micro-batch starts every 2D + 1 units:
  bubble ratio → (2D − 2)/(2D + 1) = (D − 1)/(D + ½).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Sequence

from pipeline_recipes.strategies.schedules.actions import Action, Schedule
from pipeline_recipes.strategies.schedules.graph import dependencies, index_actions
from pipeline_recipes.strategies.schedules.messages import fifo_violations, received_messages, sent_messages
from pipeline_recipes.strategies.schedules.one_f_one_b import one_stage_per_worker
from pipeline_recipes.strategies.schedules.rules import (
    AUTO_CONCAT, BIDIRECTIONAL, CHIMERA_PIPELINES, CONCAT_METHODS, OPPOSITE_REPLICAS, Settings, check_sizes,
    concat_error, pipelines_error, raise_if, stages_even,
)
from pipeline_recipes.strategies.schedules.simulate import Cost, simulate

__all__ = [
    "AUTO_CONCAT", "CONCAT_METHODS", "PRACTICAL_COSTS", "best_concat", "chimera", "chimera_placement", "concat_choices",
    "dapple", "gems", "gpipe",
]

PRACTICAL_COSTS = (1.0, 2.0)  # (t_f, t_b): a backward costs about two forwards (Chimera §3.4, §3.5)


def _identity_placement(stages: int) -> tuple[tuple[int, ...], ...]:
    return (tuple(range(stages)),)


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe: all forwards, then all backwards, on every stage."""
    check_sizes("gpipe", stages, micro_batches)
    workers = tuple(
        tuple(Action("F", 0, s, (m,)) for m in range(micro_batches))
        + tuple(Action("B", 0, s, (m,)) for m in range(micro_batches))
        for s in range(stages)
    )
    return Schedule("gpipe", stages, micro_batches, _identity_placement(stages), workers)


def dapple(stages: int, micro_batches: int) -> Schedule:
    """DAPPLE: 1F1B with a pipeline flush at the end of every iteration (warm-up ``D − s − 1`` on stage s)."""
    check_sizes("dapple", stages, micro_batches)
    return one_stage_per_worker("dapple", stages, micro_batches, lambda s: stages - s - 1)


def chimera_placement(stages: int, pipelines: int) -> tuple[tuple[int, ...], ...]:
    """Stage → worker maps of Chimera's ``2f`` pipelines (§3.6): down pipes, then their reverses."""
    f = pipelines // 2
    down = [tuple((s + i * stages // f) % stages for s in range(stages)) for i in range(f)]
    up = [tuple(stages - 1 - w for w in row) for row in down]
    return tuple(down + up)


def _check_chimera(stages: int, micro_batches: int, pipelines: int, concat: str) -> None:
    """What Chimera's placement needs (the rules of :mod:`pipeline_recipes.strategies.schedules.rules`)."""
    check_sizes("chimera", stages, micro_batches)
    settings = Settings("chimera", stages, micro_batches, pipelines=pipelines, concat=concat)
    for error in (stages_even(settings, BIDIRECTIONAL), pipelines_error(settings, CHIMERA_PIPELINES),
                  concat_error(settings, True)):
        raise_if("chimera", error)
    if concat not in CONCAT_METHODS:
        raise ValueError(f"chimera: concat = {concat!r} must be resolved to one of {', '.join(CONCAT_METHODS)} "
                         "first (resolve_concat or best_concat)")


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
    all_actions = index_actions(a for queues in (forwards, backwards) for acts in queues.values() for a in acts)
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
                    deps = dependencies(head, all_actions, stages)
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


Priority = Callable[[Action], tuple]


def _timed_list_schedule(
    stages: int,
    placement: tuple[tuple[int, ...], ...],
    forwards: dict[tuple[int, int], list[Action]],
    backwards: dict[tuple[int, int], list[Action]],
    priority: Priority,
    t_f: float,
    t_b: float,
    in_order: bool = False,
) -> list[list[Action]]:
    """Merge all pipelines into per-worker orders by list scheduling in time (Graham's rule).

    Whenever a worker is idle it starts, among its ready candidates, the one ``priority`` ranks
    first (with ``in_order``, first among those that take their inputs from each peer in the
    order the peer sent them); a forward costs ``t_f`` per micro-batch, a backward ``t_b`` (half
    for a halved one). Every (pipe, stage) keeps its forwards and its backwards in micro-batch
    order and holds at most ``D - s`` micro-batches of activations (1F1B's bound), and every
    worker at most ``D`` (Chimera Table 2's bound). To never deadlock, a worker keeps room for one
    micro-batch for each of its stage copies that holds none and still has forwards to run: then
    the oldest unfinished micro-batch of every pipeline can always take its next step.
    """
    every = [a for queues in (forwards, backwards) for acts in queues.values() for a in acts]
    index = {a: i for i, a in enumerate(every)}
    known = index_actions(every)
    deps = [[index[d] for d in dependencies(a, known, stages)] for a in every]  # type: ignore[index]
    rank = [priority(a) for a in every]
    units = [a.activation_units for a in every]
    cost = [t_f * len(a.mbs) if a.kind == "F" else t_b * (0.5 if a.half is not None else 1.0) for a in every]
    inputs = [[(placement[a.pipe][st], msg) for st, msg in received_messages(a, stages)] for a in every]
    outputs = [[(placement[a.pipe][st], msg) for st, msg in sent_messages(a, stages)] for a in every]
    queues = {w: [(key, [index[a] for a in forwards[key]], [index[a] for a in backwards[key]])
                  for key in forwards if placement[key[0]][key[1]] == w and forwards[key]] for w in range(stages)}
    heads = {(key, kind): 0 for key in forwards for kind in "FB"}
    in_flight = dict.fromkeys(forwards, 0.0)
    live = [0.0] * stages
    done = [math.inf] * len(every)
    free_at = [0.0] * stages
    sent: dict[tuple[int, int], list] = defaultdict(list)  # (src, dst) → messages in send order
    first: dict[tuple[int, int], int] = defaultdict(int)  # (src, dst) → first message not yet consumed
    taken: set = set()
    workers: list[list[Action]] = [[] for _ in range(stages)]

    def out_of_order(i: int, w: int) -> bool:
        return any(first[(src, w)] < len(sent[(src, w)]) and sent[(src, w)][first[(src, w)]] != msg
                   for src, msg in inputs[i])

    remaining, now, events = len(every), 0.0, []
    while remaining:
        for w in range(stages):
            if free_at[w] > now:
                continue
            reserved = sum(1 for key, fq, _ in queues[w] if in_flight[key] == 0 and heads[(key, "F")] < len(fq))
            best: tuple | None = None
            for key, fq, bq in queues[w]:
                for kind, queue in (("F", fq), ("B", bq)):
                    h = heads[(key, kind)]
                    if h == len(queue):
                        continue
                    i = queue[h]
                    if kind == "F" and not (in_flight[key] + units[i] <= stages - key[1] and (
                            in_flight[key] == 0 or live[w] + reserved + units[i] <= stages)):
                        continue
                    if all(done[d] <= now for d in deps[i]):
                        order = (in_order and out_of_order(i, w), rank[i], key)
                        if best is None or order < best[0]:
                            best = (order, key, kind, i)
            if best is None:
                continue
            _, key, kind, i = best
            sign = 1 if kind == "F" else -1
            heads[(key, kind)] += 1
            in_flight[key] += sign * units[i]
            live[w] += sign * units[i]
            done[i] = free_at[w] = now + cost[i]
            heapq.heappush(events, done[i])
            workers[w].append(every[i])
            for dst, msg in outputs[i]:
                sent[(w, dst)].append(msg)
            for src, msg in inputs[i]:
                taken.add(msg)
                pair = (src, w)
                while first[pair] < len(sent[pair]) and sent[pair][first[pair]] in taken:
                    first[pair] += 1
            remaining -= 1
        while events and events[0] <= now:
            heapq.heappop(events)
        if remaining and not events:
            raise RuntimeError("Chimera timed list scheduling made no progress: generator bug")
        now = events[0] if events else now
    return workers


def _priorities(stages: int, t_f: float, t_b: float) -> list[Priority]:
    """The list-scheduling rules tried for direct concatenation, in order of preference.

    * 1F1B's: backward first (frees activations), then the deepest stage, then the oldest
      micro-batch.
    * Latest start first: the action with the longest remaining path to its micro-batch's end
      (``(D - s)·t_f + D·t_b`` from a forward of stage s, ``(s + 1)·t_b`` from a backward),
      micro-batch m counted as released ``λ·m·t_f`` later, for a few release spacings λ.
    """
    def tail(a: Action) -> float:
        return (stages - a.stage) * t_f + stages * t_b if a.kind == "F" else (a.stage + 1) * t_b

    rules: list[Priority] = [lambda a: (a.kind != "B", -a.stage, a.mb)]
    for spacing in (0.5, 1.0, 0.0, 2.0):
        rules.append(lambda a, spacing=spacing: (spacing * a.mb * t_f - tail(a), a.mb))
    return rules


def _copy(queues: dict[tuple[int, int], list[Action]]) -> dict[tuple[int, int], list[Action]]:
    return {key: list(queue) for key, queue in queues.items()}


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
    orders = [_list_schedule(stages, placement, _copy(forwards), _copy(backwards), caps)]
    if concat == "direct" and micro_batches > stages:
        t_f, t_b = PRACTICAL_COSTS
        orders += [_timed_list_schedule(stages, placement, forwards, backwards, rule, t_f, t_b, in_order)
                   for in_order in (False, True) for rule in _priorities(stages, t_f, t_b)]
    schedules = [Schedule("chimera", stages, micro_batches, placement, tuple(map(tuple, w)), concat) for w in orders]
    if len(schedules) == 1:
        return schedules[0]
    # The fastest at t_b = 2 t_f; on a tie the fewest pairs receiving out of send order, then the
    # earlier rule (the equal-slot merge first: it is Figure 7b's seamless concatenation at t_b = t_f).
    return min(schedules, key=lambda sc: (simulate(sc, *PRACTICAL_COSTS).makespan, len(fifo_violations(sc))))


def concat_choices(stages: int, micro_batches: int, micro_batch_size: int | None = None) -> tuple[str, ...]:
    """The concatenation methods worth comparing for a layout (§3.5): direct always; forward
    doubling once a full unit of 2D micro-batches exists (N ≥ 2D); backward halving when N > D and
    the micro-batch splits in two halves (even B; ``None``: any B)."""
    choices = ["direct"]
    if micro_batches > stages:
        if micro_batches >= 2 * stages:
            choices.append("forward_doubling")
        if micro_batch_size is None or micro_batch_size % 2 == 0:
            choices.append("backward_halving")
    return tuple(choices)


CostsOf = Callable[[str], tuple[Cost, Cost, float]]


def best_concat(
    stages: int,
    micro_batches: int,
    pipelines: int = 2,
    micro_batch_size: int | None = None,
    t_f: Cost = PRACTICAL_COSTS[0],
    t_b: Cost = PRACTICAL_COSTS[1],
    t_comm: float = 0.0,
    *,
    costs: CostsOf | None = None,
    generator: Callable[..., Schedule] | None = None,
) -> str:
    """``strategy.concat=auto``: the concatenation method whose Chimera schedule simulates fastest.

    "To select the best of the three methods is not a priori" (Chimera §3.5): each method of
    :func:`concat_choices` is built and simulated at ``t_f``/``t_b``/``t_comm`` (per micro-batch,
    one number or one per stage; by default t_b = 2 t_f), or at ``costs(method)`` where a caller
    knows each method's own costs (the planner's measured ones: halving runs half-size backwards).
    ``generator(stages, micro_batches, pipelines, method)`` builds each candidate (default
    :func:`chimera`; Chimera + zero bubble passes its own, whose split backwards fill other bubbles).
    Ties go to the method that holds fewer activations, then to the earlier of direct, forward
    doubling, backward halving. The one rule behind ``strategy.concat=auto`` everywhere: the
    layout check, the engine, the viewer and the planner.
    """
    _check_chimera(stages, micro_batches, pipelines, "direct")
    ranked = []
    for order, method in enumerate(concat_choices(stages, micro_batches, micro_batch_size)):
        schedule = (generator or chimera)(stages, micro_batches, pipelines, method)
        f, b, comm = costs(method) if costs is not None else (t_f, t_b, t_comm)
        sim = simulate(schedule, f, b, t_comm=comm)
        ranked.append((sim.makespan, max(sim.peak_activations), order, method))
    return min(ranked)[3]


def gems(stages: int, micro_batches: int) -> Schedule:
    """GEMS: two opposite replicas, micro-batches alternating, one micro-batch at a time per worker."""
    check_sizes("gems", stages, micro_batches)
    raise_if("gems", stages_even(Settings("gems", stages, micro_batches), OPPOSITE_REPLICAS))
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
