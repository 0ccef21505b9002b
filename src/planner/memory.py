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
  re-materialised;
* on gloo (CPU) a sent tensor stays referenced until the end of the step (:mod:`strategies.p2p`), so
  sent activations and activation gradients stay counted until the end (``keep_sends``);
* each all-reduce flattens its stage copy's gradients into one more buffer, when it is launched:
  at the end (``grad_sync=end``) or right after the copy's last backward (eager modes, the same
  :func:`strategies.grad_sync.launch_plan` the runtime follows); the tied group's at the end.

With equal per-micro-batch bytes the activation part is ``bytes × peak in-flight count`` of
:func:`strategies.schedules.peak_activations` (a test checks this).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline_recipes.strategies.schedules import ASYNC_SCHEDULES, Schedule
from pipeline_recipes.strategies.schedules.asynchronous import stashed_versions

from .model_costs import ADAMW_STATES, ModelCosts
from .predict import Candidate, runtime_partition


@dataclass(frozen=True)
class WorkerMemory:
    peak: float
    states: float  # weights + gradients + optimizer state
    activations: float  # the most activation bytes kept at once (the walk's peak minus states)


@dataclass(frozen=True)
class MemoryPrediction:
    workers: tuple[WorkerMemory, ...]
    W: int

    @property
    def per_rank(self) -> list[int]:
        """Rank ``r`` is worker ``r % D`` of replica ``r // D`` (:class:`strategies.topology.Topology`)."""
        return [int(self.workers[r % len(self.workers)].peak) for r in range(self.W * len(self.workers))]

    @property
    def max_rank(self) -> int:
        return int(max(w.peak for w in self.workers))


def _grad_bytes(costs: ModelCosts, layers: set[int]) -> float:
    return sum(costs.layers[i].param_bytes for i in layers) - costs.shared_bytes(layers)


def worker_peak(costs: ModelCosts, cand: Candidate, schedule: Schedule, worker: int,
                partition: Mapping[int, range] | Sequence[range], *, keep_sends: bool = True,
                prefetch: int = 1) -> WorkerMemory:
    """Peak bytes of one worker (see the module docstring). ``partition`` maps at least this
    worker's stages to their layers; ``prefetch`` receive buffers are allocated ahead of their
    action (a round receives the next action's inputs, a few messages come one round earlier:
    :mod:`strategies.schedules.comm`)."""
    from pipeline_recipes.strategies.grad_sync import launch_plan

    D, B = cand.D, cand.B
    stages = schedule.stages_of(worker)
    ranges = {s: partition[s] for s in stages}
    layers = {i for s in stages for i in ranges[s]}
    params = _grad_bytes(costs, layers)
    versions = 0.0  # stashed weight versions, each with its gradient (strategies.versions)
    if cand.strategy in ASYNC_SCHEDULES:
        versions = 2 * params * max(stashed_versions(cand.strategy, D, cand.N)[s] for s in stages)
    states = params * (1 + ADAMW_STATES) + versions  # weights, AdamW moments; gradients appear on first backward
    recompute = cand.recompute_stages()
    halved = {a.mb for acts in schedule.workers for a in acts if a.half is not None}

    def kept(s: int, mb: int) -> float:
        st = ranges[s]
        if s in recompute:
            return costs.stage_in_bytes(st, B)
        if mb in halved:
            return 2 * costs.stage_stored(st, B / 2)
        return costs.stage_stored(st, B)

    synced = cand.W * len(schedule.placement) > 1  # every stage has copies on other ranks

    def flat(s: int) -> float:
        return costs.stage_sync_bytes(ranges[s]) if synced else 0.0

    eager = launch_plan(schedule, worker, cand.grad_sync) if cand.grad_sync != "end" else {}
    launched: set[int] = set()
    recv_ahead = prefetch * max((max(costs.stage_in_bytes(ranges[s], B), costs.stage_out_bytes(ranges[s], B))
                                 for s in stages), default=0.0)
    live = states
    peak = live
    grads_for: set[int] = set()  # layers whose gradients exist
    retained = 0.0
    for action in schedule.workers[worker]:
        s, st = action.stage, ranges[action.stage]
        out_b = costs.stage_out_bytes(st, B) if s < D - 1 else 0.0
        in_b = costs.stage_in_bytes(st, B)
        if action.kind == "F":
            for mb in action.mbs:
                live += kept(s, mb)
                if keep_sends and out_b and (s in recompute or mb in halved):
                    live += out_b  # a send buffer of its own (no graph, or the two halves concatenated)
                    retained += out_b
            peak = max(peak, live + recv_ahead)
            continue
        frac = 0.5 if action.half is not None else 1.0
        graph = B / 2 if action.mb in halved else B  # the micro-batch size of the graph this backward frees
        if s in recompute:  # re-materialise the stage's graph, then free it layer by layer
            live += costs.stage_stored(st, graph)
        for k in reversed(range(len(st))):  # backward runs the layers last to first
            layer = st[k]
            if layer not in grads_for:
                before = _grad_bytes(costs, grads_for)
                grads_for.add(layer)
                live += _grad_bytes(costs, grads_for) - before
            peak = max(peak, live + costs.layers[layer].transient.clamp(graph) + recv_ahead)
            fit = costs.layers[layer].stored_alone if k == 0 else costs.layers[layer].stored_added
            live -= fit.clamp(graph)
        if s in recompute:
            live -= kept(s, action.mb) * frac  # the kept input goes last
        if keep_sends:
            sent = frac * in_b + (frac * out_b if s not in recompute and action.mb not in halved else 0.0)
            live += sent
            retained += sent
        for early in eager.get(action, ()):  # an eager all-reduce's flat buffer lives from its launch
            live += flat(early)
            launched.add(early)
    live -= retained  # the messenger's flush at the end of the step
    flats = sum(flat(s) for s in stages if s not in launched)
    if costs.tied and any(i in layers or j in layers for i, j, _ in costs.tied) and cand.W * max(1, min(D, 2)) > 1:
        flats += costs.tied_bytes(layers)
    peak = max(peak, live + flats)
    held = params * (2 + ADAMW_STATES) + versions
    return WorkerMemory(peak, held, peak - held)


def predict_memory(costs: ModelCosts, cand: Candidate, partition: Sequence[range] | None = None, *,
                   keep_sends: bool | None = None, prefetch: int = 1) -> MemoryPrediction:
    """Peak bytes of every worker of one replica; ``keep_sends`` defaults to gloo on CPU."""
    partition = list(partition) if partition is not None else runtime_partition(costs, cand.D)
    if keep_sends is None:
        keep_sends = not costs.device.startswith("cuda")
    schedule = cand.schedule()
    workers = tuple(worker_peak(costs, cand, schedule, w, partition, keep_sends=keep_sends, prefetch=prefetch)
                    for w in range(cand.D))
    return MemoryPrediction(workers, cand.W)


@dataclass(frozen=True)
class Budget:
    """What the ranks may use: ``per_rank`` bytes each (one accelerator per rank) or ``host`` bytes
    shared by the ``ranks_per_node`` ranks of a node, each also costing ``process_bytes`` (CPU)."""

    per_rank: int | None = None
    host: int | None = None
    process_bytes: int = 0
    source: str = ""

    def fits(self, per_rank: Sequence[int], ranks_per_node: int) -> bool:
        return self.shortfall(per_rank, ranks_per_node) <= 0

    def need(self, per_rank: Sequence[int], ranks_per_node: int) -> int:
        """The bytes compared with the budget: the largest rank, or a node's ranks together."""
        if self.per_rank is not None:
            return int(max(per_rank))
        node = sorted(per_rank, reverse=True)[:ranks_per_node]
        return int(sum(node) + self.process_bytes * len(node))

    def limit(self) -> int:
        return int(self.per_rank if self.per_rank is not None else (self.host or 0))

    def shortfall(self, per_rank: Sequence[int], ranks_per_node: int) -> int:
        if self.per_rank is None and self.host is None:
            return -1
        return self.need(per_rank, ranks_per_node) - self.limit()

    def describe(self) -> str:
        from .costs import format_bytes

        if self.per_rank is not None:
            return f"{format_bytes(self.per_rank)} per rank ({self.source})"
        if self.host is not None:
            return f"{format_bytes(self.host)} host RAM shared by the ranks of a node ({self.source})"
        return "unlimited"


def device_budget(accelerator: str = "cpu", *, override: int | None = None, process_bytes: int = 0) -> Budget:
    """The memory budget of this machine: free host RAM (psutil) for CPU ranks, or the first GPU's
    total memory per rank; ``override`` (bytes) replaces the measured amount."""
    if accelerator in ("gpu", "cuda"):
        if override is not None:
            return Budget(per_rank=int(override), source="given")
        import torch

        if not torch.cuda.is_available():
            raise ValueError("trainer.accelerator is gpu but no CUDA device is visible; pass an explicit budget")
        total = torch.cuda.get_device_properties(0).total_memory
        return Budget(per_rank=int(total), source=f"{torch.cuda.get_device_name(0)}")
    if override is not None:
        return Budget(host=int(override), process_bytes=process_bytes, source="given")
    import psutil

    return Budget(host=int(psutil.virtual_memory().available), process_bytes=process_bytes, source="available host RAM")
