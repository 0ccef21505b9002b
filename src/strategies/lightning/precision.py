"""Mixed precision for the recipe's Trainer: Lightning's ``MixedPrecision``, which also clips the
gradients of a fused optimizer under ``bf16-mixed``.

Lightning refuses to clip the gradients of an optimizer that unscales them inside its own step
(torch's ``fused=True`` AdamW, Adam and SGD): under fp16 the gradients it would clip still carry the
loss scale of the GradScaler ("Mixed Precision Training", Micikevicius et al., §3.2), and only the
fused step divides it out. bf16 autocast keeps fp32's exponent range and needs no loss scale
("A Study of BFLOAT16 for Deep Learning Training", Kalamkar et al., abstract): its gradients are the true
ones, so clipping them by their global norm ("On the difficulty of training recurrent neural
networks", Pascanu et al., §3.2) before the fused step is the same operation as in fp32, for every
optimizer. :class:`ClippingMixedPrecision` does that when it has no scaler and keeps Lightning's
behaviour (unscale, then clip; refuse a fused optimizer) when it has one; the launcher refuses fp16
with a fused optimizer and clipping before any process starts (``pipeline_recipes.recipe.check.accelerator.check_precision``).

The pipeline strategies clip by the norm through their engine (the global norm over all stages) and
reach this plugin only for ``gradient_clip_algorithm=value``; the baselines (``single``, ``ddp``)
clip here, after DDP's all-reduce, so by the global norm too.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer
from typing_extensions import override

BF16_MIXED = ("bf16-mixed", "bf16")  # Lightning's spellings of bf16 autocast (no loss scaler)


class ClippingMixedPrecision(MixedPrecision):
    """``MixedPrecision`` whose clipping works for every optimizer when there is no loss scaler (bf16)."""

    @override
    def clip_gradients(self, optimizer: Optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if self.scaler is None:  # the gradients are unscaled: clip as in fp32, whichever optimizer steps them
            Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        else:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)


def autocast_device(accelerator: str) -> str:
    """``torch.autocast``'s device type for a Trainer ``accelerator`` (as Lightning maps it)."""
    if accelerator in ("cpu", "mps"):
        return accelerator
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda"


def with_precision_plugin(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Trainer arguments with ``precision`` = ``bf16-mixed`` handed over as a :class:`ClippingMixedPrecision`
    in ``plugins`` (Lightning takes a precision or a precision plugin, not both); other precisions unchanged."""
    if str(kwargs.get("precision")) not in BF16_MIXED:
        return kwargs
    plugins = kwargs.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    out = {key: value for key, value in kwargs.items() if key != "precision"}
    device = autocast_device(str(kwargs.get("accelerator", "auto")))
    out["plugins"] = [*plugins, ClippingMixedPrecision("bf16-mixed", device)]
    return out
