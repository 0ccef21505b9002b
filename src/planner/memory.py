"""Peak memory per rank (Chimera §2 Table 2 and §3.6 Table 3, CAPTURE §III-B) and device budgets.

A rank holds, for each of its stage copies (one for GPipe/DAPPLE, ``2f`` for Chimera): the weights,
their gradients and AdamW's two moments (a tied weight held twice on one rank counts once), and the
activations of its micro-batches in flight. Rather than multiply one activation size by a worst-case
count, :func:`worker_peak` walks the worker's actions in schedule order, as the executor runs them:

* a forward adds the bytes its stage keeps per micro-batch (CAPTURE's M_i + Σ M_a at ``B``; two
  half-size graphs for a halved micro-batch; with recomputation only the stage's boundary input);
* a backward walks the stage's layers last to first: each layer's gradients appear (on the stage's
  first backward), the layer's transient (activation gradients, temporaries) peaks on top of what is
  kept, then the layer's kept bytes are freed; with recomputation the stage's graph is first
  re-materialised. A split backward (Zero Bubble Pipeline Parallelism §2) walks twice: ``I`` keeps
  the graph, ``W`` makes the gradients appear and frees it. Which graphs an action keeps, walks
  and frees is :func:`pipeline_recipes.strategies.schedules.effects.graph_effect`, the executor's own rule;
* under mixed precision autocast's weight copies (``LayerCosts.cast_bytes``) count from the start:
  one per weight and step, whatever the number of micro-batches in flight;
* on gloo (CPU) a sent tensor stays referenced until the end of the step (:mod:`pipeline_recipes.strategies.runtime.p2p`), so
  sent activations and activation gradients stay counted until the end (``keep_sends``);
* with ``strategy.cuda_graphs`` every stage adds one graph pool per micro-batch it holds at once
  (:func:`pipeline_recipes.strategies.schedules.slots_needed`) of
  :meth:`~pipeline_recipes.planner.model_costs.ModelCosts.graph_slot_bytes`, on top of the walk's peak;
* with ``strategy.shard_optimizer`` (ZeRO stage 1 over each stage's copies, :mod:`pipeline_recipes.planner.sharding`)
  AdamW's moments of each gradient bucket are ``1/G`` of the bucket's, ``G`` the ranks holding a copy of it; the
  weights and gradients stay whole;
* where a stage has copies on other ranks, its gradients are views of its all-reduce bucket's flat
  buffer (:mod:`pipeline_recipes.strategies.runtime.grad_sync`), allocated once and kept across steps, so they count from
  the start and the all-reduce (at the end or eager) needs no buffer of its own; elsewhere they
  appear on the stage's first backward.

With equal per-micro-batch bytes the activation part is ``bytes × peak in-flight count`` of
:func:`pipeline_recipes.strategies.schedules.peak_activations` (a test checks this).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import psutil
import torch

from pipeline_recipes.core.node import GPU_NAMES
from pipeline_recipes.strategies.schedules import Schedule, get_spec, slots_needed
from pipeline_recipes.strategies.schedules.asynchronous import stashed_versions
from pipeline_recipes.strategies.schedules.comm import CommPlan, plans
from pipeline_recipes.strategies.schedules.effects import graph_effect
from pipeline_recipes.strategies.schedules.messages import receiving_stage

from .costs import format_bytes
from .model_costs import ADAMW_STATES, ModelCosts
from .predict import Candidate, partition_for
from .sharding import optimizer_bytes, worker_buckets


@lru_cache(maxsize=512)
def _stashed_versions(strategy: str, D: int, N: int) -> tuple[int, ...]:
    """:func:`~pipeline_recipes.strategies.schedules.asynchronous.stashed_versions`, once per schedule (it walks
    ``8·D`` windows of ``D·N`` actions: at D = 32, N = 64 minutes when it ran per worker and stage)."""
    return stashed_versions(strategy, D, N)


@dataclass(frozen=True)
class WorkerMemory:
    peak: float
    states: float  # weights + gradients + optimizer state
    activations: float  # the most activation bytes kept at once (the walk's peak minus states and casts)
    casts: float = 0.0  # autocast's half-precision weight copies, one per weight and step
    graph_pools: float = 0.0  # strategy.cuda_graphs: the pools of the stages' graph copies, kept across steps
    weights: float = 0.0  # the worker's parameters (with an asynchronous schedule's stashed versions)
    optimizer: float = 0.0  # AdamW's moments the worker holds (1/G of its buckets' with a sharded state)

    def split(self) -> dict[str, float]:
        """The peak in four parts that sum to it: weights, gradients, optimizer state, and activations (every
        other byte at the peak: stored activations, messages, autocast's weight copies, graph pools)."""
        gradients = self.states - self.weights - self.optimizer
        return {"weights": self.weights, "gradients": gradients, "optimizer": self.optimizer,
                "activations": self.peak - self.states}


@dataclass(frozen=True)
class MemoryPrediction:
    workers: tuple[WorkerMemory, ...]
    W: int

    @property
    def per_rank(self) -> list[int]:
        """Rank ``r`` is worker ``r % D`` of replica ``r // D``
        (:class:`pipeline_recipes.strategies.runtime.topology.Topology`)."""
        return [int(self.workers[r % len(self.workers)].peak) for r in range(self.W * len(self.workers))]

    @property
    def max_rank(self) -> int:
        return int(max(w.peak for w in self.workers))


def _grad_bytes(costs: ModelCosts, layers: set[int]) -> float:
    return sum(costs.layers[i].param_bytes for i in layers) - costs.shared_bytes(layers)


@lru_cache(maxsize=64)
def _training_plans(schedule: Schedule) -> Sequence[CommPlan]:
    """Every worker's rounds in a training step, once per schedule: the planner predicts many layouts
    (recomputation, gradient sync, partitions) on the same schedule."""
    return plans(schedule, True)


def _received_ahead(costs: ModelCosts, schedule: Schedule, worker: int, ranges: Mapping[int, range],
                    B: int) -> list[float]:
    """Per action of ``worker``, the bytes of messages its rounds have posted for later actions (the
    executor's plan, :func:`pipeline_recipes.strategies.schedules.comm.comm_plan`): received, not yet consumed."""
    plan = _training_plans(schedule)[worker]
    remote = {t.message for rnd in plan.rounds for t in rnd.recvs}
    received_at: dict[int, list] = {}
    for i in range(len(plan.actions)):
        received_at[i] = [m for m in plan.needs(i) if m in remote]  # local hand-overs have no buffer

    def nbytes(m) -> float:
        size = B / 2 if m.half is not None else B
        r = ranges[receiving_stage(m)]
        return costs.stage_in_bytes(r, size) if m.kind == "act" else costs.stage_out_bytes(r, size)

    out, pending = [], 0.0
    for i in range(len(plan.actions)):
        pending += sum(nbytes(t.message) for t in plan.rounds[i].recvs)  # posted before action i
        pending -= sum(nbytes(m) for m in received_at.get(i, ()))  # consumed by action i: its input now
        out.append(pending)
    return out


def worker_peak(costs: ModelCosts, cand: Candidate, schedule: Schedule, worker: int,
                partition: Mapping[int, range] | Sequence[range], *, keep_sends: bool = True,
                receive_ahead: bool = True) -> WorkerMemory:
    """Peak bytes of one worker (see the module docstring). ``partition`` maps at least this
    worker's stages to their layers; with ``receive_ahead`` the receive buffers the executor's
    rounds post before their action needs them (:func:`pipeline_recipes.strategies.schedules.comm.comm_plan`) count
    from the round that posts them."""
    D, B, S = cand.D, cand.B, schedule.stages
    stages = schedule.stages_of(worker)
    ranges = {s: partition[s] for s in stages}
    layers = {i for s in stages for i in ranges[s]}
    params = _grad_bytes(costs, layers)
    versions = 0.0  # stashed weight versions, each with its gradient (strategies.versions)
    if get_spec(cand.strategy).asynchronous:
        stashed = _stashed_versions(cand.strategy, D, cand.N)
        versions = 2 * params * max(stashed[s] for s in stages)
    optimizer = optimizer_state(costs, cand, schedule, worker, ranges)
    states = params + optimizer + versions  # weights, AdamW moments; gradients appear on first backward
    recompute = cand.recompute_stages()
    halved = {a.mb for acts in schedule.workers for a in acts if a.half is not None}
    casts = float(costs.cast_bytes(layers))  # made by the step's first forward, kept until its last backward

    def kept(s: int, mb: int) -> float:
        st = ranges[s]
        if s in recompute:
            return costs.stage_in_bytes(st, B)
        if mb in halved:
            return 2 * costs.stage_stored(st, B / 2)
        return costs.stage_stored(st, B)

    synced = cand.W * len(schedule.placement) > 1  # every stage has copies on other ranks
    ahead = _received_ahead(costs, schedule, worker, ranges, B) if receive_ahead else None
    live = states + casts
    grads_for: set[int] = set()  # layers whose gradients exist
    if synced:  # gradients are views of the all-reduce buckets' flat buffers, kept across steps
        grads_for = set(layers)
        live += _grad_bytes(costs, grads_for)
    peak = live
    retained = 0.0
    for index, action in enumerate(schedule.workers[worker]):
        recv_ahead = ahead[index] if ahead is not None else 0.0
        s, st = action.stage, ranges[action.stage]
        out_b = costs.stage_out_bytes(st, B) if s < S - 1 else 0.0
        in_b = costs.stage_in_bytes(st, B)
        effect = graph_effect(action, halved)  # what the executor keeps, walks and frees
        if effect.keeps:
            for mb in action.mbs:
                live += kept(s, mb)
                if keep_sends and out_b and (s in recompute or mb in halved):
                    live += out_b  # a send buffer of its own (no graph, or the two halves concatenated)
                    retained += out_b
            peak = max(peak, live + recv_ahead)
            continue
        frac = 0.5 if action.half is not None else 1.0
        graph = B / 2 if action.mb in halved else B  # the micro-batch size of the graph this backward frees
        if s in recompute and action.kind != "W":  # re-materialise the stage's graph (W reuses I's)
            live += costs.stage_stored(st, graph)
        for k in reversed(range(len(st)) if effect.walks else ()):  # backward runs the layers last to first
            layer = st[k]
            if effect.weight_gradient and layer not in grads_for:
                before = _grad_bytes(costs, grads_for)
                grads_for.add(layer)
                live += _grad_bytes(costs, grads_for) - before
            peak = max(peak, live + costs.layers[layer].transient.clamp(graph) + recv_ahead)
            if effect.frees:
                fit = costs.layers[layer].stored_alone if k == 0 else costs.layers[layer].stored_added
                live -= fit.clamp(graph)
        if s in recompute and effect.frees:
            live -= kept(s, action.mb) * frac  # the kept input goes last
        if keep_sends:
            sent = (frac * in_b if effect.input_gradient else 0.0) + (
                frac * out_b if effect.frees and s not in recompute and action.mb not in halved else 0.0)
            live += sent
            retained += sent
    live -= retained  # the messenger's flush at the end of the step
    peak = max(peak, live)
    held = 2 * params + optimizer + versions
    pools = 0.0
    if cand.cuda_graphs:  # beside the walk: the eager allocator cannot use a graph's private pool
        pools = sum(count * costs.graph_slot_bytes(ranges[s], B) for s, count in slots_needed(schedule, worker).items())
    return WorkerMemory(peak + pools, held, peak - held - casts, casts, pools, params + versions / 2, optimizer)


def optimizer_state(costs: ModelCosts, cand: Candidate, schedule: Schedule, worker: int,
                    ranges: Mapping[int, range]) -> float:
    """AdamW's two moments on ``worker``: ``ADAMW_STATES`` bytes per weight byte it holds, or with
    ``strategy.shard_optimizer`` each bucket's over its group of ``G`` copies (:mod:`.sharding`)."""
    if not cand.shard_optimizer:
        layers = {i for s in schedule.stages_of(worker) for i in ranges[s]}
        return ADAMW_STATES * _grad_bytes(costs, layers)
    return optimizer_bytes(worker_buckets(costs, cand.W, schedule, worker, ranges), True)


def predict_memory(costs: ModelCosts, cand: Candidate, partition: Sequence[range] | None = None, *,
                   keep_sends: bool | None = None, receive_ahead: bool = True) -> MemoryPrediction:
    """Peak bytes of every worker of one replica; ``keep_sends`` defaults to gloo on CPU. A sharded optimizer state
    is constant through the step, so a sharded layout's walk is its unsharded twin's (walked once for both), every
    worker lower by the optimizer state it no longer holds (:func:`worker_peak` walks it directly)."""
    partition = tuple(partition_for(costs, cand.S, partition))
    if keep_sends is None:
        keep_sends = not costs.device.startswith("cuda")
    if not cand.shard_optimizer:
        return _predicted(costs, cand, partition, keep_sends, receive_ahead)
    whole = _predicted(costs, cand.replace(shard_optimizer=False), partition, keep_sends, receive_ahead)
    return _without_sharded_state(costs, cand, whole, partition)


@lru_cache(maxsize=16)  # a sharded twin is predicted right after its layout (candidates() lists them so)
def _predicted(costs: ModelCosts, cand: Candidate, partition: tuple[range, ...], keep_sends: bool,
               receive_ahead: bool) -> MemoryPrediction:
    """Every worker's :func:`worker_peak` of ``cand`` on ``partition``, once per layout."""
    schedule = cand.schedule()
    workers = tuple(worker_peak(costs, cand, schedule, w, partition, keep_sends=keep_sends, receive_ahead=receive_ahead)
                    for w in range(cand.D))
    return MemoryPrediction(workers, cand.W)


def _without_sharded_state(costs: ModelCosts, cand: Candidate, whole: MemoryPrediction,
                           partition: Sequence[range]) -> MemoryPrediction:
    """``whole`` (the unsharded twin's prediction) with each worker's optimizer state sharded as ``cand`` shards it."""
    schedule, ranges = cand.schedule(), dict(enumerate(partition))
    workers = []
    for w, mem in enumerate(whole.workers):
        layers = {i for s in schedule.stages_of(w) for i in ranges[s]}
        saved = ADAMW_STATES * _grad_bytes(costs, layers) - optimizer_state(costs, cand, schedule, w, ranges)
        workers.append(replace(mem, peak=mem.peak - saved, states=mem.states - saved, optimizer=mem.optimizer - saved))
    return MemoryPrediction(tuple(workers), whole.W)


@dataclass(frozen=True)
class Budget:
    """What the ranks may use: ``per_rank`` bytes each (one accelerator per rank) or ``host`` bytes
    shared by the ``ranks_per_node`` ranks of a node, each also costing ``process_bytes`` (CPU).

    A described device (:mod:`pipeline_recipes.planner.cluster`) also has ``reserved`` bytes held outside torch's
    allocator (CUDA context, library handles), taken off ``per_rank``, and an ``allocator_overhead``: the fraction
    the caching allocator reserves beyond the tensors the estimate counts (fragmentation, rounding)."""

    per_rank: int | None = None
    host: int | None = None
    process_bytes: int = 0
    source: str = ""
    reserved: int = 0
    allocator_overhead: float = 0.0

    def fits(self, per_rank: Sequence[int], ranks_per_node: int) -> bool:
        return self.shortfall(per_rank, ranks_per_node) <= 0

    def need(self, per_rank: Sequence[int], ranks_per_node: int) -> int:
        """The bytes compared with the budget: the largest rank, or a node's ranks together."""
        if self.per_rank is not None:
            return int(max(per_rank) * (1.0 + self.allocator_overhead))
        node = sorted(per_rank, reverse=True)[:ranks_per_node]
        return int(sum(node) + self.process_bytes * len(node))

    def limit(self) -> int:
        return int(self.per_rank - self.reserved if self.per_rank is not None else (self.host or 0))

    def shortfall(self, per_rank: Sequence[int], ranks_per_node: int) -> int:
        if self.per_rank is None and self.host is None:
            return -1
        return self.need(per_rank, ranks_per_node) - self.limit()

    def describe(self) -> str:
        if self.per_rank is not None:
            extra = f", less {format_bytes(self.reserved)} outside the allocator" if self.reserved else ""
            if self.allocator_overhead:
                extra += f", peaks × {1 + self.allocator_overhead:.2f} for the caching allocator"
            return f"{format_bytes(self.per_rank)} per rank ({self.source}{extra})"
        if self.host is not None:
            return f"{format_bytes(self.host)} host RAM shared by the ranks of a node ({self.source})"
        return "unlimited"


def device_budget(accelerator: str = "cpu", *, override: int | None = None, process_bytes: int = 0) -> Budget:
    """The memory budget of this machine: free host RAM (psutil) for CPU ranks, or the first GPU's
    total memory per rank; ``override`` (bytes) replaces the measured amount."""
    if accelerator in GPU_NAMES:
        if override is not None:
            return Budget(per_rank=int(override), source="given")
        if not torch.cuda.is_available():
            raise ValueError("trainer.accelerator is gpu but no CUDA device is visible; pass an explicit budget")
        total = torch.cuda.get_device_properties(0).total_memory
        return Budget(per_rank=int(total), source=f"{torch.cuda.get_device_name(0)}")
    if override is not None:
        return Budget(host=int(override), process_bytes=process_bytes, source="given")
    return Budget(host=int(psutil.virtual_memory().available), process_bytes=process_bytes, source="available host RAM")
