"""Data dependencies between actions (Chimera §3.1): the one definition shared by the
generators' merge, the validator, the simulator and the runtime.

* A forward of stage ``s > 0`` needs the forward of stage ``s - 1`` on the same micro-batches.
* A backward needs its own stage's forward, and (below the last stage) the same backward
  (same micro-batch, same half) of stage ``s + 1``.
"""

from __future__ import annotations

from collections.abc import Iterable

from .actions import Action


def forward_index(actions: Iterable[Action]) -> dict[tuple[int, int, int], Action]:
    """(pipe, stage, micro-batch) → the forward action that covers it."""
    index: dict[tuple[int, int, int], Action] = {}
    for a in actions:
        if a.kind == "F":
            for m in a.mbs:
                index[(a.pipe, a.stage, m)] = a
    return index


def dependencies(
    action: Action, forwards: dict[tuple[int, int, int], Action], stages: int
) -> list[Action | None]:
    """The actions ``action`` waits for; ``None`` marks a dependency that no action provides."""
    if action.kind == "F":
        if action.stage == 0:
            return []
        deps = {forwards.get((action.pipe, action.stage - 1, m)) for m in action.mbs}
        return list(deps)
    deps: list[Action | None] = [forwards.get((action.pipe, action.stage, action.mb))]
    if action.stage < stages - 1:
        deps.append(Action("B", action.pipe, action.stage + 1, action.mbs, action.half))
    return deps
