"""One pipeline-parallel training step, independent of Lightning: one set-up, then a synchronous or asynchronous step.

:func:`build_engine` assembles this rank's share of the pipeline once
(:func:`pipeline_recipes.strategies.runtime.rank_setup.assemble`: topology, this rank's stages of a
:class:`~pipeline_recipes.core.pipeline_model.PipelineModel`, process groups, gradient synchroniser) and returns
the step object for the schedule, each with one job:

* :class:`SynchronousStep` (GPipe, DAPPLE, GEMS, Chimera, interleaved 1F1B, the zero-bubble family): split the
  replica's mini-batch into N micro-batches, execute this rank's actions of the schedule, all-reduce stage gradients
  (at the end, or eagerly as stage copies finish: Chimera §3.2, :mod:`pipeline_recipes.strategies.runtime.grad_sync`) and
  return the mini-batch loss on every rank; every step flushes.
* :class:`AsynchronousStep` (PipeDream, PipeDream-2BW): one window of a schedule that never flushes per step,
  forwards on stashed weight versions and delayed updates (:mod:`pipeline_recipes.strategies.runtime.versions`), the loss
  reported late (:mod:`pipeline_recipes.strategies.runtime.late_loss`).

Both are a :class:`PipelineEngine`: what the Lightning strategy calls (:mod:`pipeline_recipes.strategies.lightning.strategy`)
and what every step does alike (the batch split, the loss normalisers, evaluation, gradient norms). Stage forwards
may be recomputed in backward to save activation memory (GPipe §2.3, re-materialization:
:mod:`pipeline_recipes.strategies.runtime.recompute`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cache

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from pipeline_recipes.strategies.compute.cuda_graphs import StageGraphs
from pipeline_recipes.core.pipeline_model import loss_counts
from pipeline_recipes.strategies.runtime.executor import AsyncWindows, StageExecutor, StepRecord
from pipeline_recipes.strategies.runtime.grad_sync import GradientSynchronizer, launch_plan
from pipeline_recipes.strategies.runtime.optimizer_shards import Segment, optimizer_groups, sharded_ids
from pipeline_recipes.strategies.runtime.late_loss import LateLosses
from pipeline_recipes.core.layout import Layout, LayoutMismatch
from pipeline_recipes.core.pipeline_model import Batch, split_batch
from pipeline_recipes.core.timeouts import COLLECTIVE_TIMEOUT_S
from pipeline_recipes.strategies.runtime.rank_setup import RankSetup, assemble, check_layout, even_partition
from pipeline_recipes.strategies.schedules import Action, Schedule, build_schedule, dapple, get_spec
from pipeline_recipes.strategies.schedules.asynchronous import weight_delay, window
from pipeline_recipes.strategies.schedules.rules import DEFAULT_GRAD_SYNC, DEFAULT_RECOMPUTE
from pipeline_recipes.strategies.runtime.stage import unique_parameters
from pipeline_recipes.strategies.runtime.topology import Topology
from pipeline_recipes.strategies.runtime.versions import WeightVersions

__all__ = ["AsynchronousStep", "PipelineConfig", "PipelineEngine", "SynchronousStep", "build_engine", "check_layout",
           "even_partition"]


@dataclass(frozen=True)
class PipelineConfig:
    """The runtime's view of the layout the launcher resolved (:class:`~pipeline_recipes.core.layout.Layout`, derived
    and checked once by :func:`pipeline_recipes.strategies.schedules.derive_layout`) and how long a wait may take:
    the settings read as the runtime names them, nothing derived again.

    ``grad_sync``: ``end`` | ``eager`` | ``eager_opt`` (Chimera §3.2, see :mod:`.grad_sync`).
    ``recompute``: ``none`` | ``except_last`` | ``always`` (see :mod:`.recompute`).
    """

    layout: Layout
    timeout_s: float = COLLECTIVE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.layout.grad_sync is None or self.layout.recompute is None or not self.layout.placement:
            raise ValueError(f"strategy={self.layout.strategy} is a baseline, not a pipeline schedule: it has no "
                             "pipeline config")

    @property
    def schedule(self) -> str:
        return self.layout.strategy

    @property
    def stages(self) -> int:
        """D: workers per pipeline."""
        return self.layout.D

    @property
    def micro_batch_size(self) -> int:
        return self.layout.B

    @property
    def micro_batches(self) -> int:
        """N of every training step."""
        return self.layout.N

    @property
    def pipelines(self) -> int:
        return self.layout.pipelines

    @property
    def concat(self) -> str:
        """Chimera's concatenation method that runs (``strategy.concat=auto`` resolved before launch)."""
        return self.layout.concat

    @property
    def chunks(self) -> int | None:
        """Stages per worker (v) as set; None: the schedule's own (interleaved 1F1B: 2)."""
        return self.layout.chunks

    @property
    def grad_sync(self) -> str:
        return self.layout.grad_sync or DEFAULT_GRAD_SYNC

    @property
    def recompute(self) -> str:
        return self.layout.recompute or DEFAULT_RECOMPUTE

    @property
    def cuda_graphs(self) -> bool:
        """Repeated blocks replayed as CUDA graphs per micro-batch slot
        (:mod:`pipeline_recipes.strategies.compute.cuda_graphs`)."""
        return self.layout.cuda_graphs

    @property
    def num_stages(self) -> int:
        """S = v·D: the stages the model is split into (D for one stage per worker)."""
        return self.layout.stages

    @property
    def is_async(self) -> bool:
        """PipeDream / PipeDream-2BW: no flush, stashed weight versions, delayed updates."""
        return get_spec(self.schedule).asynchronous

    def build(self, micro_batches: int) -> Schedule:
        """The schedule of N = ``micro_batches`` with the layout's settings (its concatenation method)."""
        return build_schedule(self.schedule, self.stages, micro_batches, self.pipelines, self.concat,
                              chunks=self.chunks)


def build_engine(
    model: nn.Module,
    layout: Layout,
    device: torch.device,
    partition: Sequence[range] | None = None,
    *,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> PipelineEngine:
    """The set-up: this rank's share of the pipeline of ``layout`` (resolved and checked before launch, e.g. by
    :func:`pipeline_recipes.strategies.schedules.derive_layout`) on ``device`` (``partition``: the layers of each
    stage; ``None``: by layer count; ``timeout_s``: how long any wait may take), assembled once, and the step object
    that trains it. Collective: every rank calls it."""
    config = PipelineConfig(layout, timeout_s)
    setup = assemble(model, config, device, partition)
    return AsynchronousStep(setup) if config.is_async else SynchronousStep(setup)


class PipelineEngine(ABC):
    """One rank's pipeline-parallel steps: a :class:`SynchronousStep` or an :class:`AsynchronousStep`, which
    :func:`build_engine` picks for the config's schedule (a step class is constructed from a
    :class:`~pipeline_recipes.strategies.runtime.rank_setup.RankSetup`).

    ``steps_taken``: the optimizer steps run; ``loss_step``: the step whose loss :meth:`train_step` returned
    last; ``last_record``: what the last step measured; ``idle_work``: host work for a step's longest bubble
    (the next batch, :mod:`pipeline_recipes.strategies.runtime.fetch_ahead`), which only a synchronous step has;
    ``stage_graphs``: the repeated blocks' CUDA graphs under ``cuda_graphs``
    (:class:`~pipeline_recipes.strategies.compute.cuda_graphs.StageGraphs`, set by whoever knows the blocks: the Lightning
    module when fitting starts), captured at the start of a synchronous step."""

    def __init__(self, setup: RankSetup, executor: StageExecutor) -> None:
        self.setup, self.executor = setup, executor
        self.steps_taken = 0
        self.loss_step = 0
        self.last_record: StepRecord | None = None
        self.idle_work: Callable[[], None] | None = None
        self.stage_graphs: StageGraphs | None = None  # strategy.cuda_graphs, installed once the blocks are known
        # collected on first use, after materialisation (which replaces the meta parameters)
        self._local_parameters: tuple[nn.Parameter, ...] | None = None
        # strategy.shard_optimizer: each optimizer built here (by id) → its groups' parameters before sharding
        self._whole_groups: dict[int, list[list[nn.Parameter]]] = {}

    # -- what a step does ---------------------------------------------------------------------

    @abstractmethod
    def train_step(self, batch: Batch) -> Tensor:
        """Forward and backward of the replica's mini-batch, gradients summed for the optimizer; returns a
        mini-batch loss (every rank the same), that of step :attr:`loss_step`."""

    @abstractmethod
    def flush_losses(self) -> list[tuple[int, Tensor]]:
        """(step, loss) of every step whose loss :meth:`train_step` has not returned yet, oldest first."""

    @abstractmethod
    def eval_schedule(self, micro_batches: int) -> Schedule:
        """The schedule whose forwards :meth:`eval_step` runs."""

    @abstractmethod
    def last_executed(self, micro_batches: int) -> Schedule:
        """The schedule of the last step."""

    @abstractmethod
    def whole_run(self, micro_batches: int) -> Schedule:
        """What ran so far as one schedule (its bubbles are the run's)."""

    @abstractmethod
    def norm_groups(self) -> list[tuple[list[nn.Parameter], Tensor]]:
        """The parameters :meth:`clip_grad_norm_` scales together, each group with its gradients' norm."""

    # -- the set-up, as the strategy and the tools read it --------------------------------------

    @property
    def config(self) -> PipelineConfig:
        return self.setup.config

    @property
    def topology(self) -> Topology:
        return self.setup.topology

    @property
    def partition(self) -> list[range]:
        """The layers of every stage."""
        return self.setup.partition

    @property
    def local_stages(self) -> tuple[int, ...]:
        return self.setup.local_stages

    @property
    def stage_layers(self) -> dict[int, list[nn.Module]]:
        return self.setup.stage_layers

    @property
    def synchronizer(self) -> GradientSynchronizer:
        return self.setup.synchronizer

    @property
    def timeout(self) -> timedelta:
        return self.setup.timeout

    # -- what every step does alike -------------------------------------------------------------

    def local_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (its stages'), each once (collected on the first call)."""
        if self._local_parameters is None:
            layers = [layer for ls in self.stage_layers.values() for layer in ls]
            self._local_parameters = tuple(unique_parameters(layers))
        return list(self._local_parameters)

    @cache  # noqa: B019 - one engine per process
    def schedule_for(self, micro_batches: int) -> Schedule:
        return self.config.build(micro_batches)

    def split(self, batch: Batch) -> list[dict]:
        size = next(v.shape[0] for v in batch.values() if isinstance(v, Tensor))
        if size % self.config.micro_batch_size:
            raise ValueError(
                f"a replica's mini-batch of {size} samples is not a multiple of micro_batch_size = "
                f"{self.config.micro_batch_size}"
            )
        return split_batch(batch, size // self.config.micro_batch_size)

    def split_for_training(self, batch: Batch) -> list[dict]:
        """:meth:`split`, the micro-batches checked against the N the layout resolved (never derived from the
        batch): :class:`~pipeline_recipes.core.layout.LayoutMismatch` where they differ."""
        micro_batches = self.split(batch)
        expected = self.config.micro_batches
        if len(micro_batches) != expected:
            B = self.config.micro_batch_size
            raise LayoutMismatch(
                f"a replica's training batch of {len(micro_batches) * B} samples makes N = {len(micro_batches)} "
                f"micro-batches of B = {B}, but the layout resolved before launch has N = {expected} (a replica's "
                f"batch of {expected * B} = data.global_batch_size / W): the data module must give each replica "
                "data.global_batch_size / W samples per step (drop an incomplete last batch)"
            )
        return micro_batches

    def _totals(self, batch: Batch) -> dict[str, Tensor]:
        """Loss normalisers over the global mini-batch (all replicas), as device scalars: reading
        them on the host would synchronise with the device before the schedule starts. Counts add
        up over samples, so the replica's mini-batch is counted at once, not per micro-batch."""
        counts = loss_counts(self.setup.model, batch)
        names = sorted(counts)
        local = torch.stack([counts[n] for n in names]).to(self.setup.device)
        if self.setup.groups.peer is not None:  # one rank per replica: no line-up of a replica's stages
            dist.all_reduce(local, group=self.setup.groups.peer)
        local = local.to(torch.float32)  # counts are exact in float32; losses are float32
        return {name: local[i] for i, name in enumerate(names)}

    @torch.no_grad()
    def eval_step(self, batch: Batch) -> Tensor:
        """The mini-batch loss (every rank the same), forwards only."""
        micro_batches = self.split(batch)
        record = self.executor.run(self.eval_schedule(len(micro_batches)), micro_batches, self._totals(batch),
                                   train=False)
        value = record.loss_sum.to(self.setup.device, torch.float32)
        dist.all_reduce(value)
        return value

    def build_optimizer(self, factory: Callable[[list[dict]], Optimizer], groups: list[dict]) -> Optimizer:
        """The optimizer of this rank's parameters, ``factory(groups)`` (``groups``: parameter groups over
        :meth:`local_parameters`). With ``strategy.shard_optimizer`` it holds this rank's segments of the sharded
        parameters instead (:func:`~pipeline_recipes.strategies.runtime.optimizer_shards.optimizer_groups`), and every
        step of it ends by gathering the updated parameters (a post-step hook): a collective, so every rank steps."""
        shards = self.synchronizer.shards
        if not shards:
            return factory(groups)
        optimizer = factory(optimizer_groups(groups, shards))
        optimizer.register_step_post_hook(lambda *_: self.synchronizer.gather_parameters())
        self._whole_groups[id(optimizer)] = [list(g["params"]) for g in groups]
        return optimizer

    def segments(self) -> list[Segment]:
        """With sharded optimizer state, the segments this rank steps (each a slice of one parameter); else none."""
        return [s for shard in self.synchronizer.shards for s in shard.segments]

    def whole_groups(self, optimizer: Optimizer) -> list[list[nn.Parameter]] | None:
        """The parameters of each group of ``optimizer`` (built by :meth:`build_optimizer` with sharded state) before
        sharding, also those whose slices other ranks step; None for an optimizer of whole parameters."""
        return self._whole_groups.get(id(optimizer))

    def drop_gradients(self) -> None:
        """No gradient this step (a non-finite loss skipped): the optimizer leaves every parameter and its state
        alone."""
        self.synchronizer.drop_gradients(self.local_parameters())

    def stepped_parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps: with sharded optimizer state, this rank's segments of the sharded parameters
        and the parameters of stages with a single copy; else :meth:`local_parameters`."""
        shards = self.synchronizer.shards
        if not shards:
            return self.local_parameters()
        sharded = sharded_ids(shards)
        return ([s.shard for shard in shards for s in shard.segments]
                + [p for p in self.local_parameters() if id(p) not in sharded])

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Scale the gradients of each of :meth:`norm_groups` so that its norm is at most ``max_norm``."""
        for params, norm in self.norm_groups():
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)

    def grad_norm_sq(self) -> Tensor:
        """Squared global gradient norm: each stage (and a tied parameter) counted once, not per copy (sharded: each
        element once, in the slice of the rank that steps it)."""
        total = torch.zeros((), dtype=torch.float32, device=self.setup.device)
        if self.synchronizer.shards:
            for p in self.stepped_parameters():
                if p.grad is not None:
                    total += p.grad.detach().float().square().sum()
            dist.all_reduce(total)
            return total
        tied = self.synchronizer.tied_params
        for stage, params in self.synchronizer.buckets.items():
            counted = list(params) + (tied if stage == 0 else [])
            for p in counted:
                if p.grad is not None:
                    total += p.grad.detach().float().square().sum()
        dist.all_reduce(total)
        return total / (len(self.topology.placement) * self.topology.replicas)


class SynchronousStep(PipelineEngine):
    """A step that flushes: this rank's actions of the step's schedule, the stage gradients all-reduced (at
    the end, or each stage's as soon as its last backward here ran: Chimera §3.2), the loss summed over the
    world while the last actions run. Every step's gradients and loss are its own."""

    def __init__(self, setup: RankSetup) -> None:
        super().__init__(setup, setup.build_executor())
        # gloo's waits block the host: each rank posts the loss all-reduce before its last action (once its
        # share is final), so the step's last rank finds it done (NCCL's waits are stream-ordered: posted at
        # the step's end)
        self._host_waits = dist.get_backend() == "gloo"

    @cache  # noqa: B019 - one engine per process
    def launch_plan(self, micro_batches: int) -> dict[Action, tuple[int, ...]]:
        """Backward action → local stages whose gradient all-reduce starts after it (§3.2)."""
        schedule = self.schedule_for(micro_batches)
        return launch_plan(schedule, self.topology.worker_of(self.setup.rank), self.config.grad_sync)

    def train_step(self, batch: Batch) -> Tensor:
        """Forward and backward of the replica's mini-batch, gradients summed; returns this step's
        mini-batch loss (every rank the same)."""
        micro_batches = self.split_for_training(batch)
        sync = self.synchronizer
        sync.zero_grad(self.local_parameters())
        if self.stage_graphs is not None:  # captured here, before this step posts any message
            self.stage_graphs.before_step(self.schedule_for(len(micro_batches)))
        plan = self.launch_plan(len(micro_batches))

        def after_backward(action: Action) -> None:
            for stage in plan.get(action, ()):
                sync.launch(stage)

        posted: list[tuple[Tensor, dist.Work]] = []

        def post_loss(loss_sum: Tensor) -> None:  # this rank's share is final: sum it during the last action
            value = loss_sum.to(self.setup.device, torch.float32)
            posted.append((value, dist.all_reduce(value, async_op=True)))

        self.last_record = self.executor.run(
            self.schedule_for(len(micro_batches)), micro_batches, self._totals(batch),
            after_backward=after_backward if plan else None, loss_final=post_loss if self._host_waits else None,
            idle_work=self.idle_work,
        )
        self.loss_step = self.steps_taken
        self.steps_taken += 1
        if not posted:  # NCCL: posted at the step's end
            post_loss(self.last_record.loss_sum)
        (value, work), = posted
        sync.finish()  # the gradients' all-reduces overlap the loss's
        work.wait()  # stream-ordered on NCCL; the process group's timeout guards it
        return value

    def flush_losses(self) -> list[tuple[int, Tensor]]:
        """None: every step returns its own loss."""
        return []

    def eval_schedule(self, micro_batches: int) -> Schedule:
        return self.schedule_for(micro_batches)

    def last_executed(self, micro_batches: int) -> Schedule:
        return self.schedule_for(micro_batches)

    def whole_run(self, micro_batches: int) -> Schedule:
        """One step: every step flushes, so every step has the same bubbles."""
        return self.schedule_for(micro_batches)

    def norm_groups(self) -> list[tuple[list[nn.Parameter], Tensor]]:
        """What the optimizer steps, with the global norm over all stages."""
        return [(self.stepped_parameters(), self.grad_norm_sq().sqrt())]


class AsynchronousStep(PipelineEngine):
    """One window per step of PipeDream / PipeDream-2BW: the step's forwards run on a stashed copy of the
    weights, the backwards due now (some of earlier steps) on the copies their forwards used, and each stage
    hands the gradient of the version due (if any) to the optimizer; the loss comes a step or more late."""

    def __init__(self, setup: RankSetup) -> None:
        config = setup.config
        versions = WeightVersions(config.schedule, config.stages, setup.stage_layers, _tied_delays(setup))
        super().__init__(setup, setup.build_executor(versions))
        self.versions = versions
        self.windows = AsyncWindows(self.executor)
        # the loss all-reduces start a few steps at a time, overlapping the following steps
        self.late_losses = LateLosses(config.stages, lambda losses: dist.all_reduce(losses, async_op=True))

    def train_step(self, batch: Batch) -> Tensor:
        """This step's window: forwards on this step's weight version, the backwards due now, then the
        gradient of the version due (if any) is all-reduced into ``.grad`` for the optimizer; otherwise
        ``.grad`` stays unset (no update). Returns an earlier step's loss (one step late, or ceil((D - 1) / N)
        when the pipeline is deeper than a step: its all-reduce overlaps the following steps, so the stages
        never line up; :mod:`pipeline_recipes.strategies.runtime.late_loss`), the first step its own; :attr:`loss_step`
        says which step, :meth:`flush_losses` gives those not reported yet."""
        micro_batches = self.split_for_training(batch)
        for p in self.local_parameters():
            p.grad = None  # the step's due version hands its gradient over at the end
        totals = self._totals(batch)
        N, step = len(micro_batches), self.steps_taken
        current = window(self.config.schedule, self.config.stages, N, step)
        self.versions.begin_step(step)
        first = current.meta["first_mb"]
        self.last_record = self.windows.run(current, {first + i: mb for i, mb in enumerate(micro_batches)}, totals)
        stage_due, tied_due = self.versions.end_step(step)  # alike on every copy of a stage: the schedule decides
        # the loss all-reduce (every few steps) starts before the gradients' are waited for
        self.late_losses.add(step, self.last_record.loss_sum.to(self.setup.device, torch.float32), N)
        if stage_due or tied_due:
            self.synchronizer.finish(tied=tied_due)
        self.steps_taken += 1
        loss, self.loss_step = self.late_losses.report(step, N)  # until the lag is filled, the first step's
        return loss

    def flush_losses(self) -> list[tuple[int, Tensor]]:
        """Every rank calls it at the same step: it starts the all-reduce of the last steps' losses and
        waits for them all."""
        out = self.late_losses.flush()
        if out:
            self.loss_step = out[-1][0]
        return out

    @cache  # noqa: B019 - one engine per process
    def eval_schedule(self, micro_batches: int) -> Schedule:
        """DAPPLE's forwards (no weight versions involved)."""
        return dapple(self.config.stages, micro_batches)

    def last_executed(self, micro_batches: int) -> Schedule:
        """The last step's window."""
        return window(self.config.schedule, self.config.stages, micro_batches, max(self.steps_taken - 1, 0))

    def whole_run(self, micro_batches: int) -> Schedule:
        """The steps so far without flushes: the bubbles are the first fill and the final drain."""
        return build_schedule(self.config.schedule, self.config.stages, micro_batches, steps=max(self.steps_taken, 1))

    def norm_groups(self) -> list[tuple[list[nn.Parameter], Tensor]]:
        """Each stage's own norm: its copies hold the same summed gradient, so the norm needs no collective and
        the stages never line up; tied parameters are one group, scaled alike on both holders."""
        sync = self.synchronizer
        groups = [g for g in [*map(list, sync.buckets.values()), sync.tied_params] if g]
        zero = torch.zeros((), device=self.setup.device)
        return [(g, torch.stack([p.grad.detach().float().square().sum() for p in g if p.grad is not None]
                                or [zero]).sum().sqrt()) for g in groups]


def _tied_delays(setup: RankSetup) -> dict[int, int]:
    """A tied parameter updates with the largest delay of the stages holding it (id(parameter) → delay)."""
    config = setup.config
    holders = {s for group in setup.tied_groups for index, _ in group
               for s, layers in enumerate(setup.partition) if index in layers}
    delay = max((weight_delay(config.schedule, s, config.stages) for s in holders), default=0)
    return {id(p): delay for p in setup.tied}
