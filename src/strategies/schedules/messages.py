"""The point-to-point messages a schedule implies, per ordered pair of workers (Chimera §3.1-3.2).

A forward of stage s < S-1 sends one activation per micro-batch to the worker of stage s+1; a
backward (``B``, or the input-gradient pass ``I`` of a split backward) of stage s > 0 sends one
activation gradient (per half, for backward halving) to the worker of stage s-1; a weight-gradient
pass ``W`` sends nothing. When both stages live on one worker (V placement, Zero Bubble Pipeline
Parallelism §3) the message is local: it never goes over the network (:func:`is_local`). NCCL ignores tags and matches a pair's sends and receives in order (first in,
first out); :func:`fifo_violations` lists the pairs whose consumption order differs from their send
order, which the communication rounds (:mod:`.comm`) handle by receiving in send order.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from pipeline_recipes.strategies.schedules.actions import Action, Schedule


class Message(NamedTuple):
    kind: str  # "act" (forward) or "grad" (backward)
    pipe: int
    stage: int  # the sending stage
    mb: int
    half: int | None = None


def sent_messages(action: Action, stages: int) -> list[tuple[int, Message]]:
    """(receiving stage, message) for every message ``action`` sends."""
    if action.kind == "F":
        return [(action.stage + 1, Message("act", action.pipe, action.stage, m))
                for m in action.mbs] if action.stage < stages - 1 else []
    if not action.sends_input_gradient:
        return []
    return [(action.stage - 1, Message("grad", action.pipe, action.stage, action.mb, action.half))
            ] if action.stage > 0 else []


def received_messages(action: Action, stages: int) -> list[tuple[int, Message]]:
    """(sending stage, message) for every message ``action`` consumes."""
    if action.kind == "F":
        return [(action.stage - 1, Message("act", action.pipe, action.stage - 1, m))
                for m in action.mbs] if action.stage > 0 else []
    if not action.sends_input_gradient:
        return []
    return [(action.stage + 1, Message("grad", action.pipe, action.stage + 1, action.mb, action.half))
            ] if action.stage < stages - 1 else []


def receiving_stage(message: Message) -> int:
    return message.stage + 1 if message.kind == "act" else message.stage - 1


def is_local(schedule: Schedule, message: Message) -> bool:
    """Whether the sending and the receiving stage of ``message`` live on the same worker."""
    row = schedule.placement[message.pipe]
    return row[message.stage] == row[receiving_stage(message)]


def pair_messages(schedule: Schedule) -> tuple[dict[tuple[int, int], list[Message]], dict[tuple[int, int], list[Message]]]:
    """(sends, receives): for each (source worker, destination worker), messages in program order
    of the source (sends) and of the destination (receives); local messages are left out."""
    place, D = schedule.placement, schedule.stages
    sends: dict[tuple[int, int], list[Message]] = defaultdict(list)
    receives: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for worker, actions in enumerate(schedule.workers):
        for a in actions:
            for stage, msg in sent_messages(a, D):
                if place[a.pipe][stage] != worker:
                    sends[(worker, place[a.pipe][stage])].append(msg)
            for stage, msg in received_messages(a, D):
                if place[a.pipe][stage] != worker:
                    receives[(place[a.pipe][stage], worker)].append(msg)
    return dict(sends), dict(receives)


def fifo_violations(schedule: Schedule) -> list[tuple[int, int]]:
    """Worker pairs (src, dst) whose send order differs from dst's consumption order."""
    sends, receives = pair_messages(schedule)
    return sorted(pair for pair in set(sends) | set(receives) if sends.get(pair, []) != receives.get(pair, []))
