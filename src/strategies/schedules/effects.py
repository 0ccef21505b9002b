"""What each action does to the graphs its stage keeps: the one definition the executor runs and the
planner's memory walk (:mod:`pipeline_recipes.planner.memory`) prices.

A forward keeps one graph per micro-batch it covers (two for a doubled forward, Chimera §3.5), or
two half graphs when the micro-batch's backward is halved. ``B`` walks a graph and frees it,
computing input and weight gradients; the split backward of Zero Bubble Pipeline Parallelism (§2)
divides that work: ``I`` walks the graph for the input gradient and keeps, per linear layer, the
input and output gradient that its weight gradient needs (:mod:`pipeline_recipes.strategies.compute.deferred_weights`); ``W``
computes those weight gradients and frees what was kept. Both are counted as one graph until ``W``.
The first stage sends no input gradient, but its ``I`` still walks the graph for the gradients inside
the stage, and its ``W`` computes the weight gradients, at the costs the paper's schedules assume
(torch.distributed.pipelining instead runs the first stage's whole backward in ``W``, which moves
``t_b − t_w`` of work per micro-batch to wherever the schedule put its ``W``: the end of the step, in
Chimera + zero bubble).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from pipeline_recipes.strategies.schedules.actions import Action

GraphKey = tuple[int, int, int | None]  # pipe, micro-batch, half


@dataclass(frozen=True)
class GraphEffect:
    stage: int
    keeps: tuple[GraphKey, ...] = ()  # graphs saved (forward)
    walks: tuple[GraphKey, ...] = ()  # graphs a backward pass runs through
    frees: tuple[GraphKey, ...] = ()  # graphs released afterwards
    input_gradient: bool = False  # computes (and sends) the gradient of the stage's input
    weight_gradient: bool = False  # computes the stage's weight gradients


def graph_effect(action: Action, halved: Collection[int]) -> GraphEffect:
    """``action``'s effect; ``halved``: the micro-batches whose backward runs in two halves."""
    if action.kind == "F":
        keys = tuple((action.pipe, mb, half) for mb in action.mbs
                     for half in ((0, 1) if mb in halved else (None,)))
        return GraphEffect(action.stage, keeps=keys)
    key = ((action.pipe, action.mb, action.half),)
    first = action.stage == 0
    if action.kind == "B":
        return GraphEffect(action.stage, walks=key, frees=key, input_gradient=not first, weight_gradient=True)
    if action.kind == "I":
        return GraphEffect(action.stage, walks=key, input_gradient=not first)
    return GraphEffect(action.stage, walks=key, frees=key, input_gradient=False, weight_gradient=True)
