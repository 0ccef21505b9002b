"""Weight gradients computed later: how a stage splits its backward into ``I`` and ``W``.

Zero Bubble Pipeline Parallelism (Qi et al. 2024), §2: the backward of a linear layer is two matrix
products, one for the gradient of its input and one for the gradient of its weight, and only the
first lies on the path to the previous stage. So ``I`` runs the stage's backward once, in full,
except that every linear layer (``nn.Linear``, GPT-2's ``Conv1D``) only keeps its input and its
output gradient for the micro-batch instead of multiplying them; ``W`` multiplies what was kept
into the weight gradients, accumulated in ``.grad``. Biases, norms and embeddings get their small
gradients during ``I``; a module may take part by exposing a ``weight_store`` attribute and deferring
its own work (:class:`pipeline_recipes.strategies.harness.emulated.EmulatedStage` does). A deferred weight gradient is added to
``.grad`` directly: hooks registered on such a weight (``register_post_accumulate_grad_hook``) fire
during ``I``, before it has its gradient (this repository's gradient synchronisation follows the
schedule's actions instead, :mod:`pipeline_recipes.strategies.runtime.grad_sync`).

This is one backward pass and then a list of matrix products. torch.distributed.pipelining splits
any graph instead (``stage_backward_input``/``stage_backward_weight``): it walks the autograd graph
in Python on every ``I`` and calls ``autograd.grad`` once per parameter group on every ``W``, which
on this repository's benchmark model cost more than the bubble the split removes.

Under autocast the layer multiplies as autocast would: autocast casts the weight (one cached copy per
autocast region, shared by every micro-batch, as for an unpatched layer) and the layer keeps the
input's cast and the weight itself; the backward casts the weight again for the input gradient, and
the deferred weight gradient is cast to the weight's dtype, as autograd's cast node would.
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
        """Within it, backward passes defer their weight-gradient work under ``key`` (an ``I``);
        a backward that raises defers nothing."""
        if key in self._pending or self._collecting is not None:
            raise RuntimeError(f"weight gradients of {key} are already deferred: each I runs once, before its W")
        self._collecting = collected = []
        try:
            yield
        finally:
            self._collecting = None
        self._pending[key] = collected

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
        """The keys whose ``I`` ran and whose ``W`` has not (none after a synchronous step)."""
        return list(self._pending)


def accumulate(parameter: Tensor, grad: Tensor) -> None:
    """Add ``grad`` (cast to the parameter's dtype, as autograd's cast node would) into ``.grad``."""
    grad = grad.to(parameter.dtype)
    if parameter.grad is None:
        parameter.grad = grad
    else:
        parameter.grad.add_(grad)


def accumulate_product(parameter: Tensor, a: Tensor, b: Tensor) -> None:
    """Add ``a @ b`` into ``parameter.grad``: in place, in one product, where the gradient exists in
    the product's dtype (a gradient bucket's view stays that view); else as :func:`accumulate`."""
    grad = parameter.grad
    if grad is not None and grad.dtype == a.dtype:
        grad.addmm_(a, b)
    else:
        accumulate(parameter, a @ b)


class _Linear(torch.autograd.Function):
    """``y = x Wᵀ + b`` (``nn.Linear``) or ``y = x W + b`` (``Conv1D``, ``transposed``) whose weight
    gradient goes to ``module.weight`` later when the module's store is collecting. The forward runs
    under the caller's autocast state (its cached weight cast); the backward casts ``weight`` to the
    output gradient's dtype."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, module: nn.Module,
                transposed: bool) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.transposed, ctx.has_bias = module, transposed, bias is not None
        if not transposed:
            return F.linear(x, weight, bias)
        size_out = x.size()[:-1] + (weight.size(-1),)  # as transformers' Conv1D computes it
        flat = x.view(-1, x.size(-1))
        out = torch.addmm(bias, flat, weight) if bias is not None else torch.mm(flat, weight)
        return out.view(size_out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        transposed = ctx.transposed
        grad_x = None
        if ctx.needs_input_grad[0]:
            cast = weight.to(grad.dtype)
            grad_x = grad @ (cast.t() if transposed else cast)
        grad_b = grad.reshape(-1, grad.size(-1)).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            parameter = ctx.module.weight
            store: WeightGradientStore = ctx.module._weight_store

            def factors() -> tuple[Tensor, Tensor]:
                """The weight gradient is ``a @ b``."""
                g, inp = grad.reshape(-1, grad.size(-1)), x.reshape(-1, x.size(-1)).to(grad.dtype)
                return (inp.t(), g) if transposed else (g.t(), inp)

            if not store.defer(lambda: accumulate_product(parameter, *factors())):
                a, b = factors()
                grad_w = a @ b
        return grad_x, grad_w, grad_b, None, None


def _deferring_forward(module: nn.Module, x: Tensor, transposed: bool,
                       plain: Callable[[nn.Module, Tensor], Tensor]) -> Tensor:
    """The layer's output through :class:`_Linear` where a gradient may be deferred, else ``plain``'s;
    the input cast as autocast would hand it to a matrix product (float64 and non-floats left alone).
    Eager inside a compiled block (:mod:`pipeline_recipes.strategies.compute.compile`): traced, the deferral
    would be decided once, when the backward is compiled, and ``W`` would find nothing to do."""
    if torch.compiler.is_compiling():
        return _eager_deferring_forward(module, x, transposed, plain)
    if not (torch.is_grad_enabled() and module.weight.requires_grad):
        return plain(module, x)
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.float64:
        x = x.to(torch.get_autocast_dtype(device))
    return _Linear.apply(x, module.weight, module.bias, module, transposed)


_eager_deferring_forward = torch.compiler.disable(_deferring_forward)


class DeferringLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient a :class:`WeightGradientStore` may defer (prints as ``Linear``)."""

    _weight_store: WeightGradientStore

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.Linear's name)
        return _deferring_forward(self, input, False, nn.Linear.forward)

    def _get_name(self) -> str:
        return "Linear"


def _deferring_conv1d() -> type:
    """transformers' ``Conv1D`` (weight stored transposed) deferring its weight gradient, made on first
    use so that this module does not import transformers; pickled by name (``DeferringConv1D``)."""
    if "DeferringConv1D" not in globals():
        from transformers.pytorch_utils import Conv1D  # local: transformers ≥1.0 s (python -X importtime)

        def forward(self: nn.Module, x: Tensor) -> Tensor:
            return _deferring_forward(self, x, True, Conv1D.forward)

        globals()["DeferringConv1D"] = type("DeferringConv1D", (Conv1D,), {
            "forward": forward, "_get_name": lambda self: "Conv1D", "__module__": __name__,
            "__doc__": "transformers' ``Conv1D`` whose weight gradient a store may defer (prints as ``Conv1D``).",
        })
    return globals()["DeferringConv1D"]


def __getattr__(name: str) -> Any:  # PEP 562: unpickling a patched GPT-2 finds its class
    if name == "DeferringConv1D":
        return _deferring_conv1d()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _deferring_class(module: nn.Module) -> type | None:
    """The deferring class for ``module``: exactly ``nn.Linear`` or transformers' ``Conv1D`` (not their
    subclasses: they may compute differently); ``None`` for any other module."""
    if type(module) is nn.Linear:
        return DeferringLinear
    utils = sys.modules.get("transformers.pytorch_utils")  # loaded by any model that builds a Conv1D
    if utils is not None and type(module) is getattr(utils, "Conv1D", None):
        return _deferring_conv1d()
    return None


def is_deferring(module: nn.Module) -> bool:
    """Whether ``module``'s class was swapped for its deferring one (:func:`defer_weight_gradients`)."""
    return type(module) is DeferringLinear or type(module) is globals().get("DeferringConv1D")


def defer_weight_gradients(layers: Sequence[nn.Module], store: WeightGradientStore) -> int:
    """Make the linear layers of ``layers`` (and modules with a ``weight_store`` attribute) defer their
    weight gradients to ``store`` while it collects; returns how many modules take part. Applied again,
    the modules defer to the new store."""
    count = 0
    for layer in layers:
        for module in layer.modules():
            if hasattr(module, "weight_store"):
                module.weight_store = store
                count += 1
                continue
            if not is_deferring(module):
                deferring = _deferring_class(module)
                if deferring is None:
                    continue
                module.__class__ = deferring
            module._weight_store = store
            count += 1
    return count


__all__ = ["DeferringLinear", "WeightGradientStore", "accumulate", "accumulate_product", "defer_weight_gradients",
           "is_deferring"]
