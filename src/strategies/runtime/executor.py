"""Executes one rank's actions of a schedule, in order: the action loop, its messages and its step context.

Three layers, one job each: the schedule decides the order (:mod:`pipeline_recipes.strategies.schedules`);
this module runs it — for each action, one round of point-to-point messages
(:mod:`pipeline_recipes.strategies.schedules.comm`, :class:`~pipeline_recipes.strategies.runtime.p2p.PipeComm`), then the
action on its stage copy; a
:class:`~pipeline_recipes.strategies.runtime.stage.PipelineStage` computes forwards, backwards (``B``) and split backwards
(``I`` then ``W``, Zero Bubble Pipeline Parallelism §2) and keeps the graphs between them; the
Lightning strategy maps Lightning's hooks onto the engine (:mod:`pipeline_recipes.strategies.runtime.engine`).

Losses are normalised globally (see :func:`micro_batch_loss`), so summing every micro-batch's
loss over all ranks gives exactly the unsplit model's mini-batch loss, and summing gradients
gives exactly its gradients (mini-batch SGD, Chimera §2).

A doubled forward (Chimera §3.5) runs its two micro-batches as two graphs in one action; a
halved backward's forward runs two half-micro-batch graphs so each half backward is exact.
Consecutive stages on one worker (V placement) hand their messages over locally.

No host synchronisation (``.item()``) happens inside the step. A failing action is re-raised as
:class:`StepError` with the worker × step grid, the action marked.

Asynchronous schedules (:mod:`pipeline_recipes.strategies.schedules.asynchronous`) run one *window* per step
through :class:`AsyncWindows`, a wrapper around the same loop: micro-batches are numbered
globally, the graphs of micro-batches still in flight stay on their stages, and messages sent in a
window arrive in that window (its last round), kept for the next.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pipeline_recipes.strategies.runtime.p2p import Incoming, Outgoing, PipeComm
from pipeline_recipes.core.pipeline_model import Batch, PipelineModel, micro_batch_loss, run_layers
from pipeline_recipes.strategies.runtime.recompute import parameter_storages
from pipeline_recipes.strategies.schedules import Action, Schedule, format_grid, simulate
from pipeline_recipes.strategies.schedules.asynchronous import steady_step
from pipeline_recipes.strategies.schedules.comm import CommPlan, Round, comm_plan, shifted_message
from pipeline_recipes.strategies.schedules.effects import graph_effect
from pipeline_recipes.strategies.schedules.messages import Message, is_local
from pipeline_recipes.strategies.runtime.stage import PipelineStage, StoredBytes, forget_autocast_casts, unique_parameters
from pipeline_recipes.strategies.compute.timing import ActionClock
from pipeline_recipes.strategies.runtime.topology import Topology
from pipeline_recipes.strategies.runtime.versions import WeightVersions


def batch_signature(batch: Batch) -> tuple:
    return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(batch.items()) if isinstance(v, Tensor))


def half_of(batch: Batch, half: int) -> dict:
    return {k: (v.chunk(2)[half] if isinstance(v, Tensor) else v) for k, v in batch.items()}


@dataclass
class StepRecord:
    """What one step on this rank measured.

    ``loss_sum``: this rank's share of the mini-batch loss (a device tensor, no host sync);
    ``timeline``: (action, start, end) wall times (:mod:`pipeline_recipes.strategies.compute.timing`);
    ``peak_stored_bytes``: the most activation bytes held at once between forwards and their backwards
    (:class:`~pipeline_recipes.strategies.runtime.recompute.SavedBytes`).
    """

    loss_sum: Tensor
    clock: ActionClock | None = None
    peak_stored_bytes: int = 0

    @property
    def timeline(self) -> list[tuple[Action, float, float]]:
        return self.clock.timeline() if self.clock is not None else []


class StepError(RuntimeError):
    """An action failed; the message shows the worker × step grid with the failing action marked."""


@dataclass
class StepContext:
    """What one step (or asynchronous window) runs on: the schedule and this worker's plan of rounds,
    the micro-batches by index, the loss normalisers, and what the step gathers as it goes."""

    schedule: Schedule
    plan: CommPlan
    micro_batches: Mapping[int, Batch]
    totals: Mapping[str, float | Tensor]
    train: bool
    inbox: dict[Message, Incoming] = field(default_factory=dict)  # received or posted, not yet consumed
    losses: list[Tensor] = field(default_factory=list)
    halved: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.halved = {a.mb for acts in self.schedule.workers for a in acts if a.half is not None}


class StageExecutor:
    """Runs this rank's actions on its stage copies (one per pipeline for Chimera, ``v`` chunks for
    interleaved schedules), in the schedule's order, with the schedule's rounds of messages."""

    def __init__(
        self,
        model: PipelineModel,
        stage_layers: Mapping[int, Sequence[nn.Module]],
        topology: Topology,
        rank: int,
        comm: PipeComm,
        recompute: frozenset[int] = frozenset(),
        versions: WeightVersions | None = None,
        split_backward: frozenset[int] = frozenset(),
    ) -> None:
        """``split_backward``: the stages whose backwards the schedule runs as ``I`` + ``W``."""
        self.model, self.stage_layers, self.topology, self.rank, self.comm = model, stage_layers, topology, rank, comm
        self.worker = topology.worker_of(rank)
        self.stored = StoredBytes()
        weights = parameter_storages([p for layers in stage_layers.values() for p in unique_parameters(layers)])
        self.stages = {s: PipelineStage(s, topology.stages, layers, recompute=s in recompute, versions=versions,
                                        stored=self.stored, parameter_storages=weights,
                                        split_backward=s in split_backward)
                       for s, layers in stage_layers.items()}
        self._outbox: dict[Message, Tensor] = {}  # produced by the last action, sent in the next round
        self._local: dict[Message, Tensor] = {}  # between consecutive stages on this worker: no transfer
        self._shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}  # (pipe, sending stage, batch shapes)
        self._probed: set[tuple] = set()  # micro-batch shapes whose message shapes are known
        self._plans: dict[tuple[Schedule, bool], CommPlan] = {}  # the synchronous steps' plans, derived once
        self._idle_points: dict[Schedule, int | None] = {}  # where host work waits for a peer (:meth:`_idle_point`)
        self._clock_reference: tuple[torch.cuda.Event, float] | None = None  # CUDA: timelines' reference event

    def run(
        self,
        schedule: Schedule,
        micro_batches: Sequence[Batch] | Mapping[int, Batch],
        totals: Mapping[str, float | Tensor],
        train: bool = True,
        after_backward: Callable[[Action], None] | None = None,
        loss_final: Callable[[Tensor], None] | None = None,
        idle_work: Callable[[], None] | None = None,
    ) -> StepRecord:
        """One synchronous step (or evaluation: forwards only); ``after_backward(action)`` runs after
        each backward; ``loss_final(loss_sum)`` once this rank's share of the loss is known, before its
        last action (or after its last loss-computing forward, if that comes later): a collective posted
        there completes while the step's last actions run; ``idle_work()`` in the step's longest bubble
        (:meth:`_idle_point`), if the host waits there. Every graph is consumed by the end of a
        training step."""
        if (plan := self._plans.get((schedule, train))) is None:
            plan = self._plans[(schedule, train)] = comm_plan(schedule, self.worker, train)
        batches = dict(micro_batches) if isinstance(micro_batches, Mapping) else dict(enumerate(micro_batches))
        if train:
            self.stored.now = 0
        ctx = StepContext(schedule, plan, batches, totals, train)
        idle_at = self._idle_point(schedule, plan.actions) if idle_work is not None and train else None
        idle = (idle_at, idle_work) if idle_at is not None else None
        record = self.execute(ctx, after_backward, loss_final, idle)
        self.comm.finish()
        left = [(s, k) for s, stage in self.stages.items() for k in stage.pending]
        if train and (left or self._local):
            raise RuntimeError(f"rank {self.rank}: activations left after the step: {left or sorted(self._local)}")
        return record

    def _idle_point(self, schedule: Schedule, actions: Sequence[Action]) -> int | None:
        """The index in ``actions`` (this worker's, as executed) of the action before which ``schedule``'s
        simulation (t_b = 2 t_f) waits longest for a peer, if that wait is at least one forward: the bubble
        where host work costs the step nothing (none in a schedule without bubbles inside the step, such
        as Chimera's at N = D)."""
        if schedule not in self._idle_points:
            simulation = simulate(schedule)
            i, wait = simulation.longest_wait(self.worker)
            action = simulation.timeline[self.worker][i].action if wait >= 1.0 else None
            self._idle_points[schedule] = actions.index(action) if action in actions else None
        return self._idle_points[schedule]

    def execute(self, ctx: StepContext, after_backward: Callable[[Action], None] | None = None,
                loss_final: Callable[[Tensor], None] | None = None,
                idle: tuple[int, Callable[[], None]] | None = None) -> StepRecord:
        """The action loop: before each action one round of messages, then the action on its stage;
        ``idle = (i, work)``: ``work()`` before the ``i``-th action if the host would wait for its input."""
        self.stored.peak = self.stored.now
        self._learn_shapes(ctx)
        self._clock_reference = ActionClock.reference_of(self.comm.device, self._clock_reference)
        record = StepRecord(torch.zeros((), dtype=torch.float64), ActionClock(self.comm.device, self._clock_reference))
        plan = ctx.plan
        last_loss = max((i for i, a in enumerate(plan.actions) if a.kind == "F" and self.stages[a.stage].is_last),
                        default=-1)
        final_at = max(last_loss + 1, len(plan.actions) - 1)  # the action before which the share is handed over
        with torch.set_grad_enabled(ctx.train):
            for i, action in enumerate(plan.actions):
                if i == final_at:
                    self._hand_over_loss(ctx, record, loss_final)
                self._post(ctx, plan.rounds[i])
                if idle is not None and i == idle[0]:
                    self._while_waiting(ctx, plan.needs(i), idle[1])
                try:
                    inputs = [self._local.pop(m) if m in self._local else self.comm.wait(ctx.inbox.pop(m))
                              for m in plan.needs(i)]
                    start = record.clock.now()  # the box starts once its inputs arrived: waiting is a bubble
                    if action.kind == "F":
                        self._forward(ctx, action, inputs)
                    else:
                        self._backward(ctx, action, inputs)
                        if after_backward is not None:
                            after_backward(action)
                except Exception as err:
                    raise StepError(self._failure(ctx.schedule, action, err)) from err
                record.clock.box(action, start)
            self._post(ctx, plan.rounds[-1])
        if final_at >= len(plan.actions):
            self._hand_over_loss(ctx, record, loss_final)
        record.peak_stored_bytes = self.stored.peak
        return record

    def _while_waiting(self, ctx: StepContext, needs: Sequence[Message], work: Callable[[], None]) -> None:
        """``work()`` if the host would block on the first of ``needs`` that comes from a peer (outside the
        action's error handling: a failure of ``work`` is its own, not the action's)."""
        remote = [ctx.inbox[m] for m in needs if m not in self._local and m in ctx.inbox]
        if remote and self.comm.would_block(remote[0]):
            work()

    @staticmethod
    def _hand_over_loss(ctx: StepContext, record: StepRecord, loss_final: Callable[[Tensor], None] | None) -> None:
        """``record.loss_sum`` from the step's losses (every one is computed by now), to ``loss_final``."""
        if ctx.losses:
            dtype = torch.float32 if ctx.losses[0].device.type == "mps" else torch.float64
            record.loss_sum = torch.stack([x.to(dtype) for x in ctx.losses]).sum()
        if loss_final is not None:
            loss_final(record.loss_sum)

    def _failure(self, schedule: Schedule, action: Action, err: BaseException) -> str:
        index = schedule.workers[self.worker].index(action)
        return (f"rank {self.rank} (worker {self.worker}) failed in action {action} of '{schedule.name}' "
                f"({schedule.describe_size()}): {type(err).__name__}: {err}\n"
                f"{format_grid(schedule, [(self.worker, index)])}")

    # -- communication -------------------------------------------------------------------------

    def _post(self, ctx: StepContext, rnd: Round) -> None:
        """Send what the last action produced and post the receives of this round."""
        sends = [Outgoing(self._rank_of(t.peer), self._outbox.pop(t.message), t.message) for t in rnd.sends]
        recvs = []
        for t in rnd.recvs:
            incoming = Incoming(self._rank_of(t.peer), *self._message_shape(ctx, t.message), t.message)
            ctx.inbox[t.message] = incoming
            recvs.append(incoming)
        self.comm.post(sends, recvs)

    def _message_shape(self, ctx: StepContext, m: Message) -> tuple[torch.Size, torch.dtype]:
        """An activation's shape as learnt; a gradient has the shape of the activation it belongs to."""
        signature = batch_signature(ctx.micro_batches[m.mb])
        if m.kind == "act":
            return self._shapes[(m.pipe, m.stage, signature)]
        shape, dtype = self._shapes[(m.pipe, m.stage - 1, signature)]
        if m.half is not None:  # the sizes of Tensor.chunk(2)
            first = (shape[0] + 1) // 2
            shape = torch.Size((first if m.half == 0 else shape[0] - first, *shape[1:]))
        return shape, dtype

    def _learn_shapes(self, ctx: StepContext) -> None:
        """Message shapes, once per micro-batch shape, before the first round (shape inference).

        Every worker visits its (pipeline, stage) copies in the same global order; a stage after
        the first learns its input's shape from the previous stage's worker (a host-side header;
        from itself when it holds that stage too), runs one no-grad forward on zeros of that shape
        and announces its output's shape to the next. Each wait is on an earlier (pipeline,
        stage), so this cannot deadlock. The RNG streams are restored afterwards (dropout draws
        stay those of a single-process step)."""
        new: dict[tuple, Batch] = {}
        for batch in ctx.micro_batches.values():
            signature = batch_signature(batch)
            if signature not in self._probed:
                new.setdefault(signature, batch)
        if not new:
            return
        S, worker, placement = self.topology.stages, self.worker, ctx.schedule.placement
        held = sorted((p, s) for p, row in enumerate(placement) for s, w in enumerate(row) if w == worker)
        devices = [self.comm.device] if self.comm.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for signature, batch in new.items():
                for pipe, stage in held:
                    if stage == 0:
                        x = self.model.pipeline_input(batch)
                    else:
                        if placement[pipe][stage - 1] != worker:  # else learnt just before, on this worker
                            self._shapes[(pipe, stage - 1, signature)] = self.comm.learn(
                                self._peer(pipe, stage - 1), f"pipeline {pipe} stage {stage - 1}")
                        shape, dtype = self._shapes[(pipe, stage - 1, signature)]
                        x = torch.zeros(shape, dtype=dtype, device=self.comm.device)
                    if stage < S - 1:
                        out = run_layers(self.stage_layers[stage], x, batch)
                        forget_autocast_casts()
                        self._shapes[(pipe, stage, signature)] = (out.shape, out.dtype)
                        if placement[pipe][stage + 1] != worker:
                            self.comm.announce(self._peer(pipe, stage + 1), out.shape, out.dtype,
                                               f"pipeline {pipe} stage {stage}")
                self._probed.add(signature)

    def _peer(self, pipe: int, stage: int) -> int:
        return self.topology.peer(self.rank, pipe, stage)

    def _produce(self, ctx: StepContext, message: Message, tensor: Tensor) -> None:
        if is_local(ctx.schedule, message):
            self._local[message] = tensor
        else:
            self._outbox[message] = tensor

    def _rank_of(self, worker: int) -> int:
        return self.topology.rank_of(self.topology.replica_of(self.rank), worker)

    # -- actions -------------------------------------------------------------------------------

    def _loss(self, ctx: StepContext) -> Callable[[Tensor, Batch], Tensor]:
        return lambda out, batch: micro_batch_loss(self.model, out, batch, ctx.totals)

    def _forward(self, ctx: StepContext, action: Action, inputs: list[Tensor]) -> None:
        """One graph per key the action keeps (:func:`graph_effect`): per micro-batch (two when doubled),
        per half when the micro-batch's backward is halved."""
        stage = self.stages[action.stage]
        outputs: dict[int, list[Tensor]] = {mb: [] for mb in action.mbs}
        for key in graph_effect(action, ctx.halved).keeps:
            _, mb, half = key
            batch = ctx.micro_batches[mb]
            x = self.model.pipeline_input(batch) if stage.is_first else inputs[action.mbs.index(mb)]
            part = batch if half is None else half_of(batch, half)
            inp = x if half is None else x.chunk(2)[half]
            out = stage.forward(key, inp, part, self._loss(ctx), ctx.train)
            if stage.is_last:
                ctx.losses.append(out.detach())
            else:
                outputs[mb].append(out)
        if not stage.is_last:
            for mb, parts in outputs.items():
                sent = parts[0] if len(parts) == 1 else torch.cat(parts)
                self._produce(ctx, Message("act", action.pipe, action.stage, mb), sent)

    def _backward(self, ctx: StepContext, action: Action, inputs: list[Tensor]) -> None:
        """``B``, ``I`` or ``W`` on the action's stage (:func:`graph_effect`); the input gradient goes on."""
        stage, key = self.stages[action.stage], (action.pipe, action.mb, action.half)
        effect = graph_effect(action, ctx.halved)
        batch = ctx.micro_batches[action.mb]
        part = batch if action.half is None else half_of(batch, action.half)
        output_grad = inputs[0] if inputs else None
        if action.kind == "W":
            stage.weight_gradient(key, part, self._loss(ctx))
            return
        run = stage.backward if action.kind == "B" else stage.input_gradient
        grad = run(key, output_grad, part, self._loss(ctx))
        if effect.input_gradient:
            self._produce(ctx, Message("grad", action.pipe, action.stage, action.mb, action.half), grad)


class WindowPlans:
    """One worker's plans of an asynchronous schedule's windows, each derived once.

    From the steady step on (:func:`~pipeline_recipes.strategies.schedules.asynchronous.steady_step`) a window is
    the steady window with its micro-batches renumbered, and so is its plan, given the same
    messages carried in (renumbered alike): the plan is derived for the first such window and
    renumbered for the next ones, instead of replaying the window's timeline every step."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self._plans: dict[tuple, CommPlan] = {}  # (window shape, carried in): the plan at offset 0

    def __len__(self) -> int:
        """How many plans were derived (one per window shape)."""
        return len(self._plans)

    def __call__(self, window: Schedule, carried_in: Collection[Message]) -> CommPlan:
        step, N = window.meta["step"], window.micro_batches
        phase = min(step, steady_step(window.name, window.stages, N))
        offset = (step - phase) * N  # micro-batches between this window and the one its shape is keyed by
        carried = frozenset(shifted_message(m, -offset) for m in carried_in)
        key = (window.name, window.stages, N, phase, carried)
        plan = self._plans.get(key)
        if plan is None:
            plan = comm_plan(window, self.worker, True, carried_in=carried_in).shifted(-offset)
            self._plans[key] = plan
        return plan.shifted(offset)


class AsyncWindows:
    """Runs an asynchronous schedule's windows (PipeDream, PipeDream-2BW) on a :class:`StageExecutor`.

    What crosses a step boundary lives here, not in the action loop: the messages sent to this
    rank in one window and consumed in the next (received in the window that sends them, so no
    receive waits across the step's collectives), and the micro-batches still in flight, whose
    graphs stay on their stages and whose shapes the next window's gradients take."""

    def __init__(self, executor: StageExecutor) -> None:
        self.executor = executor
        self.plans = WindowPlans(executor.worker)
        self._carried: dict[Message, Incoming] = {}
        self._in_flight: dict[int, Batch] = {}  # micro-batch → its batch, until its last backward here

    def run(self, window: Schedule, micro_batches: Mapping[int, Batch], totals: Mapping[str, float | Tensor]) -> StepRecord:
        ex = self.executor
        plan = self.plans(window, self._carried.keys())
        self._in_flight.update(micro_batches)
        ctx = StepContext(window, plan, dict(self._in_flight), totals, True, inbox=self._carried)
        record = ex.execute(ctx)
        ex.comm.finish(keep_open=True)  # the window's last rounds complete during the next window
        self._carried = ctx.inbox  # sent in this window, consumed in the next
        pending = {key[1] for stage in ex.stages.values() for key in stage.pending}
        self._in_flight = {mb: batch for mb, batch in self._in_flight.items() if mb in pending}
        return record


