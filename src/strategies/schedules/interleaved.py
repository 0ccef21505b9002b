"""Interleaved 1F1B: ``v`` model chunks per worker in a loop (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC '21, §2.2.2
"Schedule with Interleaved Stages").

Each of the ``P`` workers holds ``v ≥ 2`` chunks (stages ``r, r + P, …, r + (v − 1)·P`` of
``S = v·P``; :func:`~.placement.loop_placement`). Forwards go depth first in rounds of
``per_round`` micro-batches: a worker runs ``per_round`` forwards of its first chunk, then of its
second, …, and the backwards mirror that from its last chunk. Worker ``r`` first runs
``(v − 1)·per_round + 2·(P − 1 − r)`` forwards (capped at ``v·N``), then alternates one forward
and one backward, then drains the backwards. The pipeline bubble shrinks from 1F1B's
``(P − 1)(t_F + t_B)`` to ``(P − 1)(t_F + t_B)/v`` (§2.2.2), t_F and t_B being a worker's whole
share of the model, at the cost of ``v`` times as many messages.

Micro-batch count. Megatron-LM requires ``N mod P = 0`` (rounds of exactly P micro-batches).
``torch.distributed.pipelining.ScheduleInterleaved1F1B`` (torch 2.13) relaxes it: it runs
``rounds = max(1, N // P)`` rounds of ``per_round = N / rounds`` micro-batches and requires
``N mod rounds = 0`` (e.g. P = 4 accepts N = 3, 4, 6, 10 but not 9). This generator follows
torch's rule, so for ``N mod P = 0`` it is Megatron-LM's schedule and for the other accepted N it
is torch's. The warm-up count is torch's, which is Megatron-LM's except that Megatron-LM's
implementation runs every forward first when N = P.
"""

from __future__ import annotations

from pipeline_recipes.strategies.schedules.actions import Schedule
from pipeline_recipes.strategies.schedules.one_f_one_b import numbered, one_f_one_b
from pipeline_recipes.strategies.schedules.placement import loop_placement
from pipeline_recipes.strategies.schedules.rules import Settings, check_size, equal_rounds_error, raise_if, rounds

__all__ = ["interleaved_1f1b", "interleaved_rounds"]


def interleaved_rounds(workers: int, micro_batches: int) -> tuple[int, int]:
    """``(rounds, micro-batches per round)`` of torch's relaxed rule; ``ValueError`` if N does not fit
    (:func:`~pipeline_recipes.strategies.schedules.rules.equal_rounds_error`)."""
    raise_if("interleaved_1f1b", equal_rounds_error(Settings("interleaved_1f1b", workers, micro_batches)))
    return rounds(workers, micro_batches)


def interleaved_1f1b(workers: int, chunks: int, micro_batches: int) -> Schedule:
    """Interleaved 1F1B on ``workers`` (P) workers with ``chunks`` (v ≥ 2) stages each, S = v·P: 1F1B whose
    k-th forward slot runs chunk ``(k // per_round) mod v`` (depth first) and k-th backward slot the
    mirror chunk, after ``(v − 1)·per_round + 2·(P − 1 − r)`` warm-up forwards on worker r."""
    check_size("interleaved_1f1b", "workers (P)", workers)
    check_size("interleaved_1f1b", "chunks (v)", chunks, 2, "use v ≥ 2 chunks per worker, or dapple (1F1B) for v = 1")
    check_size("interleaved_1f1b", "micro_batches (N)", micro_batches)
    _, per_round = interleaved_rounds(workers, micro_batches)
    P, v, N = workers, chunks, micro_batches
    orders = []
    for r in range(P):
        def forward_stage(k: int, r: int = r) -> int:
            return (k // per_round) % v * P + r

        def backward_stage(k: int, r: int = r) -> int:
            return (v - 1 - (k // per_round) % v) * P + r

        orders.append(tuple(one_f_one_b(numbered("F", forward_stage, v * N), numbered("B", backward_stage, v * N),
                                        warmup=(v - 1) * per_round + 2 * (P - 1 - r))))
    return Schedule("interleaved_1f1b", v * P, N, loop_placement(P, v), tuple(orders))
