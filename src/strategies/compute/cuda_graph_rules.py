"""What ``strategy.cuda_graphs`` cannot capture, as one rule with a message (the setting, the value, the rule and
the fix): the launcher refuses it before any process starts (:mod:`pipeline_recipes.recipe.check.settings`, which must not
import torch) and the engine for direct users (:func:`pipeline_recipes.strategies.runtime.rank_setup.check_layout`).
Why each case cannot be captured: :mod:`pipeline_recipes.strategies.compute.cuda_graphs`.
"""

from __future__ import annotations

from typing import Any

from pipeline_recipes.strategies.schedules import Schedule, ScheduleSpec, specs
from pipeline_recipes.strategies.schedules.rules import Refusal


def cuda_graphs_error(value: Any, spec: ScheduleSpec, recompute: str, schedule: Schedule) -> Refusal | None:
    """Why ``strategy.cuda_graphs = value`` cannot run ``schedule`` (of ``spec``) with ``strategy.recompute``, or
    None: a captured graph replays fixed addresses and shapes, and its backward computes every gradient at once.
    The refusal's ``changes`` name the settings a fix may change (``cuda_graphs`` among them)."""
    if not isinstance(value, bool):
        return Refusal(f"strategy.cuda_graphs = {value!r} is not true or false (whether each repeated block's forward "
                       "and backward are captured as CUDA graphs)",
                       "set strategy.cuda_graphs=true or strategy.cuda_graphs=false", ("cuda_graphs",))
    if not value:
        return None
    off = "or set strategy.cuda_graphs=false"
    if spec.asynchronous:
        synchronous = tuple(s.name for s in specs() if not s.asynchronous)
        return Refusal(f"strategy.cuda_graphs = true with strategy={spec.name}: an asynchronous schedule runs its "
                       "forwards on stashed weight versions whose parameter storage changes every step, while a CUDA "
                       "graph replays the addresses it captured (a synchronous schedule keeps them)",
                       f"use a synchronous schedule ({', '.join(synchronous)}) {off}", ("cuda_graphs",), synchronous)
    if recompute != "none":
        return Refusal(f"strategy.cuda_graphs = true with strategy.recompute = {recompute}: a recomputed stage keeps "
                       "no graph between its forward and its backward and replays its forward later under the saved "
                       "RNG state, which a captured graph cannot do", f"set strategy.recompute=none {off}",
                       ("recompute", "cuda_graphs"))
    actions = [a for acts in schedule.workers for a in acts]
    if any(a.kind == "I" for a in actions):
        others = tuple(s.name for s in specs() if not s.asynchronous and s.name != spec.name)  # checked by whoever
        return Refusal(f"strategy.cuda_graphs = true with strategy={spec.name}: it splits backwards into I and W (Zero "
                       "Bubble Pipeline Parallelism §2), but a captured backward computes the weight gradients "
                       "together with the input gradient, so W would find nothing to do (schedules with whole "
                       "backwards, B rather than I and W, can be captured)",
                       f"use a schedule with whole backwards (B, not I and W) {off}", ("cuda_graphs",), others)
    if any(a.half is not None for a in actions):
        return Refusal(f"strategy.cuda_graphs = true with strategy={spec.name} and concat = backward_halving: the "
                       "halved backwards run half micro-batches, a second shape the graphs were not captured for",
                       f"set strategy.concat=direct or strategy.concat=forward_doubling {off}",
                       ("concat", "cuda_graphs"))
    return None

