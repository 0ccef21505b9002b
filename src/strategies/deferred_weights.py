"""Weight gradients computed later: how a stage splits its backward into ``I`` and ``W``.

Zero Bubble Pipeline Parallelism (Qi et al. 2024), §2: the backward of a linear layer is two matrix
products, one for the gradient of its input and one for the gradient of its weight, and only the
first lies on the path to the previous stage. So ``I`` runs the stage's backward once, in full,
except that every linear layer (``nn.Linear``, GPT-2's ``Conv1D``) only keeps its input and its
output gradient for the micro-batch instead of multiplying them; ``W`` multiplies what was kept
into the weight gradients, accumulated in ``.grad``. Biases, norms and embeddings get their small
gradients during ``I``; a module may take part by exposing a ``weight_store`` attribute and deferring
its own work (:class:`strategies.emulated.EmulatedStage` does).

This is one backward pass and then a list of matrix products. torch.distributed.pipelining splits
any graph instead (``stage_backward_input``/``stage_backward_weight``): it walks the autograd graph
in Python on every ``I`` and calls ``autograd.grad`` once per parameter group on every ``W``, which
on this repository's benchmark model cost more than the bubble the split removes.

Under autocast the layer casts its input and weight as autocast would (to the autocast dtype, the
casts recorded by autograd) and multiplies with autocast off; the deferred weight gradient is cast to
the weight's dtype, as autograd's cast node would.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable


class WeightGradientStore:
    """Weight-gradient work deferred by the backward passes of one stage, per micro-batch key."""

    def __init__(self) -> None:
        self._pending: dict[Hashable, list[Callable[[], None]]] = {}
        self._collecting: list[Callable[[], None]] | None = None

    @contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Within it, backward passes defer their weight-gradient work under ``key`` (an ``I``)."""
        if key in self._pending or self._collecting is not None:
            raise RuntimeError(f"weight gradients of {key} are already deferred: each I runs once, before its W")
        self._collecting = []
        try:
            yield
        finally:
            self._pending[key], self._collecting = self._collecting, None

    def defer(self, work: Callable[[], None]) -> bool:
        """Keep ``work`` for the key being collected; False (the caller does it now) outside :meth:`deferring`."""
        if self._collecting is None:
            return False
        self._collecting.append(work)
        return True

    def run(self, key: Hashable) -> None:
        """``W``: the work deferred under ``key``, in the order the backward deferred it."""
        if key not in self._pending:
            raise RuntimeError(f"W of {key} before its I: nothing was deferred under it")
        with torch.no_grad():  # gradients, as inside the backward that deferred them
            for work in self._pending.pop(key):
                work()

    @property
    def pending(self) -> list[Hashable]:
        return list(self._pending)


def accumulate(parameter: Tensor, grad: Tensor) -> None:
    """Add ``grad`` (cast to the parameter's dtype, as autograd's cast node would) into ``.grad``."""
    grad = grad.to(parameter.dtype)
    if parameter.grad is None:
        parameter.grad = grad
    else:
        parameter.grad.add_(grad)


class _Linear(torch.autograd.Function):
    """``y = x Wᵀ + b`` (``nn.Linear``) or ``y = x W + b`` (``Conv1D``, ``transposed``) whose weight
    gradient goes to ``module.weight`` later when the module's store is collecting."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, module: nn.Module,
                transposed: bool) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.transposed, ctx.has_bias = module, transposed, bias is not None
        if not transposed:
            return F.linear(x, weight, bias)
        size_out = x.size()[:-1] + (weight.size(-1),)  # as transformers' Conv1D computes it
        flat = x.view(-1, x.size(-1))
        out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
        return out.view(size_out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        transposed = ctx.transposed
        grad_x = grad @ (weight.t() if transposed else weight) if ctx.needs_input_grad[0] else None
        grad_b = grad.reshape(-1, grad.size(-1)).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            parameter = ctx.module.weight
            store: WeightGradientStore = ctx.module._weight_store

            def weight_gradient() -> Tensor:
                g, inp = grad.reshape(-1, grad.size(-1)), x.reshape(-1, x.size(-1))
                return inp.t() @ g if transposed else g.t() @ inp

            if not store.defer(lambda: accumulate(parameter, weight_gradient())):
                grad_w = weight_gradient()
        return grad_x, grad_w, grad_b, None, None


def _deferred_forward(self: nn.Module, x: Tensor) -> Tensor:
    weight, bias = self.weight, self.bias
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return self._plain_forward(x)
    device = x.device.type
    if torch.is_autocast_enabled(device):  # cast as autocast would, then multiply with it off
        dtype = torch.get_autocast_dtype(device)
        x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return _Linear.apply(x, weight, bias, self, self._transposed)
    return _Linear.apply(x, weight, bias, self, self._transposed)


_DEFERRING_CLASSES: dict[type, type] = {}


def _deferring_class(base: type, transposed: bool) -> type:
    """``base`` with the forward above (same name, so reprs and checks read as before)."""
    if base not in _DEFERRING_CLASSES:
        _DEFERRING_CLASSES[base] = type(base.__name__, (base,), {
            "forward": _deferred_forward, "_plain_forward": base.forward, "_transposed": transposed,
            "__module__": base.__module__, "__qualname__": base.__qualname__,
        })
    return _DEFERRING_CLASSES[base]


def _linear_kind(module: nn.Module) -> bool | None:
    """``False`` for ``nn.Linear``, ``True`` for transformers' ``Conv1D`` (weight stored transposed),
    ``None`` otherwise (subclasses too: they may compute differently)."""
    if type(module) is nn.Linear:
        return False
    utils = sys.modules.get("transformers.pytorch_utils")  # loaded by any model that builds a Conv1D
    if utils is not None and type(module) is getattr(utils, "Conv1D", None):
        return True
    return None


def defer_weight_gradients(layers: Sequence[nn.Module], store: WeightGradientStore) -> int:
    """Make the linear layers of ``layers`` (and modules with a ``weight_store`` attribute) defer their
    weight gradients to ``store`` while it collects; returns how many modules take part."""
    count = 0
    for layer in layers:
        for module in layer.modules():
            if hasattr(module, "weight_store"):
                module.weight_store = store
                count += 1
                continue
            if type(module) not in _DEFERRING_CLASSES.values():
                kind = _linear_kind(module)
                if kind is None:
                    continue
                module.__class__ = _deferring_class(type(module), kind)
            module._weight_store = store
            count += 1
    return count


__all__ = ["WeightGradientStore", "accumulate", "defer_weight_gradients"]
