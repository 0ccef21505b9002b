"""The one 1F1B builder: every one-forward-one-backward order of the package comes from :func:`one_f_one_b`.

1F1B (PipeDream, Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP '19,
§3.3) runs on each worker a *warm-up* of forwards, a *steady state* that alternates one forward and one
backward, and a *cool-down* of the remaining backwards. The schedules built on it differ only in its
parameters (like the rank-ops builder of ``torch.distributed.pipelining``, which takes stage-index
functions):

* which stage (chunk) each forward slot and each backward slot runs, and on which micro-batch
  (:func:`numbered`: slot ``k`` on stage ``stage_of(k)``, each stage's micro-batches in order);
* the warm-up count;
* whether the steady state runs the forward or the backward of a pair first;
* whether the backward is split into an input gradient ``I`` and a weight gradient ``W`` (Zero Bubble
  Pipeline Parallelism, Qi et al. 2024, §2), and how many backward slots each ``W`` waits;
* whether there is a cool-down (a flush) at all.

Its users: DAPPLE (Fan et al., "DAPPLE: A Pipelined Data Parallel Approach for Training Large Models",
PPoPP '21; warm-up ``D − 1 − s`` on stage ``s``), interleaved 1F1B (Megatron-LM, Narayanan et al. 2021,
§2.2.2; chunks depth first), ZB-H1 (split backward, ``W`` held back ``r`` slots on worker ``r``) and the
skeleton of ZB-H2 (backward first) in :mod:`pipeline_recipes.strategies.schedules.zero_bubble`, and the
asynchronous windows of PipeDream and PipeDream-2BW (no cool-down between optimizer steps) in
:mod:`pipeline_recipes.strategies.schedules.asynchronous`. A new 1F1B variant is a new set of parameters:
with one stage per worker, its generator is a call of :func:`one_stage_per_worker`, e.g.
``lambda stages, micro_batches: one_stage_per_worker("name", stages, micro_batches, lambda s: stages - s)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from pipeline_recipes.strategies.schedules.actions import Action, Kind, Schedule


def numbered(kind: Kind, stage_of: Callable[[int], int], slots: int, pipe: int = 0) -> list[Action]:
    """The first ``slots`` actions of ``kind``: slot ``k`` runs stage ``stage_of(k)`` of pipeline ``pipe``
    on that stage's next micro-batch (each stage's micro-batches in order from 0)."""
    next_mb: dict[int, int] = defaultdict(int)
    out = []
    for k in range(slots):
        stage = stage_of(k)
        out.append(Action(kind, pipe, stage, (next_mb[stage],)))
        next_mb[stage] += 1
    return out


def one_f_one_b(
    forwards: Sequence[Action],
    backwards: Sequence[Action],
    warmup: int,
    *,
    backward_first: bool = False,
    weight_lag: int | None = None,
    cool_down: bool = True,
) -> list[Action]:
    """One worker's 1F1B order.

    ``warmup`` forwards (at most all of them), then every further forward paired with the next backward
    piece (the forward first, or with ``backward_first`` the backward), then the remaining backward
    pieces (the cool-down; ``cool_down=False`` stops after the steady state, as a schedule without
    flushes does between two steps). ``backwards`` may hold more pieces than there are forwards (halved
    backwards): the extra ones join the cool-down.

    ``weight_lag``: the backward pieces are input-gradient passes ``I``; the weight gradient ``W`` of
    piece ``k − weight_lag`` runs right after piece ``k``, and the ``W``'s still pending run at the end.
    ``None``: the backwards are whole.
    """
    warmup = max(0, min(warmup, len(forwards)))
    order = list(forwards[:warmup])
    pending = iter(backwards)
    emitted: list[Action] = []

    def backward() -> list[Action]:
        piece = next(pending)
        emitted.append(piece)
        k = len(emitted) - 1
        if weight_lag is None or k < weight_lag:
            return [piece]
        return [piece, _weight_of(emitted[k - weight_lag])]

    for forward in forwards[warmup:]:
        pair = backward()
        order += [*pair, forward] if backward_first else [forward, *pair]
    if cool_down:
        for _ in range(len(backwards) - len(emitted)):
            order += backward()
        if weight_lag is not None:
            order += [_weight_of(a) for a in emitted[max(len(emitted) - weight_lag, 0):]]
    return order


def _weight_of(piece: Action) -> Action:
    return Action("W", piece.pipe, piece.stage, piece.mbs, piece.half)


def one_stage_per_worker(
    name: str,
    stages: int,
    micro_batches: int,
    warmup: Callable[[int], int],
    *,
    split: bool = False,
    weight_lag: Callable[[int], int] | None = None,
    backward_first: bool = False,
) -> Schedule:
    """A 1F1B schedule with worker ``s`` holding stage ``s``: ``warmup(s)`` forwards, then the steady state
    and the cool-down of :func:`one_f_one_b` over the ``micro_batches`` micro-batches in order. ``split``:
    backwards are input gradients ``I`` whose ``W`` follow ``weight_lag(s)`` slots later (default 0)."""
    def order(s: int) -> tuple[Action, ...]:
        forwards = numbered("F", lambda _: s, micro_batches)
        backwards = numbered("I" if split else "B", lambda _: s, micro_batches)
        lag = (weight_lag(s) if weight_lag is not None else 0) if split else None
        return tuple(one_f_one_b(forwards, backwards, warmup(s), backward_first=backward_first, weight_lag=lag))

    return Schedule(name, stages, micro_batches, (tuple(range(stages)),), tuple(order(s) for s in range(stages)))
