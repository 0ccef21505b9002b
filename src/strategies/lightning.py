"""Lightning strategies for pipeline schedules: GPipe, DAPPLE (alias 1F1B) and Chimera.

The strategy only maps Lightning's hooks onto :class:`~strategies.engine.PipelineEngine`:
process groups come up in ``setup_environment`` (inherited from DDP: launcher, cluster
environments, torchrun and SLURM), the model is split in ``setup`` before the optimizers see
its parameters, and :class:`PipelineModule.training_step` runs the whole schedule. Lightning's
own backward becomes a no-op (the schedule already ran every backward), the sampler is sharded
by replica (W), not by rank, and teardown ends the process group cleanly (gloo aborts some
plain exits otherwise).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from .engine import PipelineConfig, PipelineEngine
from .pipeline_model import Batch, sequential_loss


class PipelineStrategy(DDPStrategy):
    """W data-parallel replicas × D pipeline stages, running ``schedule`` (see strategies.schedules)."""

    schedule_name = "gpipe"

    def __init__(
        self,
        D: int = 2,
        W: int | None = None,
        micro_batch_size: int = 1,
        pipelines: int | None = None,
        concat: str = "direct",
        timeout_s: float = 120.0,
        schedule: str | None = None,
        name: str | None = None,
        grad_sync: str = "end",
        recompute: str = "none",
        **kwargs: Any,
    ) -> None:
        super().__init__(timeout=timedelta(seconds=timeout_s), **kwargs)
        self.pipeline_config = PipelineConfig(
            schedule or name or self.schedule_name, D, micro_batch_size, pipelines, concat, timeout_s,
            grad_sync=grad_sync, recompute=recompute,
        )
        self.requested_W = W
        self.engine: PipelineEngine | None = None

    @property
    def D(self) -> int:
        return self.pipeline_config.stages

    @property
    def W(self) -> int:
        return self.requested_W or max(self.world_size // self.D, 1)

    @property
    def replica(self) -> int:
        return self.global_rank // self.D

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.W, "rank": self.replica}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.W * self.D != self.world_size:
            raise ValueError(
                f"W·D = {self.W}·{self.D} = {self.W * self.D} but {self.world_size} processes run; "
                f"set strategy.D to a divisor of {self.world_size} and strategy.W = {self.world_size} / D"
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not isinstance(module, PipelineModule):
            raise TypeError(f"{type(module).__name__} must subclass strategies.lightning.PipelineModule")
        self.precision_plugin.convert_module(module)
        self.engine = PipelineEngine(
            module.model, self.pipeline_config, self.W, self.root_device, partition=module.partition(self.D)
        )
        module.to(self.root_device)
        rank_zero_info(f"pipeline: {self.pipeline_config.schedule} W={self.W} D={self.D}; "
                       + "; ".join(self.engine.topology.describe(r) for r in range(min(self.world_size, 8))))
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def configure_ddp(self) -> None:  # the pipeline synchronises its own gradients
        pass

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return closure_loss.detach()  # every backward already ran inside the schedule

    @override
    def teardown(self) -> None:
        super().teardown()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class GPipeStrategy(PipelineStrategy):
    schedule_name = "gpipe"


class DAPPLEStrategy(PipelineStrategy):
    schedule_name = "dapple"


class ChimeraStrategy(PipelineStrategy):
    schedule_name = "chimera"


class PipelineModule(pl.LightningModule):
    """A LightningModule around a :class:`~strategies.pipeline_model.PipelineModel`.

    Under a pipeline strategy the step runs the schedule; under any other strategy (single
    device, DDP) it runs the layers in order, so baselines train the very same module.
    """

    flops_per_batch: int | None = None  # read by Lightning's ThroughputMonitor; None: no MFU reported

    def __init__(self, model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.0,
                 nonfinite_loss: str = "stop") -> None:
        super().__init__()
        if nonfinite_loss not in ("stop", "skip"):
            raise ValueError(f"nonfinite_loss must be 'stop' or 'skip', got {nonfinite_loss!r}")
        self.model = model
        self.lr, self.weight_decay, self.nonfinite_loss = lr, weight_decay, nonfinite_loss

    def partition(self, stages: int) -> list[range] | None:
        """Layers per stage; ``None`` splits by layer count. Override to balance by cost."""
        builder = getattr(self.model, "partition", None)
        return builder(stages) if callable(builder) else None

    @property
    def pipeline(self) -> PipelineEngine | None:
        strategy = self._trainer.strategy if self._trainer is not None else None
        return strategy.engine if isinstance(strategy, PipelineStrategy) else None

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        engine = self.pipeline
        loss = engine.train_step(batch) if engine else sequential_loss(self.model, batch)
        if not torch.isfinite(loss.detach()):  # the pipeline's loss is global: every rank decides alike
            if self.nonfinite_loss == "stop" or engine is None:
                raise FloatingPointError(
                    f"training loss is {loss.item()} at step {self.global_step}: lower optim.lr, keep "
                    "trainer.gradient_clip_val, or (pipeline strategies) set nonfinite_loss=skip to skip such steps"
                )
            rank_zero_info(f"skipping the update of step {self.global_step}: training loss is {loss.item()}")
            for p in engine.local_parameters():
                p.grad = None  # the optimizer leaves parameters without gradients (and their state) alone
            return loss.detach()
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=_batch_size(batch))
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        engine = self.pipeline
        loss = engine.eval_step(batch) if engine else sequential_loss(self.model, batch)
        # Under the pipeline the loss is already the global one on every rank, so the mean over ranks is
        # the same value; sync_dist=True keeps DDP semantics and Lightning's epoch-level warning away.
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=_batch_size(batch))
        return loss

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        if self.pipeline is None:  # the pipeline clears gradients at the start of its step
            optimizer.zero_grad()

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        engine = self.pipeline
        if engine is None or not gradient_clip_val or gradient_clip_algorithm == "value":
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        norm = engine.grad_norm_sq().sqrt()  # global norm over all stages, each counted once
        scale = torch.clamp(gradient_clip_val / (norm + 1e-6), max=1.0)
        for p in engine.local_parameters():
            if p.grad is not None:
                p.grad.mul_(scale)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)


def _batch_size(batch: Batch) -> int:
    return next(v.shape[0] for v in batch.values() if isinstance(v, Tensor))


def register_strategies() -> None:
    """Make ``Trainer(strategy="gpipe" | "dapple" | "1f1b" | "chimera")`` work."""
    for name, cls in (("gpipe", GPipeStrategy), ("dapple", DAPPLEStrategy), ("1f1b", DAPPLEStrategy),
                      ("chimera", ChimeraStrategy)):
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=f"{cls.schedule_name} pipeline schedule")


register_strategies()
