"""Emulated-compute pipeline models for schedule benchmarks (Chimera §3.4's cost model, measured).

Each stage is one layer whose forward and backward take a set time (:func:`hold`, a sleep: no CPU
is used, so D = 8 ranks on a 2-core machine still run their stages "in parallel") while real tensors
flow: the stage output is a real activation of ``activation_numel`` floats per sample sent over
p2p, the backward returns a real activation gradient of the same size, and each stage holds a
real parameter of ``param_numel`` floats whose (zero) gradient takes part in the real gradient
all-reduce. Costs are per micro-batch of ``micro_batch_size`` samples and scale with the samples a
call sees, so a doubled forward takes ``2 t_f`` and a halved backward ``t_b / 2``, exactly as
:func:`pipeline_recipes.strategies.schedules.simulate` charges them. By default ``t_b = 2 t_f`` (§3.4).
"""

from __future__ import annotations

import statistics
import time
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn

from pipeline_recipes.strategies.compute.deferred_weights import WeightGradientStore, accumulate
from pipeline_recipes.core.pipeline_model import Batch, PipelineModel


@cache
def sleep_lateness() -> float:
    """How late ``time.sleep`` wakes up in this process (median over a few short sleeps; on shared
    VMs about 0.1–0.5 ms, i.e. several % of a 20 ms emulated action)."""
    late = []
    for _ in range(15):
        start = time.perf_counter()
        time.sleep(0.002)
        late.append(time.perf_counter() - start - 0.002)
    return max(statistics.median(late), 0.0)


def hold(seconds: float) -> None:
    """Pass ``seconds`` without using the CPU: sleep until just before the deadline (less the
    typical wake-up lateness), then yield until it is reached."""
    deadline = time.perf_counter() + seconds
    early = seconds - sleep_lateness()
    if early > 0:
        time.sleep(early)
    while time.perf_counter() < deadline:
        time.sleep(0)


class _Timed(torch.autograd.Function):
    """Identity (a copy) whose forward sleeps ``t_f`` and whose backward sleeps ``t_b``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, t_f: float, t_b: float) -> Tensor:
        ctx.t_b, ctx.weight = t_b, weight
        hold(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        hold(ctx.t_b)
        grad_x = grad.clone() if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(ctx.weight) if ctx.needs_input_grad[1] else None  # real gradient memory
        return grad_x, grad_w, None, None


class _InputPath(torch.autograd.Function):
    """Identity (a copy) whose forward sleeps ``t_f`` and whose backward, the input gradient, sleeps ``t_i``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, t_f: float, t_i: float) -> Tensor:
        ctx.t_i = t_i
        hold(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        hold(ctx.t_i)
        return grad.clone(), None, None


class _WeightPath(torch.autograd.Function):
    """Zeros of the activation's shape from the weight, whose backward (the weight gradient) sleeps
    ``t_w``, later (in ``W``) when the stage's weight store is collecting (an ``I``)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, like: Tensor, t_w: float, stage: EmulatedStage) -> Tensor:
        ctx.t_w, ctx.stage = t_w, stage
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        weight, t_w = ctx.stage.weight, ctx.t_w

        def weight_gradient() -> Tensor:
            hold(t_w)
            return torch.zeros_like(weight)  # real gradient memory

        store = ctx.stage.weight_store
        if store is not None and store.defer(lambda: accumulate(weight, weight_gradient())):
            return None, None, None, None
        return weight_gradient(), None, None, None


class EmulatedStage(nn.Module):
    """One pipeline stage of emulated cost (seconds per micro-batch of ``micro_batch_size``).

    One autograd node, whose backward holds ``t_b``; with ``split_backward`` the output is an input
    path plus a weight path, two nodes, so that a split backward costs what the simulator charges:
    the input gradient (``I``) holds ``t_b - t_w`` and defers the weight path's ``t_w`` to the weight
    gradient (``W``) through ``weight_store``, which the pipeline stage sets
    (:mod:`pipeline_recipes.strategies.compute.deferred_weights`; Zero Bubble Pipeline Parallelism §2; ``t_w`` defaults to
    ``t_b / 2`` as in :func:`pipeline_recipes.strategies.schedules.simulate`); a whole backward (``B``) runs both.
    Schedules without split backwards keep the one node (one wake-up per backward, not two)."""

    weight_store: WeightGradientStore | None = None

    def __init__(self, t_f: float, t_b: float, param_numel: int, micro_batch_size: int,
                 t_w: float | None = None, split_backward: bool = False) -> None:
        super().__init__()
        t_w = t_b / 2 if t_w is None else t_w
        if t_f < 0 or t_b < 0 or not 0 <= t_w <= t_b:
            raise ValueError(f"stage times must be non-negative and t_w <= t_b, got t_f={t_f}, t_b={t_b}, t_w={t_w}")
        self.t_f, self.t_b, self.t_w, self.micro_batch_size = t_f, t_b, t_w, micro_batch_size
        self.split_backward = split_backward
        self.weight = nn.Parameter(torch.zeros(max(int(param_numel), 1)))

    def forward(self, x: Tensor) -> Tensor:
        scale = x.shape[0] / self.micro_batch_size
        if not self.split_backward:
            return _Timed.apply(x, self.weight, self.t_f * scale, self.t_b * scale)
        if torch.is_grad_enabled() and not x.requires_grad:  # the first stage: its backward costs t_b too
            x = x.detach().requires_grad_(True)
        out = _InputPath.apply(x, self.t_f * scale, (self.t_b - self.t_w) * scale)
        return out + _WeightPath.apply(self.weight, out.detach(), self.t_w * scale, self)


class EmulatedPipeline(nn.Module, PipelineModel):
    """``stages`` emulated stages (one layer each); batches are ``{"x": (samples, activation_numel)}``."""

    def __init__(
        self,
        stages: int,
        t_f: float = 0.02,
        t_b: float | None = None,
        activation_numel: int = 16384,
        param_numel: int = 65536,
        micro_batch_size: int = 1,
        split_backward: bool = False,
    ) -> None:
        super().__init__()
        if stages < 1 or micro_batch_size < 1 or activation_numel < 1:
            raise ValueError("stages, micro_batch_size and activation_numel must be positive")
        t_b = 2.0 * t_f if t_b is None else t_b
        self.activation_numel = int(activation_numel)
        self.layers = nn.ModuleList(
            EmulatedStage(t_f, t_b, param_numel, micro_batch_size, split_backward=split_backward)
            for _ in range(stages)
        )

    def pipeline_layers(self) -> nn.ModuleList:
        return self.layers

    def pipeline_input(self, batch: Batch) -> Tensor:
        return batch["x"]

    def pipeline_loss(self, output: Tensor, batch: Batch) -> Tensor:
        return output.mean()

    def batch(self, samples: int) -> dict[str, Tensor]:
        """A mini-batch of ``samples`` inputs of the configured activation size."""
        return {"x": torch.ones(samples, self.activation_numel)}
