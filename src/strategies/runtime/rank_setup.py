"""The engine's set-up: this rank's share of the pipeline, assembled once before the first step.

:func:`assemble` builds what every kind of step runs on, a :class:`RankSetup`: the topology of W replicas × D
workers and the stages each rank holds, the layout's, checked against the schedule a step runs
(:class:`~pipeline_recipes.strategies.runtime.topology.Topology`), the layers of
this rank's stages (materialised from the meta device, the others dropped:
:func:`~pipeline_recipes.core.pipeline_model.materialize_local`), the process groups (the copies of each
stage, the tied parameters, a worker's replicas, the point-to-point channels), the gradient synchroniser
(Chimera §3.2, :mod:`pipeline_recipes.strategies.runtime.grad_sync`) and the stages recomputed in backward (GPipe §2.3,
re-materialization: :mod:`pipeline_recipes.strategies.runtime.recompute`). Every rank creates the same groups in the same
order. :func:`pipeline_recipes.strategies.runtime.engine.build_engine` hands the result to a step object.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipeline_recipes.core.layout import Layout, LayoutMismatch
from pipeline_recipes.strategies.compute.cuda_graph_rules import cuda_graphs_error
from pipeline_recipes.strategies.runtime.executor import StageExecutor
from pipeline_recipes.strategies.runtime.grad_sync import GradientSynchronizer
from pipeline_recipes.strategies.runtime.p2p import PipeComm, replica_groups
from pipeline_recipes.core.pipeline_model import PipelineModel, TiedGroup, materialize_local
from pipeline_recipes.strategies.runtime.recompute import recompute_stages
from pipeline_recipes.strategies.runtime.stage import unique_parameters
from pipeline_recipes.strategies.runtime.topology import Topology
from pipeline_recipes.strategies.runtime.versions import WeightVersions
from pipeline_recipes.strategies.schedules import Schedule, build_schedule, get_spec

if TYPE_CHECKING:
    from pipeline_recipes.strategies.runtime.engine import PipelineConfig


def even_partition(num_layers: int, stages: int) -> list[range]:
    """Contiguous split of ``num_layers`` layers into ``stages`` stages by layer count."""
    if stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages: use at most {num_layers} stages")
    base, extra = divmod(num_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (1 if s >= stages - extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's collective groups: its stages' copies, the tied parameters' holders (``None`` where
    a group would have one rank), the W ranks of its worker index (``peer``, one per replica) and the
    groups that fuse several buckets of the gradient synchroniser (``shared``)."""

    stages: dict[int, dist.ProcessGroup | None]
    tied: dist.ProcessGroup | None
    peer: dist.ProcessGroup | None
    shared: dict[int | str, dist.ProcessGroup]


@dataclass(frozen=True)
class RankSetup:
    """What a step runs on: this rank's share of the pipeline (built by :func:`assemble`).

    ``partition``: the layers of every stage, this rank's or not; ``stage_layers``: this rank's stages'
    layers; ``tied_groups``: the model's tied parameters; ``tied``: those this rank holds, each once;
    ``recompute``: the stages whose forwards are recomputed in backward; ``split_backward``: the stages
    whose backwards the schedule runs as ``I`` + ``W``."""

    model: PipelineModel
    config: PipelineConfig
    device: torch.device
    rank: int
    timeout: timedelta
    topology: Topology
    partition: list[range]
    local_stages: tuple[int, ...]
    stage_layers: dict[int, list[nn.Module]]
    tied_groups: list[TiedGroup]
    tied: list[nn.Parameter]
    groups: ProcessGroups
    synchronizer: GradientSynchronizer
    comm: PipeComm
    recompute: frozenset[int]
    split_backward: frozenset[int]

    def build_executor(self, versions: WeightVersions | None = None) -> StageExecutor:
        """An executor of this rank's actions; ``versions``: the stashed weights its forwards run on."""
        return StageExecutor(self.model, self.stage_layers, self.topology, self.rank, self.comm,
                             recompute=self.recompute, versions=versions, split_backward=self.split_backward)


def assemble(
    model: nn.Module,
    config: PipelineConfig,
    device: torch.device,
    partition: Sequence[range] | None = None,
) -> RankSetup:
    """This rank's share of the pipeline of ``config``'s layout on ``device``; ``partition``: the layers of each stage
    (``None``: :func:`even_partition`). The topology is the layout's (:meth:`Topology.from_layout`), checked against
    the schedule a step runs and the processes that joined. Collective: every rank calls it."""
    if not isinstance(model, PipelineModel):
        raise TypeError(f"{type(model).__name__} must implement "
                        "pipeline_recipes.core.pipeline_model.PipelineModel")
    rank, timeout = dist.get_rank(), timedelta(seconds=config.timeout_s)
    layout = config.layout
    layout.check_world_size(dist.get_world_size())
    topology = Topology.from_layout(layout)
    schedule = check_layout(layout)
    layers = model.pipeline_layers()
    S = topology.stages
    split = list(partition) if partition is not None else even_partition(len(layers), S)
    if len(split) != S:
        raise ValueError(f"the partition has {len(split)} stages but the schedule has S = {S}: "
                         f"split the model into {S} stages")
    local_stages = topology.stages_of(rank)
    local = {i for s in local_stages for i in split[s]}
    stage_layers = {s: [layers[i] for i in split[s]] for s in local_stages}
    tied_groups = model.tied_parameters()  # before remote layers are dropped
    # a model built on the meta device: only this rank's layers (and tied copies) become real
    materialize_local(model, [i for s in local_stages for i in split[s]], device)
    _drop_remote_layers(layers, local)
    model.to(device)
    groups = _create_groups(topology, rank, timeout, bool(tied_groups), fuse=config.grad_sync == "end")
    _check_identical_copies(topology, stage_layers, groups.stages)
    tied = _local_tied_parameters(model, tied_groups, local)
    synchronizer = GradientSynchronizer({s: unique_parameters(ls) for s, ls in stage_layers.items()}, groups.stages,
                                        tied, groups.tied, timeout, shared=groups.shared, shard=layout.shard_optimizer)
    data_group, header_group = replica_groups([topology.replica_group(r) for r in range(topology.replicas)], rank,
                                              timeout)
    return RankSetup(
        model, config, device, rank, timeout, topology, split, local_stages, stage_layers, tied_groups, tied, groups,
        synchronizer, PipeComm(device, timeout, data_group, header_group), recompute_stages(config.recompute, S),
        frozenset(a.stage for acts in schedule.workers for a in acts if a.kind == "I"),
    )


def check_layout(layout: Layout) -> Schedule:
    """The schedule a training step of ``layout`` runs, checked against the layout: built at the layout's N (the
    schedule's rules, :mod:`pipeline_recipes.strategies.schedules.registry`), its workers, stages and placement the
    layout's, and nothing CUDA graphs cannot capture where ``layout.cuda_graphs`` is set. The launcher derived and
    checked the layout before (:func:`pipeline_recipes.strategies.schedules.derive_layout`); these are the checks a
    direct user of the engine gets for a layout of its own (:class:`~pipeline_recipes.core.layout.LayoutMismatch`,
    or the rule's message as a ``ValueError``)."""
    topology = Topology.from_layout(layout)
    schedule = build_schedule(layout.strategy, layout.D, layout.N, layout.pipelines, layout.concat,
                              chunks=layout.chunks)
    built = (schedule.num_workers, schedule.stages, schedule.placement)
    if built != (topology.workers, topology.stages, topology.placement):
        raise LayoutMismatch(
            f"the layout of strategy={layout.strategy} places S = {topology.stages} stages on D = {topology.workers} "
            f"workers as {list(map(list, topology.placement))}, but its schedule at N = {layout.N} has "
            f"{schedule.stages} stages on {schedule.num_workers} workers placed as "
            f"{list(map(list, schedule.placement))}: derive the layout with "
            "pipeline_recipes.strategies.schedules.derive_layout (as the launcher does) rather than by hand")
    refusal = cuda_graphs_error(layout.cuda_graphs, get_spec(layout.strategy), layout.recompute or "none", schedule)
    if refusal is not None:  # the launcher's rule (recipe.settings), for a layout the launcher did not check
        raise ValueError(refusal)
    return schedule


def _drop_remote_layers(layers: Sequence[nn.Module], local: Collection[int]) -> None:
    if isinstance(layers, nn.ModuleList):
        for i in range(len(layers)):
            if i not in local:
                layers[i] = nn.Identity()


def _create_groups(topology: Topology, rank: int, timeout: timedelta, tied: bool, fuse: bool) -> ProcessGroups:
    """Same groups, same order, on every rank; groups of one rank are skipped everywhere. ``fuse``: the
    groups of :class:`ProcessGroups` ``shared`` too (``grad_sync=end``)."""
    stages: dict[int, dist.ProcessGroup | None] = {}
    for stage in range(topology.stages):
        ranks = topology.stage_group(stage)
        group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
        if rank in ranks:
            stages[stage] = group
    tied_group = None
    if tied:
        ranks = topology.tied_group()
        group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
        tied_group = group if rank in ranks else None
    peer = _create_peer_group(topology, rank, timeout)
    shared = _create_shared_groups(topology, rank, timeout, tied) if fuse else {}
    return ProcessGroups(stages, tied_group, peer, shared)


def _create_peer_group(topology: Topology, rank: int, timeout: timedelta) -> dist.ProcessGroup | None:
    """The W ranks of this rank's worker index, one per replica (they read the same share of
    every replica's batch): loss normalisers are summed there, not over the world."""
    if topology.replicas == 1:
        return None
    mine = None
    for worker in range(topology.workers):
        ranks = [topology.rank_of(r, worker) for r in range(topology.replicas)]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def _create_shared_groups(topology: Topology, rank: int, timeout: timedelta, tied: bool
                          ) -> dict[int | str, dist.ProcessGroup]:
    """One group per set of ranks that all-reduces two or more buckets (stages, tied embeddings),
    so that :class:`~pipeline_recipes.strategies.runtime.grad_sync.GradientSynchronizer` can fuse them."""
    users: dict[tuple[int, ...], list[int | str]] = {}
    for stage in range(topology.stages):
        users.setdefault(topology.stage_group(stage), []).append(stage)
    if tied:
        users.setdefault(topology.tied_group(), []).append("tied")
    shared: dict[int | str, dist.ProcessGroup] = {}
    for ranks, keys in users.items():
        if len(ranks) < 2 or len(keys) < 2:
            continue
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            shared.update({key: group for key in keys})
    return shared


def _check_identical_copies(topology: Topology, stage_layers: dict[int, list[nn.Module]],
                            groups: dict[int, dist.ProcessGroup | None]) -> None:
    """All copies of a stage must start from identical weights (same seed on every rank)."""
    for stage in sorted(groups):
        params = unique_parameters(stage_layers[stage])
        if not params:
            continue
        local = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                             for p in params])
        lo, hi = local.clone(), local.clone()
        if groups[stage] is not None:
            dist.all_reduce(lo, dist.ReduceOp.MIN, group=groups[stage])
            dist.all_reduce(hi, dist.ReduceOp.MAX, group=groups[stage])
        if not torch.equal(lo, hi):
            raise RuntimeError(
                f"copies of stage {stage} start from different weights on ranks "
                f"{topology.stage_group(stage)}: seed the model identically on every rank"
            )


def _local_tied_parameters(model: PipelineModel, tied_groups: Sequence[TiedGroup], local: Collection[int]
                           ) -> list[nn.Parameter]:
    layers = model.pipeline_layers()
    found: dict[int, nn.Parameter] = {}
    for group in tied_groups:
        for index, name in group:
            if index in local:
                p = layers[index].get_parameter(name)
                found.setdefault(id(p), p)
    return list(found.values())
