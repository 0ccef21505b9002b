"""Activation recomputation (GPipe re-materialization) and activation-memory accounting.

With recomputation a stage's forward runs without building a graph; only its input (the
boundary activation received from the previous stage) and the RNG state are kept. Its backward
first re-runs the forward with the same RNG state (so dropout draws the same masks), then
backpropagates: about one more forward per backward (Chimera §2 and §3.4: ``t_b ≈ 3 t_f``), for
activation memory of one boundary tensor per in-flight micro-batch instead of every layer's
saved tensors.

``recompute`` modes: ``none``; ``always`` (every stage); ``except_last`` (every stage but the
last, whose backward follows its forward immediately under 1F1B, so keeping its graph costs one
micro-batch of activations and saves a forward).

:class:`SavedBytes` measures what the executor keeps between a forward and its backward: the
bytes of the distinct non-parameter tensors autograd saves (via
:func:`torch.autograd.graph.saved_tensors_hooks`) plus the stage output kept for the backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pipeline_recipes.strategies.schedules.rules import RECOMPUTE_MODES



def recompute_stages(mode: str, stages: int) -> frozenset[int]:
    """The stage indices whose forwards are recomputed in backward under ``mode``."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    if mode == "none":
        return frozenset()
    if mode == "always":
        return frozenset(range(stages))
    return frozenset(range(stages - 1))


@dataclass(frozen=True)
class RngState:
    """The CPU (and, on an accelerator, that device's) RNG state before a forward."""

    cpu: Tensor
    device: torch.device
    accelerator: Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        accel = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), device, accel)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with this RNG state, then restore the current one (the stream is unchanged)."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.accelerator is not None:
                torch.cuda.set_rng_state(self.accelerator, self.device)
            yield


def storage_key(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class SavedBytes:
    """Counts the bytes of the distinct activation tensors autograd saves inside :meth:`track`.

    A tensor saved twice (or as a same-sized view) counts once; tensors in parameter storages
    (weights, and views of them such as a transposed weight) are not activations and are skipped.
    One instance per stage graph; ``nbytes`` is its total.
    """

    def __init__(self, parameter_storages: frozenset[int]) -> None:
        self._skip = parameter_storages
        self._seen: set[tuple[int, int]] = set()
        self.nbytes = 0

    def add(self, t: Tensor) -> None:
        key = (t.data_ptr(), t.numel())
        if key not in self._seen and storage_key(t) not in self._skip:
            self._seen.add(key)
            self.nbytes += t.numel() * t.element_size()

    def _pack(self, t: Tensor) -> Tensor:
        self.add(t)
        # detached: a saved *output* kept with its grad_fn would own the node that owns it, a cycle
        # the garbage collector cannot see, leaking any graph dropped without a backward
        # (pytorch/pytorch#115255); autograd restores the grad_fn on unpack
        return t.detach()

    @staticmethod
    def _unpack(t: Tensor) -> Tensor:
        return t

    @contextmanager
    def track(self) -> Iterator[SavedBytes]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def parameter_storages(params: Iterable[nn.Parameter]) -> frozenset[int]:
    return frozenset(storage_key(p) for p in params)
