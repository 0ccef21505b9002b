"""Weight stashing for the asynchronous schedules (PipeDream, PipeDream-2BW; Chimera Table 2).

At the start of step ``t`` the live weights of this rank's stages are copied into version ``t``;
every forward of the step runs on that copy (the layers' parameters are swapped for it), so the
graph each backward walks holds exactly the weights its forward used, also when the backward runs
steps later, after the live weights were updated. A version's gradients accumulate on its copy.
At the end of step ``t`` stage ``s`` hands version ``t - delay(s)``'s gradient to the live
parameters (for the optimizer) and frees it (:func:`pipeline_recipes.strategies.schedules.asynchronous.weight_delay`).
A parameter tied across stages (GPT-2's embeddings on the first and last stage) takes the largest
delay of its stages, so both copies get the same summed gradient at the same step and stay equal.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from pipeline_recipes.strategies.schedules.asynchronous import weight_delay

Slot = tuple[nn.Module, str]  # a module and the name of one of its parameters


class WeightVersions:
    """The stashed weight versions of this rank's stages."""

    def __init__(self, schedule: str, stages: int, stage_layers: Mapping[int, Sequence[nn.Module]],
                 tied_delay: Mapping[int, int] | None = None) -> None:
        self.schedule, self.stages = schedule, stages
        self.tied_delay = dict(tied_delay or {})  # id(parameter) → its delay, for tied parameters
        self.slots: dict[int, list[Slot]] = {}
        self.live: dict[int, list[nn.Parameter]] = {}  # per stage, distinct parameters in slot order
        for stage, layers in stage_layers.items():
            slots = [(m, n) for layer in layers for m in layer.modules() for n, p in m._parameters.items()
                     if p is not None]
            self.slots[stage] = slots
            self.live[stage] = list({id(m._parameters[n]): m._parameters[n] for m, n in slots}.values())
        self.versions: dict[int, dict[int, dict[int, Tensor]]] = {s: {} for s in self.slots}  # stage → step → copies
        self.step: int | None = None

    def begin_step(self, step: int) -> None:
        """Copy the live weights into version ``step``; this step's forwards use it."""
        self.step = step
        for stage, params in self.live.items():
            self.versions[stage][step] = {id(p): p.detach().clone().requires_grad_(p.requires_grad) for p in params}

    @contextmanager
    def forward_weights(self, stage: int) -> Iterator[None]:
        """Run ``stage``'s layers on the current version instead of the live parameters."""
        copies = self.versions[stage][self.step]
        saved = [(m, n, m._parameters[n]) for m, n in self.slots[stage]]
        try:
            for m, n, p in saved:
                m._parameters[n] = copies[id(p)]
            yield
        finally:
            for m, n, p in saved:
                m._parameters[n] = p

    def end_step(self, step: int) -> tuple[bool, bool]:
        """Give each live parameter the gradient of its version ``step - delay`` (left unset, so no
        update, when none is due yet) and free what no later step needs. Returns whether stage
        gradients and whether tied gradients are due."""
        stage_due = tied_due = False
        for stage, params in self.live.items():
            store = self.versions[stage]
            for p in params:
                delay = self.tied_delay.get(id(p), weight_delay(self.schedule, stage, self.stages))
                copy = store.get(step - delay, {}).pop(id(p), None)
                p.grad = None if copy is None else (copy.grad if copy.grad is not None else torch.zeros_like(p))
                if copy is not None and id(p) in self.tied_delay:
                    tied_due = True
                elif copy is not None:
                    stage_due = True
            for version in [v for v, copies in store.items() if not copies]:
                del store[version]
        return stage_due, tied_due

    def in_memory(self, stage: int) -> int:
        """How many versions of ``stage`` are stashed now (the live weights not counted)."""
        return len(self.versions[stage])
