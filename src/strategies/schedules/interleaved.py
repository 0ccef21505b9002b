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

from collections import defaultdict
from collections.abc import Callable

from .actions import Action, Schedule
from .placement import check_size, loop_placement
from .validate import validate


def interleaved_rounds(workers: int, micro_batches: int) -> tuple[int, int]:
    """``(rounds, micro-batches per round)`` of torch's relaxed rule; ``ValueError`` if N does not fit."""
    rounds = max(1, micro_batches // workers)
    if micro_batches % rounds:
        def fits(m: int) -> bool:
            return m % max(1, m // workers) == 0

        below = next(m for m in range(micro_batches - 1, 0, -1) if fits(m))
        above = next(m for m in range(micro_batches + 1, 2 * micro_batches + workers) if fits(m))
        raise ValueError(
            f"interleaved_1f1b: micro_batches N = {micro_batches} does not split into equal rounds on P = {workers} "
            f"workers: N must be a multiple of rounds = max(1, N // P) = {rounds} (Megatron-LM requires N mod P = 0; "
            f"torch's ScheduleInterleaved1F1B relaxes it to this rule); use N = {below} or N = {above}"
        )
    return rounds, micro_batches // rounds


def interleaved_1f1b(workers: int, chunks: int, micro_batches: int) -> Schedule:
    """Interleaved 1F1B on ``workers`` (P) workers with ``chunks`` (v ≥ 2) stages each, S = v·P."""
    check_size("interleaved_1f1b", "workers (P)", workers)
    check_size("interleaved_1f1b", "chunks (v)", chunks, 2, "use v ≥ 2 chunks per worker, or dapple (1F1B) for v = 1")
    check_size("interleaved_1f1b", "micro_batches (N)", micro_batches)
    _, per_round = interleaved_rounds(workers, micro_batches)
    P, v, N = workers, chunks, micro_batches
    orders = []
    for r in range(P):
        total = v * N
        warmup = min((v - 1) * per_round + 2 * (P - 1 - r), total)

        def forward_stage(k: int, r: int = r) -> int:  # the k-th forward's chunk, depth first
            return (k // per_round) % v * P + r

        def backward_stage(k: int, r: int = r) -> int:  # the k-th backward's chunk, last chunk first
            return (v - 1 - (k // per_round) % v) * P + r

        orders.append(_one_f_one_b(total, warmup, forward_stage, backward_stage))
    return validate(Schedule("interleaved_1f1b", v * P, N, loop_placement(P, v), tuple(orders)))


def _one_f_one_b(total: int, warmup: int, forward_stage: Callable[[int], int],
                 backward_stage: Callable[[int], int]) -> tuple[Action, ...]:
    """``warmup`` forwards, then forward/backward pairs, then the remaining backwards; each
    stage's micro-batches in order."""
    next_mb: dict[tuple[str, int], int] = defaultdict(int)

    def take(kind: str, stage: int) -> Action:
        m = next_mb[(kind, stage)]
        next_mb[(kind, stage)] += 1
        return Action(kind, 0, stage, (m,))  # type: ignore[arg-type]

    order = [take("F", forward_stage(k)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [take("F", forward_stage(warmup + k)), take("B", backward_stage(k))]
    order += [take("B", backward_stage(k)) for k in range(total - warmup, total)]
    return tuple(order)


GENERATORS: dict[str, Callable[..., Schedule]] = {
    # interleaved_1f1b(workers: int, chunks: int, micro_batches: int) -> Schedule   (S = chunks·workers)
    "interleaved_1f1b": interleaved_1f1b,
}

__all__ = ["GENERATORS", "interleaved_1f1b", "interleaved_rounds"]
