"""Iteration-time prediction of one layout (Chimera §3.4), by simulating its schedule.

Instead of counting forwards and backwards on a critical path by hand (``T = (F_t + Comm_p2p)·C_f +
(B_t + Comm_p2p)·C_b + max_i Comm_unoverlapped(i)``, eq. 1), the planner runs the very schedule the
workers will execute through :func:`pipeline_recipes.strategies.schedules.simulate` with measured per-stage costs:

* ``t_f[s]``/``t_b[s]``: the sum of the stage's profiled layer times at micro-batch size ``B`` plus the
  runtime's per-action overhead; recomputation runs the forward without a graph (its profiled
  ``fwd_nograd``) and adds the full forward to the backward (§3.4: ``B_t = 3 F_t``); a doubled
  forward costs two forwards (simulate charges ``2·t_f``, §3.5); a halved backward runs two
  half-size graphs (``t_b[s] = 2·bwd(B/2)``, simulate charges half of it each).
* ``t_comm = α + β·L`` with ``L`` the stage boundary activation at ``B`` (Chimera §3.4, α–β model),
  plus the runtime's measured latency per message (``CommCosts.hop_s``).
* Gradient synchronisation: one Rabenseifner all-reduce per stage over its ``r = W·pipelines``
  copies, launched at the end (``grad_sync=end``) or after the copy's last backward (eager modes,
  §3.2); :func:`pipeline_recipes.planner.costs.sync_timeline` gives the part not hidden behind computation. With
  ``end``, buckets copied on the same workers are one fused all-reduce, as the runtime runs them
  (:class:`pipeline_recipes.strategies.runtime.grad_sync.GradientSynchronizer`).
* Sharded optimizer state (``strategy.shard_optimizer``, ZeRO stage 1 over each stage's copies,
  :mod:`pipeline_recipes.planner.sharding`): on NCCL the gradient is reduce-scattered (half an all-reduce, launched
  and overlapped as the all-reduce was), each worker steps ``1/G`` of its buckets, and the parameters are
  all-gathered (the other half) after the step, exposed; on gloo the gradients are all-reduced whole and the
  parameters broadcast slice by slice (half an all-reduce). The schedule's simulation
  is shared with the unsharded twin (:func:`_simulated`).
* Asynchronous schedules (PipeDream-2BW, PipeDream) never flush: one iteration is the steady-state
  window, measured as the makespan added by one more step of the no-flush stream.
* CPU ranks that outnumber the cores share them: the simulated compute is stretched to at least the
  total busy time of all ranks divided by the cores. (A processor-sharing fixed point that stretches
  each stage by the concurrency it meets was tried and over-predicted the measured runs by 20–55 %
  on 4 ranks / 2 cores: ranks blocked in receives leave their core to the others.) When the ranks
  occupy every core, an eagerly launched all-reduce takes its core time from the computation it
  overlaps: it is hidden only behind idle time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial

from pipeline_recipes.models.partition import balanced_partition
from pipeline_recipes.strategies.runtime.grad_sync import launch_plan
from pipeline_recipes.strategies.runtime.recompute import recompute_stages
from pipeline_recipes.core.layout import Layout
from pipeline_recipes.strategies.schedules import (
    AUTO_CONCAT, DEFAULT_SCHEDULE, LayoutRefusal, Schedule, ScheduleSpec, best_concat, build_schedule, derive_layout,
    derive_sizes, get_spec, layout_of, names, resolve_concat, simulate, specs,
)
from pipeline_recipes.strategies.schedules.asynchronous import steady_step, steady_step_makespan, window
from pipeline_recipes.strategies.schedules.rules import DEFAULT_GRAD_SYNC, DEFAULT_RECOMPUTE

from .costs import Collective, rabenseifner, sync_timeline
from .model_costs import ModelCosts
from .sharding import optimizer_share, stage_members, worker_buckets

RECOMPUTE = (DEFAULT_RECOMPUTE, "always")  # the recomputation choices the planner compares
SHARDING = (False, True)  # strategy.shard_optimizer choices the planner compares (where the rule allows sharding)


@dataclass(frozen=True)
class Candidate:
    """One layout the planner compares (Chimera Table 1): a :class:`~pipeline_recipes.core.layout.Layout` (W replicas
    × D stages, micro-batch B, N micro-batches per worker and the schedule's settings), read through its fields."""

    layout: Layout

    @classmethod
    def of(cls, strategy: str, W: int, D: int, B: int, N: int, pipelines: int = 1, concat: str = "direct",
           recompute: str = DEFAULT_RECOMPUTE, grad_sync: str = DEFAULT_GRAD_SYNC, chunks: int | None = None,
           cuda_graphs: bool = False, shard_optimizer: bool = False) -> Candidate:
        """The candidate of these sizes and settings, as given (:func:`~pipeline_recipes.strategies.schedules.layout_of`;
        :func:`candidates` enumerates those the rules accept)."""
        return cls(layout_of(get_spec(strategy), W, D, B, N, pipelines, concat, chunks=chunks, grad_sync=grad_sync,
                             recompute=recompute, cuda_graphs=cuda_graphs, shard_optimizer=shard_optimizer))

    def replace(self, **changes: object) -> Candidate:
        """This candidate with some of :meth:`of`'s settings changed."""
        settings = {"strategy": self.strategy, "W": self.W, "D": self.D, "B": self.B, "N": self.N,
                    "pipelines": self.pipelines, "concat": self.concat, "recompute": self.recompute,
                    "grad_sync": self.grad_sync, "chunks": self.chunks, "cuda_graphs": self.cuda_graphs,
                    "shard_optimizer": self.shard_optimizer}
        return Candidate.of(**{**settings, **changes})  # type: ignore[arg-type]

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def W(self) -> int:
        return self.layout.W

    @property
    def D(self) -> int:
        return self.layout.D

    @property
    def B(self) -> int:
        return self.layout.B

    @property
    def N(self) -> int:
        return self.layout.N

    @property
    def pipelines(self) -> int:
        return self.layout.pipelines

    @property
    def concat(self) -> str:
        return self.layout.concat

    @property
    def recompute(self) -> str:
        return self.layout.recompute or DEFAULT_RECOMPUTE

    @property
    def grad_sync(self) -> str:
        return self.layout.grad_sync or DEFAULT_GRAD_SYNC

    @property
    def chunks(self) -> int | None:
        """Stages per worker (interleaved 1F1B); None: the schedule's own."""
        return self.layout.chunks

    @property
    def cuda_graphs(self) -> bool:
        """strategy.cuda_graphs: each held micro-batch's graph pool counts (planner.memory)."""
        return self.layout.cuda_graphs

    @property
    def shard_optimizer(self) -> bool:
        """strategy.shard_optimizer: AdamW's state split across each stage's copies (:mod:`.sharding`)."""
        return self.layout.shard_optimizer

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def S(self) -> int:
        """Stages the model is split into (v·D)."""
        return self.layout.stages

    @property
    def global_batch_size(self) -> int:
        return self.layout.global_batch_size

    def schedule(self) -> Schedule:
        return schedule_of(self.strategy, self.D, self.N, self.pipelines, self.resolved().concat, self.chunks)

    def resolved(self, costs: ModelCosts | None = None, partition: Sequence[range] | None = None) -> Candidate:
        """This layout with ``concat=auto`` replaced by the method
        :func:`pipeline_recipes.strategies.schedules.best_concat` picks: at t_b = 2 t_f as the runtime does, or with
        ``costs``, at this model's measured costs of each method (:func:`stage_costs`), so that the planner recommends
        the concrete method."""
        if self.concat != AUTO_CONCAT:
            return self
        if costs is None or not get_spec(self.strategy).concat:
            return self.replace(concat=resolve_concat(self.strategy, self.D, self.N, self.pipelines, self.B,
                                                      self.concat))
        part = partition_for(costs, self.S, partition)
        method = best_concat(self.D, self.N, self.pipelines, self.B, generator=partial(_built, self.strategy),
                             costs=lambda m: stage_costs(costs, self.replace(concat=m), part))
        return self.replace(concat=method)

    def schedule_key(self) -> tuple:
        """What its schedule depends on (layouts that differ only in B, W, recomputation, gradient sync
        or concatenation method share one ``(strategy, D, N, pipelines, chunks)`` family)."""
        return self.strategy, self.D, self.N, self.pipelines, self.chunks

    def recompute_stages(self) -> frozenset[int]:
        return recompute_stages(self.recompute, self.S)

    def overrides(self) -> list[str]:
        """Hydra overrides of ``train.py`` that select this layout."""
        out = [f"strategy={self.strategy}", f"strategy.D={self.D}", f"strategy.W={self.W}",
               f"strategy.micro_batch_size={self.B}", f"strategy.recompute={self.recompute}",
               f"strategy.grad_sync={self.grad_sync}", f"strategy.shard_optimizer={str(self.shard_optimizer).lower()}"]
        spec = get_spec(self.strategy)
        if spec.pipelines.choices is not None:
            out.append(f"strategy.pipelines={self.pipelines}")
        if spec.concat:
            out.append(f"strategy.concat={self.concat}")
        if spec.chunks.choosable and self.chunks is not None:
            out.append(f"strategy.chunks={self.chunks}")
        return out

    def label(self) -> str:
        spec = get_spec(self.strategy)
        extra = []
        if spec.pipelines.choices is not None and self.pipelines != spec.pipelines.default:
            extra.append(f"{self.pipelines}pipes")
        if spec.concat and self.concat != "direct":
            extra.append(self.concat)
        if spec.chunks.choosable and self.chunks is not None and self.chunks != spec.chunks.default:
            extra.append(f"v{self.chunks}")
        if self.recompute != "none":
            extra.append(f"recompute_{self.recompute}")
        if self.grad_sync != "end":
            extra.append(f"sync_{self.grad_sync}")
        if self.shard_optimizer:
            extra.append("shard_optim")
        return "+".join([self.strategy, *extra])


@lru_cache(maxsize=1024)
def schedule_of(strategy: str, D: int, N: int, pipelines: int, concat: str, chunks: int | None = None) -> Schedule:
    return build_schedule(strategy, D, N, pipelines, concat, chunks=chunks)


def _built(strategy: str, D: int, N: int, pipelines: int, concat: str) -> Schedule:
    """``best_concat``'s generator: the cached schedule (layouts that differ only in recomputation or
    gradient sync compare the same concatenation methods)."""
    return schedule_of(strategy, D, N, pipelines, concat)


CHUNK_CHOICES = (2, 4)  # v the planner compares where the schedule lets the user choose it


def default_schedules() -> tuple[str, ...]:
    """The planner's default search space: every synchronous schedule of the registry (the asynchronous
    ones change the optimizer's maths, so they are compared only when asked for)."""
    return tuple(spec.name for spec in specs() if not spec.asynchronous)


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def candidates(devices: int, global_batch_size: int, num_layers: int, *,
               schedules: Sequence[str] | None = None, recompute: Sequence[str] = RECOMPUTE,
               grad_sync: str = DEFAULT_GRAD_SYNC, max_micro_batches: int = 1024,
               shard_optimizer: Sequence[bool] = SHARDING) -> list[Candidate]:
    """Every layout of ``devices`` processes for this global batch (the planner's search space).

    W·D = devices; B a power of two with W·B dividing B̂; every schedule of ``schedules`` (default:
    :func:`default_schedules`) with each of its registry variants (Chimera: 2f pipelines for every
    divisor f of D/2 and each concatenation method of §3.5 that ``strategy.concat=auto`` compares),
    recomputation none / always and the optimizer state whole / sharded across each stage's copies
    (``shard_optimizer``; sharded right after whole, only where some stage has copies), wherever the
    schedule's layout rules allow it.
    """
    if devices < 1 or global_batch_size < 1:
        raise ValueError(f"devices and global_batch_size must be positive, got {devices}, {global_batch_size}")
    schedules = default_schedules() if schedules is None else tuple(schedules)
    unknown = sorted(set(schedules) - set(names(aliases=True)))
    if unknown:
        raise ValueError(f"unknown schedule(s) {unknown}; choose from {', '.join(names())}")
    out: list[Candidate] = []
    sizes = get_spec(DEFAULT_SCHEDULE)  # W and N at a given B are every schedule's (derive_sizes)
    for D in (d for d in range(1, devices + 1) if devices % d == 0 and d <= num_layers):
        for B in _powers_of_two(global_batch_size):
            try:
                _, _, N, _ = derive_sizes(sizes, devices, D, global_batch_size, B=B)
            except LayoutRefusal:  # W·B does not divide the global batch
                continue
            if N > max_micro_batches:
                continue
            for name in schedules:
                if D == 1 and name != DEFAULT_SCHEDULE:
                    continue  # one stage: every schedule is plain gradient accumulation
                out += _layouts_of(get_spec(name), devices, D, B, N, global_batch_size, num_layers, recompute,
                                   grad_sync, shard_optimizer)
    return out


def _layouts_of(spec: ScheduleSpec, devices: int, D: int, B: int, N: int, global_batch_size: int, num_layers: int,
                recompute: Sequence[str], grad_sync: str, shard_optimizer: Sequence[bool] = (False,)
                ) -> list[Candidate]:
    """The candidates of one schedule at D and B (N micro-batches): each of its registry variants and chunk choices,
    each recomputation mode and each ``shard_optimizer`` choice, as
    :func:`~pipeline_recipes.strategies.schedules.derive_layout` derives and checks them (the arithmetic and the
    rules; the schedules are built only for the candidates predicted)."""
    out = []
    for pipes, concat in spec.planner_variants(D, N, B):
        for v in CHUNK_CHOICES if spec.chunks.choosable else (None,):
            for mode in recompute:
                for shard in shard_optimizer:
                    try:
                        layout = derive_layout(spec, devices, D, global_batch_size, B=B, pipelines=pipes,
                                               concat=concat, chunks=v, grad_sync=grad_sync, recompute=mode,
                                               num_layers=num_layers, shard_optimizer=shard, validate=False)
                    except LayoutRefusal:
                        continue
                    out.append(Candidate(layout))
    return out


def runtime_partition(costs: ModelCosts, D: int) -> list[range]:
    """The split ``train.py`` uses into ``D`` stages (S for several stages per worker):
    ``model.partition(D)``, balanced by ``layer_costs("layers")``."""
    weights = costs.meta.get("layer_costs") or [1.0] * costs.num_layers
    return balanced_partition(weights, D)


def partition_for(costs: ModelCosts, S: int, partition: Sequence[range] | None = None) -> list[range]:
    """The split every prediction uses: ``partition`` when given, else :func:`runtime_partition` (what train.py runs)."""
    return list(partition) if partition is not None else runtime_partition(costs, S)


@dataclass(frozen=True)
class TimePrediction:
    iteration_s: float
    compute_s: float  # simulated pipeline (after core sharing)
    sync_s: float  # gradient all-reduce (reduce-scatter, sharded on NCCL) time not hidden behind computation
    optimizer_s: float
    step_s: float  # the runtime's fixed cost per step
    bubble_ratio: float
    t_f: tuple[float, ...] = field(default=())
    t_b: tuple[float, ...] = field(default=())
    t_comm: float = 0.0
    gather_s: float = 0.0  # strategy.shard_optimizer: the parameter all-gather after the optimizer step (exposed)


def stage_costs(costs: ModelCosts, cand: Candidate, partition: Sequence[range]) -> tuple[list[float], list[float], float]:
    """Per-stage ``t_f``, ``t_b`` for :func:`simulate` and the p2p time ``t_comm`` (see module docstring)."""
    if len(partition) != cand.S:
        raise ValueError(f"partition has {len(partition)} stages for S = {cand.S}")
    o = costs.comm.action_s
    halving = cand.concat == "backward_halving"
    recompute = cand.recompute_stages()
    t_f, t_b = [], []
    for s, stage in enumerate(partition):
        kept = s not in recompute  # else the forward runs without a graph, then again in backward
        if halving:  # two half-size graphs per forward, two half backwards
            fwd = 2 * (costs.stage_fwd(stage, cand.B / 2) if kept else costs.stage_fwd_nograd(stage, cand.B / 2))
            bwd = 2 * (costs.stage_bwd(stage, cand.B / 2) + o)
            if not kept:
                bwd += 2 * costs.stage_fwd(stage, cand.B / 2)
        else:
            fwd = costs.stage_fwd(stage, cand.B) if kept else costs.stage_fwd_nograd(stage, cand.B)
            bwd = costs.stage_bwd(stage, cand.B) + o
            if not kept:
                bwd += costs.stage_fwd(stage, cand.B)
        t_f.append(fwd + o)
        t_b.append(bwd)
    boundary = max((costs.stage_out_bytes(st, cand.B) for st in partition[:-1]), default=0.0)
    t_comm = costs.comm.p2p_s(boundary, cand.D) + costs.comm.hop_s if cand.D > 1 else 0.0
    return t_f, t_b, t_comm


def _last_backward_end(timeline: Sequence, stage: int) -> float:
    return max((t.end for t in timeline if t.action.completes_weight_gradient and t.action.stage == stage), default=0.0)


@dataclass(frozen=True)
class _Simulated:
    """The computation of one layout, before any collective: what a sharded optimizer state does not change
    (so a layout and its sharded twin are simulated once, :func:`_simulated`)."""

    schedule: Schedule
    timeline: Sequence
    compute_end: tuple[float, ...]  # per worker, stretched by core sharing
    stretch: float
    makespan: float
    bubble: float
    t_f: tuple[float, ...]
    t_b: tuple[float, ...]
    t_comm: float


@lru_cache(maxsize=8)  # a sharded twin is predicted right after its layout (candidates() lists them so)
def _simulated(costs: ModelCosts, cand: Candidate, partition: tuple[range, ...], cores: int,
               messages: bool = True) -> _Simulated:
    """Simulate ``cand``'s schedule with its stage costs (module docstring); cached by layout, the optimizer sharding
    aside (the caller passes the unsharded twin). ``messages=False``: every message between stages free
    (:func:`time_split`)."""
    t_f, t_b, t_comm = stage_costs(costs, cand, partition)
    t_comm = t_comm if messages else 0.0
    if get_spec(cand.strategy).asynchronous:
        schedule, makespan, busy = _steady_window(cand, t_f, t_b, t_comm)
        timeline: Sequence = [()] * cand.D
        bubble = 1 - sum(busy) / (cand.D * makespan) if makespan > 0 else 0.0
        ends = [makespan] * cand.D
    else:
        schedule = cand.schedule()
        sim = simulate(schedule, t_f, t_b, t_comm=t_comm)
        makespan, busy, timeline, bubble = sim.makespan, list(sim.busy), sim.timeline, sim.bubble_ratio
        ends = [row[-1].end if row else 0.0 for row in sim.timeline]
    stretch = 1.0
    if cores and cand.world_size > cores and makespan > 0:  # never faster than the cores allow
        stretch = max(1.0, cand.W * sum(busy) / cores / makespan)
    return _Simulated(schedule, timeline, tuple(end * stretch for end in ends), stretch, makespan, bubble,
                      tuple(t_f), tuple(t_b), t_comm)


def predict_time(costs: ModelCosts, cand: Candidate, partition: Sequence[range] | None = None, *,
                 cores: int | None = None) -> TimePrediction:
    """Predicted seconds of one training iteration (forward, backward, gradient sync, AdamW step and, with
    ``strategy.shard_optimizer``, the parameter all-gather; :mod:`.sharding`). ``concat=auto`` is predicted as the
    runtime resolves it (:meth:`Candidate.resolved`)."""
    partition = partition_for(costs, cand.S, partition)
    cand = cand.resolved()
    cores = costs.cores if cores is None else cores
    whole = cand.replace(shard_optimizer=False) if cand.shard_optimizer else cand
    run = _simulated(costs, whole, tuple(partition), cores)
    schedule, timeline, stretch = run.schedule, run.timeline, run.stretch
    compute_end = list(run.compute_end)
    buckets = _buckets(costs, cand, partition, schedule, timeline, compute_end, stretch)
    collectives = [Collective(name, members, launches, gradient_sync_s(costs, cand, members, nbytes))
                   for name, members, launches, nbytes in buckets]
    if cores and cand.world_size >= cores:
        compute_end = _cpu_contention(collectives, timeline, compute_end, stretch)
    finish = sync_timeline(collectives, compute_end)
    opt = _optimizer_s(costs, cand, schedule, partition)
    stepped = [f + o for f, o in zip(finish, opt)]
    gathered = _parameters_gathered(costs, cand, buckets, stepped)
    step = _step_s(costs, cand)
    sync = max(f - c for f, c in zip(finish, compute_end))
    gather = max(g - s for g, s in zip(gathered, stepped))
    return TimePrediction(max(gathered) + step, max(compute_end), sync, max(opt), step, run.bubble, run.t_f, run.t_b,
                          run.t_comm, gather)


def time_split(costs: ModelCosts, cand: Candidate, time: TimePrediction, partition: Sequence[range] | None = None, *,
               cores: int | None = None) -> dict[str, float]:
    """``time`` (:func:`predict_time` of ``cand``) in four parts that sum to its ``iteration_s``:

    * ``allreduce_s``: what the gradient synchronisation (and a sharded state's parameter gather) adds after the
      pipeline's last computation, the optimizer step and the runtime's fixed cost aside;
    * ``p2p_s``: what the messages between stages add to the pipeline (its simulation with ``t_comm`` as predicted,
      less the same schedule simulated with free messages);
    * ``bubble_s``: the idle share of that message-free simulation (its bubble ratio times its makespan);
    * ``compute_s``: the rest: the forwards and backwards, the optimizer step and the runtime's fixed cost.
    """
    partition = partition_for(costs, cand.S, partition)
    cand = cand.resolved()
    cores = costs.cores if cores is None else cores
    whole = cand.replace(shard_optimizer=False) if cand.shard_optimizer else cand
    run = _simulated(costs, whole, tuple(partition), cores)
    free = _simulated(costs, whole, tuple(partition), cores, messages=False)
    pipeline = time.compute_s
    allreduce = max(0.0, time.iteration_s - pipeline - time.optimizer_s - time.step_s)
    free_span = free.makespan * run.stretch
    p2p = max(0.0, pipeline - free_span)
    bubble = min(free.bubble * free_span, time.iteration_s - allreduce - p2p)
    return {"compute_s": time.iteration_s - allreduce - p2p - bubble, "bubble_s": bubble, "p2p_s": p2p,
            "allreduce_s": allreduce}


def _parameters_gathered(costs: ModelCosts, cand: Candidate, buckets: Sequence[tuple], stepped: Sequence[float]
                         ) -> list[float]:
    """Per worker, when its parameters are whole for the next forward: after its optimizer step (``stepped``), or
    with a sharded optimizer state after each of its buckets' all-gathers, which start once every member of the
    bucket has stepped its slice (:mod:`.sharding`)."""
    if not cand.shard_optimizer:
        return list(stepped)
    gathers = [Collective(name, members, {w: stepped[w] for w in members},
                          parameter_gather_s(costs, cand, members, nbytes))
               for name, members, _, nbytes in buckets]
    return sync_timeline(gathers, stepped)


def _optimizer_s(costs: ModelCosts, cand: Candidate, schedule: Schedule, partition: Sequence[range]) -> list[float]:
    """Per worker, its AdamW step: over its layers' parameters, or its share of them with a sharded state."""
    out = []
    ranges = dict(enumerate(partition))
    for w in range(cand.D):
        layers = {i for s in schedule.stages_of(w) for i in partition[s]}
        full = sum(costs.layers[i].opt_s for i in layers)
        if cand.shard_optimizer:
            full *= optimizer_share(worker_buckets(costs, cand.W, schedule, w, ranges), True)
        out.append(full)
    return out


def _step_s(costs: ModelCosts, cand: Candidate) -> float:
    """The runtime's fixed cost per step and its scalar all-reduces (loss normalisers over the replicas)."""
    ar = costs.comm.allreduce
    step = costs.comm.step_s + max(rabenseifner(cand.world_size, 8, ar.alpha, ar.beta)
                                   - rabenseifner(2, 8, ar.alpha, ar.beta), 0.0)
    if cand.W > 1:
        step += rabenseifner(cand.world_size, 8, ar.alpha, ar.beta)  # loss normalisers over the replicas
    return step


def gradient_sync_s(costs: ModelCosts, cand: Candidate, members: Sequence[int], nbytes: float) -> float:
    """One bucket's gradient sync over its ``W·len(members)`` copies: an all-reduce, or with a sharded optimizer
    state on NCCL (a GPU device) a reduce-scatter, half of it (:mod:`.sharding`); gloo all-reduces either way."""
    full = costs.comm.allreduce_s(cand.W * len(members), nbytes, D=cand.D, W=cand.W, copies=len(members))
    return full / 2 if cand.shard_optimizer and uses_nccl(costs) else full


def parameter_gather_s(costs: ModelCosts, cand: Candidate, members: Sequence[int], nbytes: float) -> float:
    """One bucket's parameter gather after a sharded optimizer step, half an all-reduce: an all-gather on NCCL, each
    rank's slice broadcast from it on gloo (each rank receives the other ranks' slices, as in an all-gather; measured
    on 2 gloo ranks, 30 M floats: 0.06 s against the all-reduce's 0.14 s) (:mod:`.sharding`)."""
    full = costs.comm.allreduce_s(cand.W * len(members), nbytes, D=cand.D, W=cand.W, copies=len(members))
    return full / 2


def uses_nccl(costs: ModelCosts) -> bool:
    """Whether the ranks of these costs run NCCL's collectives (a CUDA device, profiled or described) or gloo's."""
    return costs.device.startswith("cuda")


def _steady_window(cand: Candidate, t_f: Sequence[float], t_b: Sequence[float],
                   t_comm: float) -> tuple[Schedule, float, list[float]]:
    """An asynchronous schedule's steady step: the makespan one more step adds to the no-flush
    stream (past the fill), and each worker's busy time in it."""
    schedule = window(cand.strategy, cand.D, cand.N, steady_step(cand.strategy, cand.D, cand.N))
    busy = [cand.N * (t_f[s] + t_b[s]) for s in range(cand.D)]
    return schedule, steady_step_makespan(cand.strategy, cand.D, cand.N, t_f, t_b, t_comm=t_comm), busy


def _cpu_contention(collectives: Sequence[Collective], timeline: Sequence, compute_end: Sequence[float],
                    stretch: float) -> list[float]:
    """CPU ranks that already occupy every core: an all-reduce launched early (eager sync) takes its
    core time from the computation it overlaps, which ends that much later (it is hidden only behind
    the worker's idle time). On GPUs (``cores = 0``) it overlaps for free."""
    out = list(compute_end)
    for c in collectives:
        for w in c.members:
            start, end = c.launch[w], c.launch[w] + c.duration
            if start >= compute_end[w] or not timeline[w]:
                continue
            out[w] += sum(max(0.0, min(end, t.end * stretch) - max(start, t.start * stretch)) for t in timeline[w])
    return out


def _buckets(costs: ModelCosts, cand: Candidate, partition: Sequence[range], schedule: Schedule,
             timeline: Sequence, compute_end: Sequence[float], stretch: float
             ) -> list[tuple[str, tuple[int, ...], dict[int, float], float]]:
    """The gradient buckets of one replica group's workers (every replica alike, Chimera §3.3), as
    ``(name, member workers, launch time per member, bytes)``: one per stage and one for the tied weights, those
    copied on the same workers fused with ``grad_sync=end`` as the runtime fuses them."""
    early: dict[int, set[int]] = {}
    for w in range(cand.D):
        plan = launch_plan(schedule, w, cand.grad_sync) if cand.grad_sync != "end" else {}
        early[w] = {s for stages in plan.values() for s in stages}

    def launch(w: int, stage: int) -> float:
        if stage in early[w]:
            return _last_backward_end(timeline[w], stage) * stretch
        return compute_end[w]

    buckets: list[tuple[str, tuple[int, ...], dict[int, float], float]] = []  # name, members, launches, bytes
    for s, stage in enumerate(partition):
        members = stage_members(schedule, s)
        nbytes = costs.stage_sync_bytes(stage)
        if cand.W * len(members) > 1 and nbytes > 0:
            buckets.append((f"stage{s}", members, {w: launch(w, s) for w in members}, nbytes))
    for k, (i, j, nbytes) in enumerate(costs.tied):
        holders = sorted({s for s, st in enumerate(partition) if i in st or j in st})
        members = tuple(sorted({row[s] for row in schedule.placement for s in holders}))
        if cand.W * len(members) > 1:
            launches = {w: max(launch(w, s) for s in holders if w in {row[s] for row in schedule.placement})
                        for w in members}
            buckets.append((f"tied{k}", members, launches, nbytes))
    if cand.grad_sync == "end":  # the runtime fuses buckets with the same members into one all-reduce
        fused: dict[tuple[int, ...], tuple[str, tuple[int, ...], dict[int, float], float]] = {}
        for name, members, launches, nbytes in buckets:
            if members in fused:
                prev = fused[members]
                fused[members] = (f"{prev[0]}+{name}", members,
                                  {w: max(prev[2][w], launches[w]) for w in members}, prev[3] + nbytes)
            else:
                fused[members] = (name, members, launches, nbytes)
        buckets = list(fused.values())
    return buckets
