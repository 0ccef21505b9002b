"""When each action of a step ran: the measured timeline (bubbles, timeline pictures; Chimera §4).

A box starts once the action's inputs have arrived (waiting for a peer is a bubble, not work) and
ends after its last operation. On CPU the boxes are host wall-clock times. On a GPU the host only
enqueues kernels, so host times would measure launches: there each box is a pair of CUDA events on
the current stream (the start recorded after the stream waited for the receives), converted to
host-clock seconds when read, through a reference event the host waited for: taken again once
a minute (CUDA reports elapsed times as float32 milliseconds, which would blur over hours), so there
is no host synchronisation per step or per action, only when a timeline is read.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pipeline_recipes.strategies.schedules import Action


REFERENCE_MAX_AGE_S = 60.0  # float32 milliseconds resolve about 4 µs at a minute


class ActionClock:
    """Records (action, start, end) boxes of one step on one rank."""

    def __init__(self, device: torch.device, reference: tuple[Any, float] | None = None) -> None:
        """``reference``: (a completed CUDA event, the host time it completed), from :meth:`reference_of`;
        shared by the steps of a run, so a step starts without waiting for the device."""
        self.cuda = device.type == "cuda"
        self._boxes: list[tuple[Action, Any, Any]] = []
        self._resolved: list[tuple[Action, float, float]] | None = None
        if self.cuda:
            self._reference, self._host = reference if reference is not None else self.reference_of(device)

    @staticmethod
    def reference_of(device: torch.device, current: tuple[Any, float] | None = None,
                     max_age_s: float = REFERENCE_MAX_AGE_S) -> tuple[Any, float] | None:
        """``current`` while younger than ``max_age_s``, else a new CUDA event the host waited for, and
        the host time it did (``None`` off CUDA)."""
        if device.type != "cuda":
            return None
        if current is not None and time.perf_counter() - current[1] < max_age_s:
            return current
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        return event, time.perf_counter()

    def now(self) -> Any:
        """A start or end mark: a host time, or a CUDA event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def box(self, action: Action, start: Any) -> None:
        self._boxes.append((action, start, self.now()))
        self._resolved = None

    def timeline(self) -> list[tuple[Action, float, float]]:
        """The boxes in host-clock seconds (on a GPU this waits for the step's last box to finish)."""
        if self._resolved is None:
            if not self.cuda:
                self._resolved = list(self._boxes)
            else:
                if self._boxes:
                    self._boxes[-1][2].synchronize()
                at = lambda event: self._host + self._reference.elapsed_time(event) / 1e3  # noqa: E731
                self._resolved = [(a, at(s), at(e)) for a, s, e in self._boxes]
        return self._resolved
