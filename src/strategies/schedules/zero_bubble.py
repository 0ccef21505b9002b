"""Zero-bubble schedules: the backward split into an input-gradient pass ``I`` and a weight-gradient
pass ``W`` that nobody waits for (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The paper calls our ``I`` "B" and counts costs ``T_F``, ``T_B`` (= our I) and ``T_W``; our simulator
takes ``t_b`` for the whole backward and ``t_w`` for its W share, so the paper's T_F = T_B = T_W is
``simulate(s, 1, 2, t_w=1)``.

* :func:`zb_h1` — ZB-H1, the memory-efficient handcrafted schedule (§2.1, "Handcrafted pipeline
  schedules"; Figure 3, top): 1F1B's warm-up (``P − 1 − r`` forwards on worker r), then F, I and a
  W per step, worker r starting its W's ``r`` steps late, so every worker has P micro-batches in
  flight and the tail bubbles fill with W's. Bubble ``(P − 1)(T_F + T_B − T_W)`` (N ≥ P,
  T_W ≤ T_F and T_W ≤ T_B), a third of 1F1B's at equal costs, with 1F1B's peak activations. The order is exactly that of torch's
  ``ScheduleInterleavedZeroBubble`` with one stage per rank (its "ZB1P").
* :func:`zb_h2` — ZB-H2, the zero-bubble handcrafted schedule (§2.2; Figure 3, bottom): worker r
  first runs ``2(P − 1 − r) + 1`` forwards, which fills the time until its first input gradient
  arrives, then alternates I and F and drains its I's; its W's are held back
  (:func:`defer_weight_gradients` with a bound of ``2P − 1`` micro-batches in flight, the first
  worker's warm-up) and run where the worker would wait, which turns the tail into a
  parallelogram. At T_F = T_B = T_W and N ≥ 2P − 1 no worker idles between its first and its last
  action; the only idle time is the fill and drain ``(P − 1)·T_F`` that the paper's post-validated
  optimizer step (§4) overlaps with the next iteration.
* :func:`zbv` — ZB-V (§6, "Memory efficient zero bubble schedule", and "Pipeline Parallelism with
  Controllable Memory", Qi et al. 2024): two chunks per worker in a V (:func:`~.placement.v_placement`),
  zero bubble at T_F = T_B = T_W with 1F1B's peak activation memory (2P chunk activations = P
  micro-batches of a worker's layers). The order is torch's ``ScheduleZBVZeroBubble``'s.
* :func:`defer_weight_gradients` — a transform: split every ``B`` of a schedule into ``I`` + ``W``
  and push each ``W`` later, into the worker's idle time, found by simulating at t_f = 1,
  t_b = 2, t_w = 1, never holding more activations than a stated bound (by default the schedule's
  own peak per worker, so memory never grows). :func:`chimera_zb` applies it to Chimera (Li &
  Hoefler, "Chimera: Efficiently Training Large-Scale Neural Networks with Bidirectional
  Pipelines"): the bidirectional pipelines' bubbles filled with deferred weight gradients.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from pipeline_recipes.strategies.schedules.actions import Action, Schedule
from pipeline_recipes.strategies.schedules.generators import chimera
from pipeline_recipes.strategies.schedules.graph import dependencies, index_actions
from pipeline_recipes.strategies.schedules.one_f_one_b import one_stage_per_worker
from pipeline_recipes.strategies.schedules.placement import v_placement
from pipeline_recipes.strategies.schedules.rules import check_size
from pipeline_recipes.strategies.schedules.simulate import peak_activations

__all__ = ["chimera_zb", "defer_weight_gradients", "split_backwards", "zb_h1", "zb_h2", "zbv"]


def zb_h1(workers: int, micro_batches: int) -> Schedule:
    """ZB-H1 on P workers, one stage each (S = P): 1F1B's memory, a third of its bubble."""
    check_size("zb_h1", "workers (P)", workers)
    check_size("zb_h1", "micro_batches (N)", micro_batches)
    P, N = workers, micro_batches
    # 1F1B's warm-up; worker r holds back r weight gradients: P micro-batches in flight everywhere
    return one_stage_per_worker("zb_h1", P, N, lambda r: P - 1 - r, split=True, weight_lag=lambda r: r)


def zb_h2(workers: int, micro_batches: int) -> Schedule:
    """ZB-H2 on P workers, one stage each (S = P): zero bubble inside the parallelogram, ≤ 2P − 1
    micro-batches of activations per worker."""
    check_size("zb_h2", "workers (P)", workers)
    check_size("zb_h2", "micro_batches (N)", micro_batches)
    P, N = workers, micro_batches
    base = one_stage_per_worker("zb_h2", P, N, lambda r: 2 * (P - 1 - r) + 1, backward_first=True)
    bound = [float(min(2 * P - 1, N))] * P
    return replace(defer_weight_gradients(base, max_activations=bound), name="zb_h2")


def zbv(workers: int, micro_batches: int) -> Schedule:
    """ZB-V on P workers, two stages each in a V (S = 2P): zero bubble at 1F1B's memory."""
    check_size("zbv", "workers (P)", workers)
    check_size("zbv", "micro_batches (N)", micro_batches)
    P, N = workers, micro_batches
    S = 2 * P
    orders = []
    for r in range(P):
        n = max(2 * P - 1, N)  # built for at least 2P − 1 micro-batches, the extra ones dropped
        c0, c1 = r, S - 1 - r
        f0 = f1 = b0 = b1 = 0
        acts: list[Action] = []

        def add(kind: str, stage: int, mb: int) -> None:
            acts.append(Action(kind, 0, stage, (mb,)))  # type: ignore[arg-type]

        for _ in range(2 * (P - r) - 1):  # warm-up: chunk 0 forwards
            add("F", c0, f0); f0 += 1
        for _ in range(r):  # chunk 1 and chunk 0 forwards in turn
            add("F", c1, f1); f1 += 1
            add("F", c0, f0); f0 += 1
        for _ in range(P - r):  # chunk 1: forward, input and weight gradient
            add("F", c1, f1); f1 += 1
            add("I", c1, b1); add("W", c1, b1); b1 += 1
        while f1 < f0 or f0 < n:  # steady state
            if f0 < n:
                add("F", c0, f0); f0 += 1
            add("I", c0, b0); add("W", c0, b0); b0 += 1
            add("F", c1, f1); f1 += 1
            add("I", c1, b1); add("W", c1, b1); b1 += 1
        w0, w1 = b0, b1
        for _ in range(r):  # cool-down: input gradients first, weight gradients fill the tail
            add("I", c0, b0); b0 += 1
            add("I", c1, b1); b1 += 1
        for _ in range(P - r):
            add("I", c0, b0); b0 += 1
            add("W", c0, w0); w0 += 1
        while w1 < b1:
            add("W", c1, w1); w1 += 1
        while w0 < b0:
            add("W", c0, w0); w0 += 1
        orders.append(tuple(a for a in acts if a.mb < N))
    return Schedule("zbv", S, N, v_placement(P), tuple(orders))


# --- deferring weight gradients into idle time -----------------------------------------------

def split_backwards(schedule: Schedule) -> Schedule:
    """Every full backward ``B`` replaced in place by its input-gradient pass ``I`` followed by its
    weight-gradient pass ``W`` (B ≡ I + W): the same schedule, ready to move its W's."""
    workers = tuple(
        tuple(x for a in acts for x in (
            (replace(a, kind="I"), Action("W", a.pipe, a.stage, a.mbs, a.half)) if a.kind == "B" else (a,)))
        for acts in schedule.workers
    )
    return replace(schedule, workers=workers)


def defer_weight_gradients(
    schedule: Schedule,
    *,
    max_activations: float | Sequence[float] | None = None,
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_w: float = 1.0,
) -> Schedule:
    """Split the backwards (:func:`split_backwards`) and move each ``W`` into idle time.

    Each worker keeps its forwards and input-gradient passes in their order and runs them as soon
    as they are ready (simulated at ``t_f``, ``t_b``, ``t_w``; the defaults are the paper's
    T_F = T_B = T_W); its weight-gradient passes wait in a first-in first-out queue and run when
    the worker would otherwise idle, when a forward would take the worker past its activation
    bound, and at the end. The bound (micro-batches whose forward ran and whose W has not, an
    ``I`` freeing nothing; one number or one per worker) defaults to the schedule's own peak
    (:func:`~.simulate.peak_activations`), so deferring never costs memory. A ready F or I always
    goes first: a W never delays what another worker waits for, except by the W already running.
    """
    split = split_backwards(schedule)
    P = schedule.num_workers
    if max_activations is None:
        bound = list(peak_activations(schedule))
    elif isinstance(max_activations, (int, float)):
        bound = [float(max_activations)] * P
    else:
        bound = [float(b) for b in max_activations]
    if len(bound) != P:
        raise ValueError(f"defer_weight_gradients: max_activations needs one bound or {P} (one per worker), "
                         f"got {len(bound)}")
    flat = [a for acts in split.workers for a in acts]
    known = index_actions(flat)
    cost = {"F": t_f, "I": t_b - t_w, "W": t_w}
    queues = [deque(a for a in acts if a.kind != "W") for acts in split.workers]
    for w, acts in enumerate(split.workers):
        live = peak = 0.0
        for a in acts:
            if a.kind != "I":
                live += a.activation_delta
                peak = max(peak, live)
        if peak > bound[w] + 1e-9:
            raise ValueError(
                f"defer_weight_gradients: worker {w} of '{schedule.name}' already holds {peak:g} micro-batches of "
                f"activations, above its bound {bound[w]:g}; raise max_activations to at least {peak:g}"
            )
    pending: list[deque[Action]] = [deque() for _ in range(P)]
    live = [0.0] * P
    free = [0.0] * P
    end: dict[Action, float] = {}
    orders: list[list[Action]] = [[] for _ in range(P)]
    remaining = len(flat)

    def ready_at(a: Action) -> float | None:
        deps = dependencies(a, known, schedule.stages)
        if any(d not in end for d in deps):
            return None
        return max([end[d] for d in deps], default=0.0)  # type: ignore[index]

    def run(w: int, a: Action, start: float) -> None:
        nonlocal remaining
        units = a.activation_units
        per = cost[a.kind] * (len(a.mbs) if a.kind == "F" else (0.5 if a.half is not None else 1.0))
        end[a] = free[w] = start + per
        live[w] += units if a.kind == "F" else (-units if a.kind == "W" else 0.0)
        orders[w].append(a)
        if a.kind == "I":
            pending[w].append(Action("W", a.pipe, a.stage, a.mbs, a.half))
        remaining -= 1

    now = 0.0
    while remaining:
        progressed = False
        for w in range(P):
            while free[w] <= now + 1e-12:
                head = queues[w][0] if queues[w] else None
                at = ready_at(head) if head is not None else None
                if head is not None and at is not None and at <= now + 1e-12:
                    if head.kind == "F" and live[w] + head.activation_units > bound[w] + 1e-9 and pending[w]:
                        run(w, pending[w].popleft(), max(now, free[w]))  # the bound releases a W first
                    else:
                        run(w, queues[w].popleft(), max(now, free[w]))
                elif pending[w]:
                    run(w, pending[w].popleft(), max(now, free[w]))  # idle time: fill it with a W
                else:
                    break
                progressed = True
        times = [f for f in free if f > now + 1e-12] + [e for e in end.values() if e > now + 1e-12]
        if remaining and not times and not progressed:
            raise RuntimeError(f"defer_weight_gradients: '{schedule.name}' made no progress at t = {now}: "
                               "the input schedule deadlocks")
        if times:
            now = min(times)
    return replace(split, workers=tuple(map(tuple, orders)))


def chimera_zb(stages: int, micro_batches: int, pipelines: int = 2, concat: str = "direct") -> Schedule:
    """Chimera with its bubbles filled by deferred weight gradients (:func:`defer_weight_gradients`
    on :func:`~.generators.chimera`), holding no more activations per worker than Chimera (≤ D)."""
    base = chimera(stages, micro_batches, pipelines, concat)
    return replace(defer_weight_gradients(base), name="chimera_zb")

