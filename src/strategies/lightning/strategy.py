"""The Lightning strategy for pipeline schedules: one :class:`PipelineStrategy` runs any schedule of the
registry (:mod:`pipeline_recipes.strategies.schedules.registry`: GPipe, DAPPLE alias 1F1B, GEMS, Chimera,
PipeDream-2BW, PipeDream, interleaved 1F1B and the zero-bubble family: ZB-H1, ZB-H2, ZBV, DualPipeV and Chimera
with zero bubble) from a resolved layout only: ``PipelineStrategy.from_layout(derive_layout("chimera", 8, 4, 16,
B=1))`` (:func:`pipeline_recipes.strategies.schedules.derive_layout`); a recipe's worker builds it from the layout
the launcher resolved, which it then only checks (the processes that joined, each training batch's N) instead of
deriving it again.

The strategy only maps Lightning's hooks onto :class:`~pipeline_recipes.strategies.runtime.engine.PipelineEngine`:
process groups come up in ``setup_environment`` (inherited from DDP: launcher, cluster
environments, torchrun and SLURM), the model is split in ``setup`` before the optimizers see
its parameters, and :class:`PipelineModule.training_step` runs the whole schedule. Lightning's
own backward becomes a no-op (the schedule already ran every backward), the sampler is sharded
by replica (W), not by rank, a stop signal (SIGTERM, SIGINT, SIGUSR1) stops every rank after the same step
with the step reached saved (:mod:`pipeline_recipes.strategies.lightning.stop`, added unless the trainer has one), and
teardown ends the process group cleanly (gloo aborts some plain exits otherwise).

Checkpoints are sharded (:mod:`pipeline_recipes.strategies.checkpoint`): ``Trainer.save_checkpoint`` and
``ModelCheckpoint`` write a torch.distributed.checkpoint directory where every tensor is saved once, by a rank
holding it, beside Lightning's loop, callback and scheduler state, in the foreground or from a staged copy in the
background (:mod:`pipeline_recipes.strategies.checkpoint_writer`); ``fit(ckpt_path=...)`` restores after ``setup``,
each rank reading only its keys, from a sharded directory of any layout or a consolidated file.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from pipeline_recipes.core.errors import TrainingDiverged
from pipeline_recipes.core.failures import record_handled_error
from pipeline_recipes.core.layout import Layout
from pipeline_recipes.core.timeouts import COLLECTIVE_TIMEOUT_S
from torch import Tensor, nn
from typing_extensions import override

from pipeline_recipes.strategies import checkpoint as ckpt
from pipeline_recipes.strategies.checkpoint_writer import CheckpointWriter, any_rank, staged
from pipeline_recipes.strategies.compute.compile import compile_blocks, repeated_blocks
from pipeline_recipes.strategies.compute.cuda_graphs import StageGraphs
from pipeline_recipes.strategies.runtime.engine import PipelineConfig, PipelineEngine, build_engine
from pipeline_recipes.core.pipeline_model import loss_counts, micro_batch_loss
from pipeline_recipes.strategies.runtime.fetch_ahead import fetch_during_waits
from pipeline_recipes.strategies.lightning.optim import OptimizerFactory, SchedulerFactory, build_scheduler, param_groups
from pipeline_recipes.core.pipeline_model import Batch, run_layers, sequential_loss
from pipeline_recipes.strategies.runtime.process_group import end_process_group
from pipeline_recipes.strategies.lightning.stop import StopOnSignal


CONFIG_KEYS = frozenset({"schedule", "name", "D", "chunks", "W", "micro_batch_size", "pipelines", "concat",
                         "timeout_s", "grad_sync", "recompute", "cuda_graphs", "shard_optimizer"})
"""The keys of a pipeline strategy's config (``conf/pipeline_strategy.yaml``) that the launcher derives the layout
from (:func:`pipeline_recipes.recipe.check.settings.resolve_layout`), and its ``timeout_s``; any other key is Lightning's."""


class PipelineStrategy(DDPStrategy):
    """W data-parallel replicas × D pipeline workers running the layout the launcher resolved
    (:class:`~pipeline_recipes.core.layout.Layout`: its schedule, W, D, B, N and settings, read, never derived again;
    the processes that join are checked against it). Built by :meth:`from_layout`."""

    def __init__(self, layout: Layout, timeout_s: float = COLLECTIVE_TIMEOUT_S, **kwargs: Any) -> None:
        config = PipelineConfig(layout, timeout_s)  # a baseline's layout is refused here
        super().__init__(timeout=timedelta(seconds=timeout_s), **kwargs)
        self.pipeline_config = config
        self.layout = layout
        self.engine: PipelineEngine | None = None
        self.model_index: ckpt.ModelIndex | None = None
        self._rng_to_restore: dict[str, Any] | None = None
        self.writer = CheckpointWriter()  # foreground saves unless save_in_background (checkpoint.async_save)
        self._checkpoint_group: dist.ProcessGroup | None = None

    @classmethod
    def from_layout(cls, layout: Layout, timeout_s: float = COLLECTIVE_TIMEOUT_S, **kwargs: Any) -> PipelineStrategy:
        """The strategy of the layout the launcher resolved and validated
        (:func:`pipeline_recipes.strategies.schedules.derive_layout`); ``timeout_s``: how long any wait may take;
        ``kwargs``: DDP's own settings."""
        return cls(layout, timeout_s, **kwargs)

    @property
    def D(self) -> int:
        """Workers (devices) per pipeline replica."""
        return self.layout.D

    @property
    def S(self) -> int:
        """Stages the model is split into: D, or v·D with v chunks per worker."""
        return self.layout.stages

    @property
    def W(self) -> int:
        """Data-parallel replicas of the pipeline."""
        return self.layout.W

    @property
    def replica(self) -> int:
        return self.global_rank // self.D

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.W, "rank": self.replica}

    @override
    def setup_distributed(self) -> None:
        """Lightning's, except for ranks sharing a GPU over gloo (:func:`share_gpus`): their group is bound
        to no device, as ``tests/strategies/runtime/test_gpu.py`` runs them. Bound (Lightning passes the rank's GPU as
        ``device_id``), every ``new_group`` of the pipeline would be split from the default gloo group."""
        if self._get_process_group_backend() != "gloo" or self.root_device.type == "cpu":
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = "gloo"
        _init_dist_connection(self.cluster_environment, "gloo", timeout=self._timeout)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.layout.check_world_size(self.world_size)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not isinstance(module, PipelineModule):
            raise TypeError(f"{type(module).__name__} must subclass pipeline_recipes.strategies.lightning.strategy.PipelineModule")
        self.precision_plugin.convert_module(module)
        self.model_index = ckpt.ModelIndex.of(module, module.model.pipeline_layers())  # before remote layers go
        self.engine = build_engine(module.model, self.layout, self.root_device, partition=module.partition(self.S),
                                   timeout_s=self.pipeline_config.timeout_s)
        module.to(self.root_device)
        if self.writer.background:  # the writer thread's collectives, apart from the training thread's
            self._checkpoint_group = dist.new_group(backend="gloo",
                                                    timeout=timedelta(seconds=self.pipeline_config.timeout_s))
        stages = f" S={self.S}" if self.S != self.D else ""
        rank_zero_info(f"pipeline: {self.pipeline_config.schedule} W={self.W} D={self.D}{stages}; "
                       + "; ".join(self.engine.topology.describe(r) for r in range(min(self.world_size, 8))))
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if not any(isinstance(c, StopOnSignal) for c in trainer.callbacks):
                trainer.callbacks.append(StopOnSignal(timeout=timedelta(seconds=self.pipeline_config.timeout_s)))
        self.setup_precision_plugin()

    @override
    def configure_ddp(self) -> None:  # the pipeline synchronises its own gradients
        pass

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return closure_loss.detach()  # every backward already ran inside the schedule

    # -- checkpoints (strategies.checkpoint) ------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a rank knows its stages (what to read) only once the engine exists

    def checkpoint_meta(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``meta.json`` of a sharded checkpoint: format, layout, progress, names, model config."""
        engine, config = self.engine, self.pipeline_config
        return {
            "format": ckpt.SHARDED_FORMAT, "version": ckpt.VERSION,
            "schedule": config.schedule, "D": self.D, "S": self.S, "W": self.W, "world_size": self.world_size,
            "micro_batch_size": config.micro_batch_size, "pipelines": config.pipelines, "concat": config.concat,
            "partition": [[r.start, r.stop] for r in engine.partition],
            "num_layers": len(self.model_index.prefixes),
            "epoch": checkpoint.get("epoch"), "global_step": checkpoint.get("global_step"),
            "has_optimizer_states": "optimizer_states" in checkpoint,
            "storage": "dcp",  # the model and optimizer state: pipeline_recipes.strategies.dcp_state
            "index": self.model_index.as_dict(),
            # the model's Hydra config (PipelineModule.on_save_checkpoint): the launcher checks it before a resume
            ckpt.MODEL_CONFIG_KEY: checkpoint.get(ckpt.MODEL_CONFIG_KEY),
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes the stages it owns (the lowest rank holding a copy), no gathering."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        engine, module = self.engine, self.lightning_module
        if engine is None or self.model_index is None:
            raise RuntimeError("the pipeline is not set up yet: save checkpoints during or after fit")
        started = time.perf_counter()
        self.writer.wait()  # at most one save in flight
        rank = self.global_rank
        optimizers = self.optimizers if "optimizer_states" in checkpoint else []
        names = ckpt.parameter_names(module, self.model_index)
        segments = {id(s.shard): (s.param, s.offset) for s in engine.segments()}
        groups = [engine.whole_groups(opt) or [g["params"] for g in opt.param_groups] for opt in optimizers]
        state = ckpt.rank_state(checkpoint["state_dict"], self.model_index, optimizers, groups, names, segments)
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        group = self._checkpoint_group
        if self.writer.background:  # staged: host copies that training does not change while they are written
            state, rest = staged(state), copy.deepcopy(rest)
        write = partial(
            ckpt.save_sharded, filepath, rank=rank, write_parts=ckpt.dcp_files(state, group), rng=ckpt.rng_state(),
            needed_bytes=ckpt.tensor_bytes(state), meta=self.checkpoint_meta(checkpoint) if rank == 0 else None,
            trainer_state=rest if rank == 0 else None,
            write_trainer_state=lambda state, path: self.checkpoint_io.save_checkpoint(dict(state), path),
            any_failed=partial(any_rank, group=group) if group is not None else partial(
                self.reduce_boolean_decision, all=False))
        self.writer.save(int(checkpoint.get("global_step") or 0), filepath, write, started)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's removal of a replaced checkpoint; with saves in the background (``checkpoint.async_save``) done
        once the save replacing it is written and verifies, never if it fails."""
        if not self.writer.after_save(partial(self._remove_once_verified, filepath)):
            super().remove_checkpoint(filepath)

    def _remove_once_verified(self, filepath: Any, saved: Path) -> None:
        try:
            ckpt.verify_checkpoint(saved)
        except (ckpt.CheckpointError, OSError) as err:
            rank_zero_warn(f"keeping {filepath}: the checkpoint saved after it does not verify: {err}")
            return
        super().remove_checkpoint(filepath)

    @property
    def checkpoint_saves(self) -> list[dict[str, Any]]:
        """Each save of this run: ``{step, blocking_s, write_s, bytes}`` (``results.json: checkpoint_saves``)."""
        return [record.as_dict() for record in self.writer.saves]

    def finish_saves(self) -> None:
        """Wait for the checkpoint being written in the background, if any (bounded), and raise its error."""
        self.writer.wait()

    def save_in_background(self) -> None:
        """Write checkpoints in a worker thread from staged copies (``checkpoint.async_save``); before ``setup``."""
        if self.engine is not None:
            raise RuntimeError("save_in_background must be chosen before the strategy is set up")
        self.writer = CheckpointWriter(background=True, timeout_s=max(600.0, 5 * self.pipeline_config.timeout_s))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """This rank's part of a sharded checkpoint (any layout) or of a consolidated/plain one, as a
        Lightning checkpoint dict of the local module and optimizers."""
        path = Path(checkpoint_path)
        module = self.lightning_module
        local = module.state_dict()
        index = self.model_index

        def load_file(p: Path) -> dict[str, Any]:
            return self.checkpoint_io.load_checkpoint(p, weights_only=weights_only)

        names = ckpt.parameter_names(module, index)
        ranges = {}  # strategy.shard_optimizer: the segment each optimizer steps → its part of a parameter
        for segment in self.engine.segments():
            names[id(segment.shard)] = names[id(segment.param)]
            ranges[id(segment.shard)] = (segment.offset, segment.offset + segment.shard.numel())
        meta = ckpt.read_meta(path) if path.is_dir() else {}
        if path.is_dir() and ckpt.is_dcp(meta):
            stepped = {names[id(p)] for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
            spans = {names[i]: span for i, span in ranges.items()}
            full = ckpt.read_dcp(path, meta, local.keys(), stepped, spans, load_file)
        elif path.is_dir():
            full = ckpt.read_sharded(path, ckpt.stages_holding(meta, {index.layer_of(k) for k in local}), load_file)
        else:
            full = ckpt.read_checkpoint(path, index, load_file=load_file)
        checkpoint = {**full.trainer_state, "state_dict": ckpt.select_model_state(full, local, module.strict_loading)}
        if full.optimizers and self.optimizers:
            if len(full.optimizers) != len(self.optimizers):
                raise ckpt.CheckpointError(f"{path} holds {len(full.optimizers)} optimizers, this module configures "
                                           f"{len(self.optimizers)}")
            checkpoint["optimizer_states"] = [ckpt.select_optimizer_state(saved, opt, names, str(path), ranges or None)
                                              for saved, opt in zip(full.optimizers, self.optimizers)]
        elif full.optimizers or full.meta.get("has_optimizer_states"):
            checkpoint["optimizer_states"] = []
        self._rng_to_restore = self._same_layout_rng(path, full.meta)
        return checkpoint

    def _same_layout_rng(self, path: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's saved RNG states when the layout is the saved one (dropout continues exactly)."""
        if not path.is_dir():
            return None
        engine = self.engine
        same = (meta.get("schedule"), meta.get("D"), meta.get("W"), meta.get("partition")) == (
            self.pipeline_config.schedule, self.D, self.W, [[r.start, r.stop] for r in engine.partition])
        if not same:
            rank_zero_info(f"resuming {path} under another layout: random streams (dropout) start afresh")
            return None
        return ckpt.read_rng(path, self.global_rank)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._rng_to_restore is not None:  # after the data loader started: it may draw from the RNG
            ckpt.set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None
        fetch_during_waits(self.lightning_module.trainer, self.engine)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.writer.raise_if_failed()  # a background save that failed ends the job at the next step

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.writer.wait()  # the last save complete before the job reports its end
        if self.engine is not None:  # asynchronous schedules: no loss all-reduce left in flight (the metrics
            self.engine.flush_losses()  # callback, which runs first, has taken the losses it reports)
            self.engine.idle_work = None

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is None or not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            super().teardown()
        else:  # the job failed before setup built this rank's layers: Lightning's move of the module to the
            self._lightning_module = None  # CPU would raise on its meta tensors and hide the error that ended it
            try:
                super().teardown()
            finally:
                self._lightning_module = module
        record_handled_error()  # a failed step: its exception is this rank's first, named by the launcher
        try:
            self.writer.close()  # a save still in flight (the job failed meanwhile): complete it or give up, bounded
        except Exception as err:  # the job is ending for another reason, which this must not hide
            rank_zero_warn(f"the checkpoint being written in the background did not complete: {err}")
        end_process_group()


class PipelineModule(pl.LightningModule):
    """A LightningModule around a :class:`~pipeline_recipes.core.pipeline_model.PipelineModel`.

    Under a pipeline strategy the step runs the schedule; under any other strategy (single
    device, DDP) it runs the layers in order, so baselines train the very same module.

    ``train/loss`` is logged (``self.log``) on the steps where it is read: the loggers' steps
    (:func:`reporting_step`, and every step while ``trainer.should_stop`` is set, as Lightning writes
    them), each epoch's last step, the first one (so that ``callback_metrics`` has it from then on),
    and every step while Lightning's progress bar shows. In between, ``callback_metrics["train/loss"]``
    keeps the last logged value; ``trainer.log_every_n_steps=1`` logs every step. (Lightning's
    ``self.log`` costs the process that ends every pipeline step about half a millisecond per call.)
    """

    flops_per_batch: int | None = None  # for a Lightning ThroughputMonitor a user adds (the recipe's MFU: recipe.flops)

    def __init__(self, model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.0,
                 nonfinite_loss: str = "stop", model_config: Mapping[str, Any] | None = None,
                 optimizer: OptimizerFactory | None = None, scheduler: SchedulerFactory | None = None,
                 compile_blocks: bool = False, nonfinite_patience: int = 3) -> None:
        """``optimizer``: ``params -> Optimizer`` holding its own hyper-parameters (Hydra's
        ``_partial_`` of ``conf/optim/*.yaml``); without it AdamW(``lr``, ``weight_decay``).
        ``scheduler``: ``optimizer -> LRScheduler`` stepped after every optimizer step (``conf/scheduler``;
        a ``total_steps`` it leaves open becomes the trainer's number of steps); without it the
        learning rate stays constant. Weight decay skips biases and norms
        (:func:`pipeline_recipes.strategies.lightning.optim.param_groups`). ``compile_blocks`` (``model.compile``): compile
        each repeated block this rank holds when fitting starts (:mod:`pipeline_recipes.strategies.compute.compile`).
        ``nonfinite_loss``: a NaN/inf loss ends the run (``stop``) or, under a pipeline, skips that step's
        update (``skip``) at most ``nonfinite_patience`` steps in a row; either way the run ends as diverged."""
        super().__init__()
        if nonfinite_loss not in ("stop", "skip"):
            raise ValueError(f"nonfinite_loss must be 'stop' or 'skip', got {nonfinite_loss!r}")
        if isinstance(nonfinite_patience, bool) or not isinstance(nonfinite_patience, int) or nonfinite_patience < 0:
            raise ValueError(f"nonfinite_loss_patience must be an integer >= 0, got {nonfinite_patience!r}")
        self.nonfinite_patience, self.nonfinite_in_a_row = nonfinite_patience, 0
        self.model = model
        self.lr, self.weight_decay, self.nonfinite_loss = lr, weight_decay, nonfinite_loss
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        # how to rebuild the model (a Hydra config with _target_): kept in checkpoints for scripts/export_hf.py
        self.model_config = dict(model_config) if model_config is not None else None
        # the repeated blocks, listed while every layer is here (a pipeline drops the other ranks' layers): compiled
        # with compile_blocks, captured as CUDA graphs under strategy.cuda_graphs
        layers = getattr(model, "pipeline_layers", None)  # a plain module (strategy=single, ddp) has no stages
        self.repeated_blocks = repeated_blocks(layers()) if layers is not None else []
        self.blocks_to_compile = list(self.repeated_blocks) if compile_blocks else []

    @override
    def on_fit_start(self) -> None:
        """Compile the repeated blocks this rank holds (``compile_blocks``), once the strategy has built its
        stages on their device; one line says so, or why they stay eager. Then, under ``strategy.cuda_graphs``,
        route them through their CUDA graphs (:mod:`pipeline_recipes.strategies.compute.cuda_graphs`)."""
        self._compile_blocks()
        engine = self.pipeline
        if engine is not None and engine.config.cuda_graphs and engine.stage_graphs is None:
            engine.stage_graphs = StageGraphs(engine.stage_layers, self.model.pipeline_layers(), self.repeated_blocks,
                                              engine.topology.worker_of(engine.setup.rank), report=rank_zero_info)
            rank_zero_info(engine.stage_graphs.describe())

    def _compile_blocks(self) -> None:
        if not self.blocks_to_compile:
            return
        engine = self.pipeline
        split = engine is not None and any(a.kind == "I" for acts in engine.schedule_for(
            engine.config.micro_batches).workers for a in acts)
        done = compile_blocks(self.model.pipeline_layers(), self.blocks_to_compile, self.device)
        self.blocks_to_compile = []  # once: a second fit keeps the compiled blocks
        if done.fallback is not None:
            rank_zero_warn(done.describe())
        else:
            rank_zero_info(done.describe(split))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.model_config is not None:
            checkpoint[ckpt.MODEL_CONFIG_KEY] = self.model_config
        if self.pipeline is None and "optimizer_states" in checkpoint:  # plain file: name each optimizer position
            names = {id(p): n for n, p in self.named_parameters()}
            checkpoint[ckpt.OPTIMIZER_NAMES_KEY] = [[names[id(p)] for g in opt.param_groups for p in g["params"]]
                                                    for opt in self.trainer.optimizers]

    def partition(self, stages: int) -> list[range] | None:
        """Layers per stage; ``None`` splits by layer count. Override to balance by cost."""
        builder = getattr(self.model, "partition", None)
        return builder(stages) if callable(builder) else None

    @property
    def pipeline(self) -> PipelineEngine | None:
        strategy = getattr(self._trainer, "strategy", None)  # None: no trainer (or a stand-in without one)
        return strategy.engine if isinstance(strategy, PipelineStrategy) else None

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        engine = self.pipeline
        loss = engine.train_step(batch) if engine else self._replica_loss(batch)
        if not torch.isfinite(loss.detach()):  # the pipeline's loss is global: every rank decides alike
            self._skip_nonfinite(loss, engine)
            return loss.detach()
        self.nonfinite_in_a_row = 0
        if self._loss_read_now(batch_idx):
            self.log("train/loss", loss.detach(), prog_bar=True, batch_size=_batch_size(batch))
        return loss

    def _skip_nonfinite(self, loss: Tensor, engine: PipelineEngine | None) -> None:
        """A NaN/inf loss: skip the update (``nonfinite_loss=skip``, pipelines) at most ``nonfinite_patience``
        steps in a row, else raise :class:`~pipeline_recipes.core.errors.TrainingDiverged`."""
        step = self.global_step if engine is None else engine.loss_step  # asynchronous: a step late
        self.nonfinite_in_a_row += 1
        if self.nonfinite_loss == "stop" or engine is None:
            raise TrainingDiverged(
                f"training loss is {loss.item()} at step {step}: lower optim.lr, keep trainer.gradient_clip_val, "
                "or (pipeline strategies) set nonfinite_loss=skip to skip such steps")
        if self.nonfinite_in_a_row > self.nonfinite_patience:
            raise TrainingDiverged(
                f"training loss is {loss.item()} at step {step}, non-finite {self.nonfinite_in_a_row} steps in a row "
                f"(nonfinite_loss_patience = {self.nonfinite_patience}): the run diverged; lower optim.lr or "
                "resume from an earlier checkpoint")
        rank_zero_info(f"skipping the update of step {self.global_step}: training loss is {loss.item()} "
                       f"(step {step}; {self.nonfinite_in_a_row} in a row of at most {self.nonfinite_patience})")
        engine.drop_gradients()

    def _loss_read_now(self, batch_idx: int) -> bool:
        """Whether this training step's ``train/loss`` is read (see the class docstring)."""
        trainer = self._trainer
        if trainer is None or trainer.should_stop or trainer.progress_bar_callback is not None:
            return True
        if batch_idx + 1 >= trainer.num_training_batches:  # the epoch's last step (inf: a loader without length)
            return True
        # the optimizer step this one completes; global_step counts those done
        return reporting_step(trainer, trainer.global_step + 1) or "train/loss" not in trainer.callback_metrics

    def _replica_loss(self, batch: Batch) -> Tensor:
        """Without a pipeline: one process takes the whole mini-batch; under DDP each of the W replicas
        returns W × its share of the mini-batch loss, every term normalised by its count over all
        replicas (as the pipeline does), so that DDP's gradient average is the mini-batch gradient
        even where replicas hold different numbers of loss items (BERT's masked tokens)."""
        replicas = self._trainer.world_size if self._trainer is not None else 1
        if replicas == 1 or not dist.is_initialized():
            return sequential_loss(self.model, batch)
        counts = loss_counts(self.model, batch)
        names = sorted(counts)
        totals = torch.stack([counts[n] for n in names]).to(self.device)
        dist.all_reduce(totals)
        totals = totals.to(torch.float32)
        output = run_layers(self.model.pipeline_layers(), self.model.pipeline_input(batch), batch)
        return replicas * micro_batch_loss(self.model, output, batch, {n: totals[i] for i, n in enumerate(names)})

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
        engine.clip_grad_norm_(gradient_clip_val)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        """The optimizer over this rank's parameters (under a pipeline: its stages only; with
        ``strategy.shard_optimizer``, this rank's slices of them: ``PipelineEngine.build_optimizer``), and the
        learning-rate schedule as a per-step Lightning scheduler when one is configured."""
        if self.optimizer_factory is None:
            factory, groups = partial(torch.optim.AdamW, lr=self.lr), param_groups(self, self.weight_decay)
        else:
            factory, groups = self.optimizer_factory, param_groups(self)
        engine = self.pipeline
        optimizer = engine.build_optimizer(factory, groups) if engine is not None else factory(groups)
        if self.scheduler_factory is None:
            return optimizer
        scheduler = build_scheduler(self.scheduler_factory, optimizer, self._total_steps())
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1, "name": "lr"}}

    def _total_steps(self) -> int | None:
        trainer = self._trainer
        if trainer is None:
            return None
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        return int(total) if total != float("inf") else None


def reporting_step(trainer: pl.Trainer, step: int) -> bool:
    """Whether optimizer step ``step`` (counted from 1) is one whose figures are read at once: the
    loggers' steps (every ``trainer.log_every_n_steps``, as Lightning's logger connector counts them)
    and the run's last step. The same on every rank."""
    every = trainer.log_every_n_steps
    return last_step(trainer, step) or (bool(every) and step % every == 0)


def last_step(trainer: pl.Trainer, step: int) -> bool:
    """Whether optimizer step ``step`` (counted from 1) is the last of a ``max_steps`` run."""
    return trainer.max_steps is not None and step >= trainer.max_steps > 0


def _batch_size(batch: Batch) -> int:
    return next(v.shape[0] for v in batch.values() if isinstance(v, Tensor))


def share_gpus(strategy: DDPStrategy, gpu_of_rank: list[int]) -> None:
    """Run a node's ranks on shared GPUs (more processes than GPUs,
    :func:`pipeline_recipes.recipe.check.accelerator.shared_devices`): local rank r on ``cuda:gpu_of_rank[r]``,
    over gloo, since NCCL refuses two ranks on one GPU; the pipeline stages its messages through the host
    then (:mod:`pipeline_recipes.strategies.runtime.p2p`). Call it before the ``Trainer`` is built: Lightning keeps
    a strategy's own ``parallel_devices``."""
    if not isinstance(strategy, DDPStrategy):
        raise TypeError(f"{type(strategy).__name__} runs one process; only DDP-style strategies share GPUs")
    strategy.parallel_devices = [torch.device("cuda", index) for index in gpu_of_rank]
    strategy._process_group_backend = "gloo"  # DDPStrategy's process_group_backend argument, set after construction
