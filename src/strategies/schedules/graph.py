"""Data dependencies between actions (Chimera §3.1; Zero Bubble Pipeline Parallelism §2): the one
definition shared by the generators' merge, the validator, the simulator, the communication plan
and the runtime.

* A forward of stage ``s > 0`` needs the forward of stage ``s - 1`` on the same micro-batches.
* A backward ``B`` or input-gradient pass ``I`` needs its own stage's forward, and (below the last
  stage) the pass of stage ``s + 1`` that produced the gradient of its output: that stage's ``B``
  or ``I`` on the same micro-batch (and half).
* A weight-gradient pass ``W`` needs its own stage's ``I``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipeline_recipes.strategies.schedules.actions import Action

ForwardKey = tuple[int, int, int]  # pipe, stage, micro-batch
BackwardKey = tuple[int, int, int, int | None]  # pipe, stage, micro-batch, half


@dataclass(frozen=True)
class ActionIndex:
    """Who provides what: the forward covering each (pipe, stage, micro-batch) and the ``B`` or
    ``I`` producing the input gradient of each (pipe, stage, micro-batch, half)."""

    forwards: dict[ForwardKey, Action]
    input_grads: dict[BackwardKey, Action]


def index_actions(actions: Iterable[Action]) -> ActionIndex:
    forwards: dict[ForwardKey, Action] = {}
    input_grads: dict[BackwardKey, Action] = {}
    for a in actions:
        if a.kind == "F":
            for m in a.mbs:
                forwards[(a.pipe, a.stage, m)] = a
        elif a.sends_input_gradient:
            input_grads[(a.pipe, a.stage, a.mb, a.half)] = a
    return ActionIndex(forwards, input_grads)


def dependencies(action: Action, index: ActionIndex, stages: int) -> list[Action | None]:
    """The actions ``action`` waits for; ``None`` marks a dependency that no action provides."""
    if action.kind == "F":
        if action.stage == 0:
            return []
        return list({index.forwards.get((action.pipe, action.stage - 1, m)) for m in action.mbs})
    if action.kind == "W":
        return [index.input_grads.get((action.pipe, action.stage, action.mb, action.half))]
    deps: list[Action | None] = [index.forwards.get((action.pipe, action.stage, action.mb))]
    if action.stage < stages - 1:
        deps.append(index.input_grads.get((action.pipe, action.stage + 1, action.mb, action.half)))
    return deps
