"""Weight stashing for the asynchronous schedules (PipeDream, PipeDream-2BW; Chimera Table 2).

At the start of step ``t`` the live weights of this rank's stages are copied into version ``t``;
every forward of the step runs on that copy (the layers' parameters are swapped for it), so the
graph each backward walks holds exactly the weights its forward used, also when the backward runs
steps later, after the live weights were updated. A version's gradients accumulate on its copy.
At the end of step ``t`` stage ``s`` hands version ``t - delay(s)``'s gradient to the live
parameters (for the optimizer) and frees that version
(:func:`strategies.schedules.asynchronous.weight_delay`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .schedules.asynchronous import weight_delay

Slot = tuple[nn.Module, str]  # a module and the name of one of its parameters


class WeightVersions:
    """The stashed weight versions of this rank's stages."""

    def __init__(self, schedule: str, stages: int, stage_layers: Mapping[int, Sequence[nn.Module]]) -> None:
        self.schedule, self.stages = schedule, stages
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

    def end_step(self, step: int) -> bool:
        """Give the live parameters the gradient of version ``step - delay`` and free it; ``False``
        (gradients left unset, no update) when no version is due yet."""
        applied = False
        for stage, params in self.live.items():
            due = step - weight_delay(self.schedule, stage, self.stages)
            copies = self.versions[stage].pop(due, None)
            for p in params:
                grad = None if copies is None else copies[id(p)].grad
                p.grad = None if copies is None else (grad if grad is not None else torch.zeros_like(p))
            applied = applied or copies is not None
        return applied

    def in_memory(self, stage: int) -> int:
        """How many versions of ``stage`` are stashed now (the live weights not counted)."""
        return len(self.versions[stage])
