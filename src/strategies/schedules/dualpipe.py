"""DualPipeV: DualPipe's bidirectional idea folded onto one V pipeline (DeepSeek-AI, "DeepSeek-V3
Technical Report", 2024, §3.2.1 "DualPipe and Computation-Communication Overlap").

DualPipe feeds micro-batches from both ends of the pipeline, like Chimera (Li & Hoefler, "Chimera:
Efficiently Training Large-Scale Neural Networks with Bidirectional Pipelines"), and runs a
forward chunk and a backward chunk of different micro-batches *together* so that one's
communication hides behind the other's computation. Its "V" variant (DeepSeek's open-source
``dualpipev``, torch 2.13's ``ScheduleDualPipeV``) cuts the two mirrored pipelines in half: P
workers, S = 2P stages in a V (:func:`~.placement.v_placement`: worker w holds stages w and
2P − 1 − w), one copy of the parameters instead of two.

Worker r, with chunk 0 = stage r and chunk 1 = stage 2P − 1 − r and N ≥ 2P micro-batches:

1. ``2(P − 1 − r)`` forwards of chunk 0;
2. ``r + 1`` times a forward of chunk 0 and one of chunk 1;
3. ``P − 1 − r`` times: input gradient of chunk 1, a pending weight gradient, forward of chunk 1
   (zero-bubble warm-up);
4. ``N − 2P + r + 1`` times the overlapped pairs (forward chunk 0 & backward chunk 1), (forward
   chunk 1 & backward chunk 0) — the last worker runs its very first pair one after the other;
5. ``P − 1 − r`` times a backward of chunk 1 and the pair (forward chunk 1 & backward chunk 0);
6. ``r + 1`` times the backwards of chunk 1 and chunk 0, switching to split backwards (input
   gradient only, the weight gradient deferred) half-way;
7. ``P − 1 − r`` times a pending weight gradient and a backward of chunk 0;
8. the remaining weight gradients.

An overlapped pair is two consecutive actions, the second with ``overlap=True`` (its text form
starts with ``&``). The simulator runs the two one after the other, so the time of a pair
``F&B`` is ``t_f + t_b`` there, and the report's bubble ``(PP/2 − 1)(F&B + B − 3W)`` (Table 2,
PP = 2P stages) reads ``(P − 1)(t_f + 2 t_b − 3 t_w)`` per worker.
"""

from __future__ import annotations

from collections import defaultdict, deque

from pipeline_recipes.strategies.schedules.actions import Action, Schedule
from pipeline_recipes.strategies.schedules.placement import v_placement
from pipeline_recipes.strategies.schedules.rules import GENERATOR, V_STAGES, Settings, at_least_twice_stages, check_size, raise_if

__all__ = ["dualpipev"]


def dualpipev(workers: int, micro_batches: int) -> Schedule:
    """DualPipeV on ``workers`` (P) workers, two stages each in a V (S = 2P); needs N ≥ 2P."""
    check_size("dualpipev", "workers (P)", workers)
    check_size("dualpipev", "micro_batches (N)", micro_batches)
    settings = Settings("dualpipev", workers, micro_batches, naming=GENERATOR)
    raise_if("dualpipev", at_least_twice_stages(settings, V_STAGES))  # the construction needs it too
    P, N = workers, micro_batches
    return Schedule("dualpipev", 2 * P, N, v_placement(P), tuple(_worker(P, N, r) for r in range(P)))


def _worker(P: int, N: int, r: int) -> tuple[Action, ...]:
    c0, c1 = r, 2 * P - 1 - r
    acts: list[Action] = []
    forwards: dict[int, int] = defaultdict(int)  # stage → next micro-batch to forward
    backwards: dict[int, int] = defaultdict(int)  # stage → next micro-batch to run backward (B or I)
    weights: deque[Action] = deque()  # W's of split backwards, oldest first

    def forward(stage: int) -> Action:
        forwards[stage] += 1
        return Action("F", 0, stage, (forwards[stage] - 1,))

    def backward(stage: int, split: bool = False, overlap: bool = False) -> Action:
        m = backwards[stage]
        backwards[stage] += 1
        if split:
            weights.append(Action("W", 0, stage, (m,)))
        return Action("I" if split else "B", 0, stage, (m,), overlap=overlap)

    def weight() -> None:
        if weights:
            acts.append(weights.popleft())

    def pair(f_stage: int, b_stage: int) -> None:  # forward & backward run together
        acts.extend((forward(f_stage), backward(b_stage, overlap=True)))

    acts += [forward(c0) for _ in range(2 * (P - 1 - r))]
    for _ in range(r + 1):
        acts += [forward(c0), forward(c1)]
    for _ in range(P - 1 - r):
        acts.append(backward(c1, split=True))
        weight()
        acts.append(forward(c1))
    for i in range(N - 2 * P + r + 1):
        if i == 0 and r == P - 1:  # not overlapped, to shorten the bubble (as DeepSeek's dualpipev)
            acts += [forward(c0), backward(c1)]
        else:
            pair(c0, c1)
        pair(c1, c0)
    for _ in range(P - 1 - r):
        acts.append(backward(c1))
        pair(c1, c0)
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        acts.append(backward(c1, split=split))
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        acts.append(backward(c0, split=split))
    for _ in range(P - 1 - r):
        weight()
        acts.append(backward(c0, split=split))
    while weights:
        weight()
    return tuple(acts)

