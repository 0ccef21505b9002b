"""Optimizer parameter groups and learning-rate schedules with warm-up (``conf/optim``, ``conf/scheduler``).

* :func:`param_groups`: weight decay on the weight matrices only; biases and normalisation weights
  (every parameter of fewer than two dimensions, and those of ``*Norm`` modules) go to a second group
  with ``weight_decay = 0`` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization"; the
  convention of GPT-2/3 training code). Both groups always exist, also on a pipeline rank whose
  stages hold no parameter of one of them, so optimizer checkpoints line up across layouts.
* :class:`WarmupDecayLR`: linear warm-up over ``warmup_steps``, then a constant, cosine ("SGDR:
  Stochastic Gradient Descent with Warm Restarts", without restarts) or linear decay to
  ``min_lr_ratio`` times the peak at ``total_steps``. The factor is a closed form of the step count,
  so a resumed run continues the schedule exactly from the restored step.

The Hydra configs instantiate these with ``_partial_: true``;
:class:`~pipeline_recipes.strategies.lightning.strategy.PipelineModule` completes them with the parameter groups, the optimizer
and the run's number of steps.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from typing_extensions import override

DECAYS = ("constant", "cosine", "linear")

OptimizerFactory = Callable[[Iterable[Any]], Optimizer]  # params or parameter groups -> optimizer
SchedulerFactory = Callable[..., LRScheduler]  # optimizer (, total_steps=) -> scheduler


def no_decay_parameter(name: str, parameter: nn.Parameter, owner: nn.Module) -> bool:
    """Biases and normalisation weights: no weight decay."""
    return parameter.ndim < 2 or name.endswith("bias") or "norm" in type(owner).__name__.lower()


def param_groups(module: nn.Module, weight_decay: float | None = None) -> list[dict[str, Any]]:
    """``[{"params": decayed}, {"params": not decayed, "weight_decay": 0.0}]`` over the trainable
    parameters of ``module`` (each shared tensor once). Without ``weight_decay`` the first group takes
    the optimizer's own (the Hydra config's ``optim.weight_decay``)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for owner in module.modules():
        for name, p in owner.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            (no_decay if no_decay_parameter(name, p, owner) else decay).append(p)
    first: dict[str, Any] = {"params": decay}
    if weight_decay is not None:
        first["weight_decay"] = float(weight_decay)
    return [first, {"params": no_decay, "weight_decay": 0.0}]


def lr_factor(step: int, warmup_steps: int, total_steps: int | None, min_lr_ratio: float, decay: str) -> float:
    """Learning rate of step ``step`` (0-based) as a fraction of the peak.

    Warm-up: ``(step + 1) / (warmup_steps + 1)`` (the first step already moves, as in torchtitan);
    then ``min_lr_ratio + (1 - min_lr_ratio) · shape(progress)`` with ``progress`` from 0 at the
    end of the warm-up to 1 at ``total_steps`` (held there afterwards); ``shape`` is 1 (constant),
    ``(1 + cos(π·progress)) / 2`` (cosine) or ``1 - progress`` (linear).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay == "constant" or total_steps is None:
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min(max((step - warmup_steps) / span, 0.0), 1.0)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class WarmupDecayLR(LRScheduler):
    """Linear warm-up, then constant, cosine or linear decay (see :func:`lr_factor`); stepped once per
    optimizer step. ``total_steps=None``: the trainer's number of steps (filled in by the module)."""

    def __init__(self, optimizer: Optimizer, decay: str = "cosine", warmup_steps: int = 0,
                 min_lr_ratio: float = 0.1, total_steps: int | None = None, last_epoch: int = -1) -> None:
        if decay not in DECAYS:
            raise ValueError(f"scheduler decay must be one of {DECAYS}, got {decay!r}")
        if int(warmup_steps) < 0:
            raise ValueError(f"scheduler.warmup_steps must be >= 0, got {warmup_steps}")
        if not 0.0 <= float(min_lr_ratio) <= 1.0:
            raise ValueError(f"scheduler.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        if total_steps is not None and int(total_steps) < 1:
            raise ValueError(f"scheduler.total_steps must be positive (or null: trainer.max_steps), got {total_steps}")
        self.decay, self.warmup_steps, self.min_lr_ratio = decay, int(warmup_steps), float(min_lr_ratio)
        self.total_steps = None if total_steps is None else int(total_steps)
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        return lr_factor(step, self.warmup_steps, self.total_steps, self.min_lr_ratio, self.decay)

    @override
    def get_lr(self) -> list[float]:
        step = max(self.last_epoch, 0)
        return [base * self.factor(step) for base in self.base_lrs]

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Where the schedule stands (its step, base rates), not its shape: a resumed run keeps the
        configured warm-up, decay and horizon (e.g. a longer ``trainer.max_steps``)."""
        shape = {k: getattr(self, k) for k in ("decay", "warmup_steps", "min_lr_ratio", "total_steps")}
        super().load_state_dict(state_dict)
        self.__dict__.update(shape)


def constant(optimizer: Optimizer, warmup_steps: int = 0, min_lr_ratio: float = 1.0,
             total_steps: int | None = None) -> WarmupDecayLR:
    """Warm-up, then the peak learning rate (``conf/scheduler/constant.yaml``)."""
    return WarmupDecayLR(optimizer, "constant", warmup_steps, min_lr_ratio, total_steps)


def cosine(optimizer: Optimizer, warmup_steps: int = 0, min_lr_ratio: float = 0.1,
           total_steps: int | None = None) -> WarmupDecayLR:
    """Warm-up, then cosine decay to ``min_lr_ratio`` × peak (``conf/scheduler/cosine.yaml``)."""
    return WarmupDecayLR(optimizer, "cosine", warmup_steps, min_lr_ratio, total_steps)


def linear(optimizer: Optimizer, warmup_steps: int = 0, min_lr_ratio: float = 0.0,
           total_steps: int | None = None) -> WarmupDecayLR:
    """Warm-up, then linear decay to ``min_lr_ratio`` × peak (``conf/scheduler/linear.yaml``; BERT's)."""
    return WarmupDecayLR(optimizer, "linear", warmup_steps, min_lr_ratio, total_steps)


def build_scheduler(factory: SchedulerFactory, optimizer: Optimizer, total_steps: int | None) -> LRScheduler:
    """``factory(optimizer)``, passing ``total_steps`` (the run's number of optimizer steps) when the
    factory takes that argument and leaves it open (``None``, e.g. ``scheduler.total_steps: null``)."""
    try:
        parameter = inspect.signature(factory).parameters.get("total_steps")
    except (TypeError, ValueError):  # a callable without a signature
        parameter = None
    if parameter is not None and parameter.default in (None, inspect.Parameter.empty):
        if total_steps is None and parameter.default is inspect.Parameter.empty:
            raise ValueError("the learning-rate schedule needs total_steps: set trainer.max_steps or scheduler.total_steps")
        return factory(optimizer, total_steps=total_steps)
    return factory(optimizer)
