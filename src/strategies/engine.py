"""One pipeline-parallel training step, independent of Lightning: split, run, synchronise.

:class:`PipelineEngine` builds the topology and process groups for W replicas × D stages,
keeps this rank's stages of a :class:`~strategies.pipeline_model.PipelineModel`, and runs a
step: split the replica's mini-batch into N micro-batches, execute this rank's actions of the
schedule, all-reduce stage gradients (at the end, or eagerly as stage copies finish: Chimera
§3.2, :mod:`strategies.grad_sync`), and return the mini-batch loss on every rank. Stage
forwards may be recomputed in backward to save activation memory (GPipe re-materialization,
:mod:`strategies.recompute`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cache

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .executor import AsyncWindows, StageExecutor, StepRecord, loss_counts
from .grad_sync import GRAD_SYNC_MODES, GradientSynchronizer, launch_plan
from .late_loss import LateLosses
from .p2p import PipeComm, replica_groups
from .pipeline_model import Batch, PipelineModel, materialize_local, split_batch
from .recompute import RECOMPUTE_MODES, recompute_stages
from .schedules import Action, Schedule, Settings, build_schedule, dapple, get_spec, resolve_concat, validate
from .schedules.asynchronous import run as async_run
from .schedules.asynchronous import weight_delay, window
from .stage import unique_parameters
from .topology import Topology
from .versions import WeightVersions


@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline layout and runtime options; derived N comes from the batch at run time.

    ``grad_sync``: ``end`` | ``eager`` | ``eager_opt`` (Chimera §3.2, see :mod:`.grad_sync`).
    ``recompute``: ``none`` | ``except_last`` | ``always`` (see :mod:`.recompute`).
    """

    schedule: str = "gpipe"
    stages: int = 2
    micro_batch_size: int = 1
    pipelines: int | None = None
    concat: str = "direct"  # or "auto" (Chimera only): picked per N by best_concat
    timeout_s: float = 120.0
    grad_sync: str = "end"
    recompute: str = "none"
    chunks: int | None = None  # stages per worker (v); None: the schedule's own (interleaved 1F1B: 2)

    def __post_init__(self) -> None:
        for name, value, choices in (("grad_sync", self.grad_sync, GRAD_SYNC_MODES),
                                     ("recompute", self.recompute, RECOMPUTE_MODES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        # the schedule's rules that do not depend on N (the batch): strategies.schedules.registry
        get_spec(self.schedule).check(Settings(self.schedule, self.stages, None, self.micro_batch_size, self.pipelines,
                                               self.concat, self.chunks, grad_sync=self.grad_sync,
                                               recompute=self.recompute))

    @property
    def num_stages(self) -> int:
        """S = v·D: the stages the model is split into (D for one stage per worker)."""
        return get_spec(self.schedule).total_stages(self.stages, self.chunks)

    @property
    def is_async(self) -> bool:
        """PipeDream / PipeDream-2BW: no flush, stashed weight versions, delayed updates."""
        return get_spec(self.schedule).asynchronous

    @property
    def smallest_micro_batches(self) -> int:
        """The least N the schedule accepts (to build the topology before any batch is seen)."""
        return get_spec(self.schedule).smallest_micro_batches(self.stages)

    def concat_for(self, micro_batches: int) -> str:
        """The concatenation method run at N = ``micro_batches`` (``auto``: the fastest, see
        :func:`strategies.schedules.best_concat`)."""
        return resolve_concat(self.schedule, self.stages, micro_batches, self.pipelines, self.micro_batch_size,
                              self.concat)

    def build(self, micro_batches: int) -> Schedule:
        return validate(build_schedule(self.schedule, self.stages, micro_batches, self.pipelines,
                                       self.concat_for(micro_batches), chunks=self.chunks))


def even_partition(num_layers: int, stages: int) -> list[range]:
    """Contiguous split of ``num_layers`` layers into ``stages`` stages by layer count."""
    if stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages: use at most {num_layers} stages")
    base, extra = divmod(num_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (1 if s >= stages - extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


class PipelineEngine:
    def __init__(
        self,
        model: nn.Module,
        config: PipelineConfig,
        replicas: int,
        device: torch.device,
        partition: Sequence[range] | None = None,
    ) -> None:
        if not isinstance(model, PipelineModel):
            raise TypeError(f"{type(model).__name__} must implement pipeline_recipes.strategies.pipeline_model.PipelineModel")
        self.model, self.config, self.device = model, config, device
        self.rank = dist.get_rank()
        self.timeout = timedelta(seconds=config.timeout_s)
        smallest = config.build(config.smallest_micro_batches)
        self.topology = Topology.from_schedule(smallest, replicas)
        if self.topology.world_size != dist.get_world_size():
            raise ValueError(
                f"W·D = {replicas}·{config.stages} = {self.topology.world_size} but the world size is "
                f"{dist.get_world_size()}; set the replicas/stages so that W·D equals the number of processes"
            )
        layers = model.pipeline_layers()
        S = self.topology.stages
        self.partition = list(partition) if partition is not None else even_partition(len(layers), S)
        if len(self.partition) != S:
            raise ValueError(f"the partition has {len(self.partition)} stages but the schedule has S = {S}: "
                             f"split the model into {S} stages")
        self.local_stages = self.topology.stages_of(self.rank)
        self.stage_layers = {s: [layers[i] for i in self.partition[s]] for s in self.local_stages}
        self.tied_groups = model.tied_parameters()  # before remote layers are dropped
        # a model built on the meta device: only this rank's layers (and tied copies) become real
        materialize_local(model, [i for s in self.local_stages for i in self.partition[s]], device)
        self._drop_remote_layers(layers)
        self.model.to(device)
        stage_groups, tied_group = self._create_groups()
        self.peer_group = self._create_peer_groups()
        shared = self._create_shared_groups() if config.grad_sync == "end" else {}
        self._check_identical_copies(stage_groups)
        tied = self._local_tied_parameters()
        self.versions = (WeightVersions(config.schedule, config.stages, self.stage_layers, self._tied_delays(tied))
                         if config.is_async else None)
        self.steps_taken = 0  # optimizer steps run (asynchronous schedules: which window comes next)
        # asynchronous schedules report the loss late, its all-reduces started a few steps at a time
        self.late_losses = LateLosses(config.stages, lambda losses: dist.all_reduce(losses, async_op=True))
        self.loss_step = 0  # the step whose loss train_step returned last
        # gloo's waits block the host: each rank posts the loss all-reduce before its last action (once its
        # share is final), so the step's last rank finds it done (NCCL's waits are stream-ordered: posted at
        # the step's end)
        self._host_waits = dist.get_backend() == "gloo"
        self.synchronizer = GradientSynchronizer(
            {s: self._params(ls) for s, ls in self.stage_layers.items()}, stage_groups, tied, tied_group, self.timeout,
            shared=shared,
        )
        replicas_ranks = [self.topology.replica_group(r) for r in range(replicas)]
        data_group, header_group = replica_groups(replicas_ranks, self.rank, self.timeout)
        self.executor = StageExecutor(
            model, self.stage_layers, self.topology, self.rank, PipeComm(device, self.timeout, data_group, header_group),
            recompute=recompute_stages(config.recompute, S), versions=self.versions,
            split_backward=frozenset(a.stage for acts in smallest.workers for a in acts if a.kind == "I"),
        )
        self.windows = AsyncWindows(self.executor) if config.is_async else None
        self.last_record: StepRecord | None = None
        # host work for a synchronous step's longest bubble (the next batch): :meth:`StageExecutor.run`
        self.idle_work: Callable[[], None] | None = None
        # collected on first use, after materialisation (which replaces the meta parameters)
        self._local_parameters: tuple[nn.Parameter, ...] | None = None

    # -- set-up -------------------------------------------------------------------------------

    def _drop_remote_layers(self, layers: Sequence[nn.Module]) -> None:
        local = {i for s in self.local_stages for i in self.partition[s]}
        if isinstance(layers, nn.ModuleList):
            for i in range(len(layers)):
                if i not in local:
                    layers[i] = nn.Identity()

    def _create_groups(self) -> tuple[dict[int, dist.ProcessGroup | None], dist.ProcessGroup | None]:
        """Same groups, same order, on every rank; groups of one rank are skipped everywhere."""
        groups: dict[int, dist.ProcessGroup | None] = {}
        for stage in range(self.topology.stages):
            ranks = self.topology.stage_group(stage)
            group = dist.new_group(list(ranks), timeout=self.timeout) if len(ranks) > 1 else None
            if self.rank in ranks:
                groups[stage] = group
        tied_group = None
        if self.tied_groups:
            ranks = self.topology.tied_group()
            group = dist.new_group(list(ranks), timeout=self.timeout) if len(ranks) > 1 else None
            tied_group = group if self.rank in ranks else None
        return groups, tied_group

    def _create_peer_groups(self) -> dist.ProcessGroup | None:
        """The W ranks of this rank's worker index, one per replica (they read the same share of
        every replica's batch): loss normalisers are summed there, not over the world."""
        if self.topology.replicas == 1:
            return None
        mine = None
        for worker in range(self.topology.workers):
            ranks = [self.topology.rank_of(r, worker) for r in range(self.topology.replicas)]
            group = dist.new_group(ranks, timeout=self.timeout)
            if self.rank in ranks:
                mine = group
        return mine

    def _create_shared_groups(self) -> dict[int | str, dist.ProcessGroup]:
        """One group per set of ranks that all-reduces two or more buckets (stages, tied embeddings),
        so that :class:`GradientSynchronizer` can fuse them; created in the same order on every rank."""
        users: dict[tuple[int, ...], list[int | str]] = {}
        for stage in range(self.topology.stages):
            users.setdefault(self.topology.stage_group(stage), []).append(stage)
        if self.tied_groups:
            users.setdefault(self.topology.tied_group(), []).append("tied")
        shared: dict[int | str, dist.ProcessGroup] = {}
        for ranks, keys in users.items():
            if len(ranks) < 2 or len(keys) < 2:
                continue
            group = dist.new_group(list(ranks), timeout=self.timeout)
            if self.rank in ranks:
                shared.update({key: group for key in keys})
        return shared

    @staticmethod
    def _params(layers: Sequence[nn.Module]) -> list[nn.Parameter]:
        return unique_parameters(layers)

    def local_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (its stages'), each once (collected on the first call)."""
        if self._local_parameters is None:
            self._local_parameters = tuple(self._params([layer for ls in self.stage_layers.values() for layer in ls]))
        return list(self._local_parameters)

    def _tied_delays(self, tied: Sequence[nn.Parameter]) -> dict[int, int]:
        """Asynchronous schedules: a tied parameter updates with the largest delay of the stages holding it."""
        holders = {s for group in self.tied_groups for index, _ in group
                   for s, layers in enumerate(self.partition) if index in layers}
        delay = max((weight_delay(self.config.schedule, s, self.config.stages) for s in holders), default=0)
        return {id(p): delay for p in tied}

    def _local_tied_parameters(self) -> list[nn.Parameter]:
        layers = self.model.pipeline_layers()
        local = {i for s in self.local_stages for i in self.partition[s]}
        found: dict[int, nn.Parameter] = {}
        for group in self.tied_groups:
            for index, name in group:
                if index in local:
                    p = layers[index].get_parameter(name)
                    found.setdefault(id(p), p)
        return list(found.values())

    def _check_identical_copies(self, groups: dict[int, dist.ProcessGroup | None]) -> None:
        """All copies of a stage must start from identical weights (same seed on every rank)."""
        for stage in sorted(groups):
            params = self._params(self.stage_layers[stage])
            if not params:
                continue
            local = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()]) for p in params])
            lo, hi = local.clone(), local.clone()
            if groups[stage] is not None:
                dist.all_reduce(lo, dist.ReduceOp.MIN, group=groups[stage])
                dist.all_reduce(hi, dist.ReduceOp.MAX, group=groups[stage])
            if not torch.equal(lo, hi):
                raise RuntimeError(
                    f"copies of stage {stage} start from different weights on ranks "
                    f"{self.topology.stage_group(stage)}: seed the model identically on every rank"
                )

    # -- steps --------------------------------------------------------------------------------

    @cache  # noqa: B019 - one engine per process
    def schedule_for(self, micro_batches: int) -> Schedule:
        return self.config.build(micro_batches)

    def last_executed(self, micro_batches: int) -> Schedule:
        """The schedule of the last step: an asynchronous schedule's last window, else the step's schedule."""
        if self.config.is_async:
            return window(self.config.schedule, self.config.stages, micro_batches, max(self.steps_taken - 1, 0))
        return self.schedule_for(micro_batches)

    def whole_run(self, micro_batches: int) -> Schedule:
        """What ran so far as one schedule: an asynchronous schedule's steps without flushes (its bubbles
        are the first fill and the final drain), else one step (every step flushes)."""
        if self.config.is_async:
            return validate(async_run(self.config.schedule, self.config.stages, micro_batches, max(self.steps_taken, 1)))
        return self.schedule_for(micro_batches)

    @cache  # noqa: B019 - one engine per process
    def launch_plan(self, micro_batches: int) -> dict[Action, tuple[int, ...]]:
        """Backward action → local stages whose gradient all-reduce starts after it (§3.2)."""
        schedule = self.schedule_for(micro_batches)
        return launch_plan(schedule, self.topology.worker_of(self.rank), self.config.grad_sync)

    def split(self, batch: Batch) -> list[dict]:
        size = next(v.shape[0] for v in batch.values() if isinstance(v, Tensor))
        if size % self.config.micro_batch_size:
            raise ValueError(
                f"a replica's mini-batch of {size} samples is not a multiple of micro_batch_size = "
                f"{self.config.micro_batch_size}"
            )
        return split_batch(batch, size // self.config.micro_batch_size)

    def _totals(self, batch: Batch) -> dict[str, Tensor]:
        """Loss normalisers over the global mini-batch (all replicas), as device scalars: reading
        them on the host would synchronise with the device before the schedule starts. Counts add
        up over samples, so the replica's mini-batch is counted at once, not per micro-batch."""
        counts = loss_counts(self.model, batch)
        names = sorted(counts)
        local = torch.stack([counts[n] for n in names]).to(self.device)
        if self.peer_group is not None:  # one rank per replica: no line-up of a replica's stages
            dist.all_reduce(local, group=self.peer_group)
        local = local.to(torch.float32)  # counts are exact in float32; losses are float32
        return {name: local[i] for i, name in enumerate(names)}

    def _world_sum(self, value: Tensor) -> Tensor:
        value = value.to(self.device, torch.float32)
        dist.all_reduce(value)
        return value

    def train_step(self, batch: Batch) -> Tensor:
        """Forward and backward of the replica's mini-batch, gradients summed; returns the mini-batch
        loss (every rank the same). An asynchronous schedule returns an earlier step's loss (one
        step late, or ceil((D - 1) / N) when the pipeline is deeper than a step: its all-reduce
        overlaps the following steps, so the stages never line up; :mod:`.late_loss`), the first step its own;
        :attr:`loss_step` says which step, :meth:`flush_losses` gives those not reported yet."""
        micro_batches = self.split(batch)
        if self.versions is not None:
            for p in self.local_parameters():
                p.grad = None  # the step's due version hands its gradient over at the end
            return self._async_step(micro_batches, self._totals(batch))
        self.synchronizer.zero_grad(self.local_parameters())
        plan = self.launch_plan(len(micro_batches))
        sync = self.synchronizer

        def after_backward(action: Action) -> None:
            for stage in plan.get(action, ()):
                sync.launch(stage)

        posted: list[tuple[Tensor, dist.Work]] = []

        def post_loss(loss_sum: Tensor) -> None:  # this rank's share is final: sum it during the last action
            value = loss_sum.to(self.device, torch.float32)
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

    def _async_step(self, micro_batches: Sequence[Batch], totals: dict[str, Tensor]) -> Tensor:
        """One window of PipeDream / PipeDream-2BW: forwards on this step's weight version, the
        backwards due now (some of earlier steps), then the gradient of the version due (if any)
        is all-reduced into ``.grad`` for the optimizer; otherwise ``.grad`` stays unset (no update)."""
        N, step = len(micro_batches), self.steps_taken
        current = window(self.config.schedule, self.config.stages, N, step)
        self.versions.begin_step(step)
        first = current.meta["first_mb"]
        self.last_record = self.windows.run(
            current, {first + i: mb for i, mb in enumerate(micro_batches)}, totals,
        )
        stage_due, tied_due = self.versions.end_step(step)  # alike on every copy of a stage: the schedule decides
        # the loss all-reduce (every few steps, :mod:`.late_loss`) starts before the gradients' are waited for
        self.late_losses.add(step, self.last_record.loss_sum.to(self.device, torch.float32), N)
        if stage_due or tied_due:
            self.synchronizer.finish(tied=tied_due)
        self.steps_taken += 1
        loss, self.loss_step = self.late_losses.report(step, N)  # until the lag is filled, the first step's
        return loss

    def flush_losses(self) -> list[tuple[int, Tensor]]:
        """(step, loss) of every asynchronous step not reported yet, oldest first. Every rank calls it
        at the same step: it starts the all-reduce of the last steps' losses and waits for them all."""
        out = self.late_losses.flush()
        if out:
            self.loss_step = out[-1][0]
        return out

    @cache  # noqa: B019 - one engine per process
    def _eval_schedule(self, micro_batches: int) -> Schedule:
        """An asynchronous schedule evaluates with DAPPLE's forwards (no weight versions involved)."""
        return dapple(self.config.stages, micro_batches)

    @torch.no_grad()
    def eval_step(self, batch: Batch) -> Tensor:
        micro_batches = self.split(batch)
        N = len(micro_batches)
        schedule = self._eval_schedule(N) if self.config.is_async else self.schedule_for(N)
        record = self.executor.run(schedule, micro_batches, self._totals(batch), train=False)
        return self._world_sum(record.loss_sum)

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Scale gradients so their norm is at most ``max_norm``: the global norm over all stages, or,
        for an asynchronous schedule, each stage's own (its copies hold the same summed gradient, so
        the norm needs no collective and the stages never line up; tied parameters are one group,
        scaled alike on both holders)."""
        if not self.config.is_async:
            groups, norms = [self.local_parameters()], [self.grad_norm_sq().sqrt()]
        else:
            tied = self.synchronizer.tied_params
            groups = [g for g in [*map(list, self.synchronizer.buckets.values()), tied] if g]
            norms = [torch.stack([p.grad.detach().float().square().sum() for p in g if p.grad is not None]
                                 or [torch.zeros((), device=self.device)]).sum().sqrt() for g in groups]
        for params, norm in zip(groups, norms):
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)

    def grad_norm_sq(self) -> Tensor:
        """Squared global gradient norm: each stage (and a tied parameter) counted once, not per copy."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        tied = self.synchronizer.tied_params
        for stage, params in self.synchronizer.buckets.items():
            counted = list(params) + (tied if stage == 0 else [])
            for p in counted:
                if p.grad is not None:
                    total += p.grad.detach().float().square().sum()
        dist.all_reduce(total)
        return total / (len(self.topology.placement) * self.topology.replicas)
