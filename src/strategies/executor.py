"""Executes one rank's actions of a schedule: forward/backward of local stages and p2p.

The schedule decides the order (:mod:`strategies.schedules`); this module owns the stage
buffers (inputs kept for backward, outputs or losses) and moves activations forward and
activation gradients backward through a :class:`~strategies.p2p.PipeComm`.

Losses are normalised globally (see :func:`micro_batch_loss`), so summing every micro-batch's
loss over all ranks gives exactly the unsplit model's mini-batch loss, and summing gradients
gives exactly its gradients (mini-batch SGD, Chimera §2).

A doubled forward (Chimera §3.5) runs its two micro-batches as two graphs in one action; a
halved backward's forward runs two half-micro-batch graphs so each half backward is exact.

Communication goes in rounds derived from the schedule (:mod:`strategies.schedules.comm`):
before each action one round sends the previous action's outputs and receives this action's inputs
(:class:`~strategies.p2p.PipeComm`); no host synchronisation (``.item()``) happens inside the step.
With recomputation (:mod:`strategies.recompute`, GPipe re-materialization) a
stage keeps only its input between forward and backward; the step record reports the peak bytes
kept. A failing action is reported with the worker × step grid, the action marked.

Asynchronous schedules (:mod:`strategies.schedules.asynchronous`) run one *window* per step:
micro-batches are numbered globally, the graphs of micro-batches still in flight carry over to
the next step, forwards run on the step's stashed weight version (:class:`~strategies.versions.WeightVersions`),
and messages sent in a window arrive in that window (its last round), kept for the next.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from .p2p import Incoming, Outgoing, PipeComm
from .pipeline_model import Batch, PipelineModel, run_layers
from .recompute import RngState, SavedBytes, parameter_storages
from .schedules import Action, Schedule, format_grid
from .schedules.comm import CommPlan, Round, comm_plan
from .schedules.messages import Message, is_local
from .timing import ActionClock
from .topology import Topology
from .versions import WeightVersions

GraphKey = tuple[int, int, int, int | None]  # pipe, stage, micro-batch, half


def batch_signature(batch: Batch) -> tuple:
    return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(batch.items()) if isinstance(v, Tensor))


def half_of(batch: Batch, half: int) -> dict:
    return {k: (v.chunk(2)[half] if isinstance(v, Tensor) else v) for k, v in batch.items()}


def loss_counts(model: PipelineModel, batch: Batch) -> dict[str, Tensor]:
    """Per loss term, how many items (samples, tokens) of ``batch`` it averages over."""
    counts = getattr(model, "loss_counts", None)
    if counts is not None:
        return {k: torch.as_tensor(v, dtype=torch.float64) for k, v in counts(batch).items()}
    size = next(v.shape[0] for v in batch.values() if isinstance(v, Tensor))
    return {"samples": torch.tensor(float(size), dtype=torch.float64)}


def micro_batch_loss(
    model: PipelineModel, output: Tensor, batch: Batch, totals: Mapping[str, float | Tensor]
) -> Tensor:
    """This micro-batch's share of the mini-batch loss: per-term sums over mini-batch counts.

    Models with several mean terms (BERT: MLM over masked tokens + NSP over samples) provide
    ``loss_terms`` (per-term sums) and ``loss_counts``; others are weighted by sample count.
    """
    terms = getattr(model, "loss_terms", None)
    if terms is not None:
        return sum(value / totals[name] for name, value in terms(output, batch).items())
    counts = loss_counts(model, batch)
    return model.pipeline_loss(output, batch) * (float(counts["samples"]) / totals["samples"])


@dataclass
class StepRecord:
    """What one step on this rank measured.

    ``loss_sum``: this rank's share of the mini-batch loss (a device tensor, no host sync);
    ``timeline``: (action, start, end) wall times (:mod:`strategies.timing`); ``peak_stored_bytes``:
    the most activation bytes held at once between forwards and their backwards (:class:`SavedBytes`).
    """

    loss_sum: Tensor
    clock: ActionClock | None = None
    peak_stored_bytes: int = 0

    @property
    def timeline(self) -> list[tuple[Action, float, float]]:
        return self.clock.timeline() if self.clock is not None else []


@dataclass
class _Saved:
    """What a forward keeps for its backward: the graph (``out``), or for recomputation only the
    input and the RNG state to replay it. Between a split backward's ``I`` and ``W``, ``weight_grads``
    holds what ``W`` needs (torch.distributed.pipelining's parameter groups), or ``None`` on the first
    stage, whose ``I`` has no input gradient to compute and leaves the whole backward to ``W``."""

    inp: Tensor | None
    out: Tensor | None
    rng: RngState | None
    nbytes: int
    weight_grads: list[dict] | None = None
    output_grad: Tensor | None = None


class StepError(RuntimeError):
    """An action failed; the message shows the worker × step grid with the failing action marked."""


class StageExecutor:
    """Runs this rank's actions on its local stages (one per pipeline for Chimera).

    Communication follows the schedule's rounds (:mod:`strategies.schedules.comm`): before each
    action one round sends what the previous action produced and receives what this one needs.
    """

    def __init__(
        self,
        model: PipelineModel,
        stage_layers: Mapping[int, Sequence[nn.Module]],
        topology: Topology,
        rank: int,
        comm: PipeComm,
        recompute: frozenset[int] = frozenset(),
        versions: WeightVersions | None = None,
    ) -> None:
        self.model = model
        self.stage_layers = stage_layers
        self.topology = topology
        self.rank = rank
        self.comm = comm
        self.recompute = recompute
        self.versions = versions
        self._graphs: dict[GraphKey, _Saved] = {}
        self._stored = 0
        self._signatures: dict[int, tuple] = {}  # micro-batches in flight across steps (asynchronous)
        self._inbox: dict[Message, Incoming] = {}  # received or posted, not yet consumed
        self._carried: dict[Message, Incoming] = {}  # an asynchronous window's messages for the next
        self._outbox: dict[Message, Tensor] = {}  # produced by the last action, sent in the next round
        self._local: dict[Message, Tensor] = {}  # between consecutive stages on this worker: no transfer
        self._stage_params = {s: _unique_parameters(layers) for s, layers in stage_layers.items()}
        self._shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}  # (pipe, sending stage, batch shapes)
        self._probed: set[tuple] = set()  # micro-batch shapes whose message shapes are known
        self._plans: dict[tuple[Schedule, bool], CommPlan] = {}  # the synchronous steps' plans, derived once

    def run(
        self,
        schedule: Schedule,
        micro_batches: Sequence[Batch] | Mapping[int, Batch],
        totals: Mapping[str, float | Tensor],
        train: bool = True,
        after_backward: Callable[[Action], None] | None = None,
    ) -> StepRecord:
        """Execute this rank's actions; ``after_backward(action)`` runs after each backward.

        ``micro_batches`` maps micro-batch indices to batches (a sequence: indices 0…N-1). In a
        window of an asynchronous schedule (``"step"`` in its meta) the graphs of micro-batches still
        in flight, and the messages sent to this rank for the next window, carry over."""
        worker = self.topology.worker_of(self.rank)
        carried = train and "step" in schedule.meta
        self._inbox = self._carried if carried else {}
        if carried:
            plan = comm_plan(schedule, worker, train, carried_in=self._inbox.keys())
        elif (plan := self._plans.get((schedule, train))) is None:
            plan = self._plans[(schedule, train)] = comm_plan(schedule, worker, train)
        halved = {a.mb for acts in schedule.workers for a in acts if a.half is not None}
        params = [p for layers in self.stage_layers.values() for layer in layers for p in layer.parameters()]
        batches = dict(micro_batches) if isinstance(micro_batches, Mapping) else dict(enumerate(micro_batches))
        ctx = _StepContext(schedule, batches, totals, halved, train, parameter_storages(params))
        self._ctx = ctx
        if train and not carried:
            self._stored = 0
        self._learn_shapes(ctx)
        record = StepRecord(torch.zeros((), dtype=torch.float64), ActionClock(self.comm.device))
        with torch.set_grad_enabled(train):
            for i, action in enumerate(plan.actions):
                self._post(plan.rounds[i])
                try:
                    inputs = [self._local.pop(m) if m in self._local else self.comm.wait(self._inbox.pop(m))
                              for m in plan.needs(i)]
                    start = record.clock.now()  # the box starts once its inputs arrived: waiting is a bubble
                    if action.kind == "F":
                        self._forward(action, inputs)
                    else:
                        self._BACKWARDS[action.kind](self, action, inputs)
                        if after_backward is not None:
                            after_backward(action)
                except Exception as err:
                    raise StepError(self._failure(schedule, worker, action, err)) from err
                record.clock.box(action, start)
            self._post(plan.rounds[-1])
        self.comm.finish(keep_open=carried)
        if carried:
            self._carried = self._inbox  # sent in this window, consumed in the next
        if (self._graphs or self._local) and train and not carried:
            raise RuntimeError(f"rank {self.rank}: activations left after the step: "
                               f"{sorted(self._graphs) or sorted(self._local)}")
        if ctx.losses:
            dtype = torch.float32 if ctx.losses[0].device.type == "mps" else torch.float64
            record.loss_sum = torch.stack([x.to(dtype) for x in ctx.losses]).sum()
        record.peak_stored_bytes = ctx.peak_stored
        return record

    def _failure(self, schedule: Schedule, worker: int, action: Action, err: BaseException) -> str:
        index = schedule.workers[worker].index(action)
        return (f"rank {self.rank} (worker {worker}) failed in action {action} of '{schedule.name}' "
                f"({schedule.describe_size()}): {type(err).__name__}: {err}\n"
                f"{format_grid(schedule, [(worker, index)])}")

    # -- communication -------------------------------------------------------------------------

    def _post(self, rnd: Round) -> None:
        """Send what the last action produced and post the receives of this round."""
        sends = [Outgoing(self._rank_of(t.peer), self._outbox.pop(t.message), t.message) for t in rnd.sends]
        recvs = []
        for t in rnd.recvs:
            incoming = Incoming(self._rank_of(t.peer), *self._message_shape(t.message), t.message)
            self._inbox[t.message] = incoming
            recvs.append(incoming)
        self.comm.post(sends, recvs)

    def _message_shape(self, m: Message) -> tuple[torch.Size, torch.dtype]:
        """An activation's shape as learnt; a gradient has the shape of the activation it belongs to."""
        signature = self._signature(m.mb)
        if m.kind == "act":
            return self._shapes[(m.pipe, m.stage, signature)]
        shape, dtype = self._shapes[(m.pipe, m.stage - 1, signature)]
        if m.half is not None:  # the sizes of Tensor.chunk(2)
            first = (shape[0] + 1) // 2
            shape = torch.Size((first if m.half == 0 else shape[0] - first, *shape[1:]))
        return shape, dtype

    def _learn_shapes(self, ctx: _StepContext) -> None:
        """Message shapes, once per micro-batch shape, before the first round (shape inference).

        Every worker visits its (pipeline, stage) copies in the same global order; a stage after
        the first learns its input's shape from the previous stage's worker (a host-side header),
        runs one no-grad forward on zeros of that shape and announces its output's shape to the
        next. Each wait is on an earlier (pipeline, stage), so this cannot deadlock. The RNG
        streams are restored afterwards (dropout draws stay those of a single-process step)."""
        new: dict[tuple, Batch] = {}
        for batch in ctx.micro_batches.values():
            signature = batch_signature(batch)
            if signature not in self._probed:
                new.setdefault(signature, batch)
        if not new:
            return
        S, worker = self.topology.stages, self.topology.worker_of(self.rank)
        placement = ctx.schedule.placement
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
                        _forget_autocast_casts()
                        self._shapes[(pipe, stage, signature)] = (out.shape, out.dtype)
                        if placement[pipe][stage + 1] != worker:
                            self.comm.announce(self._peer(pipe, stage + 1), out.shape, out.dtype,
                                               f"pipeline {pipe} stage {stage}")
                self._probed.add(signature)

    def _peer(self, pipe: int, stage: int) -> int:
        return self.topology.peer(self.rank, pipe, stage)

    def _produce(self, message: Message, tensor: Tensor) -> None:
        if is_local(self._ctx.schedule, message):
            self._local[message] = tensor
        else:
            self._outbox[message] = tensor

    def _rank_of(self, worker: int) -> int:
        return self.topology.rank_of(self.topology.replica_of(self.rank), worker)

    def _signature(self, mb: int) -> tuple:
        """Shapes of micro-batch ``mb``: from this step's batch, or remembered from its forward."""
        batch = self._ctx.micro_batches.get(mb)
        return batch_signature(batch) if batch is not None else self._signatures[mb]

    # -- actions -------------------------------------------------------------------------------

    def _stage_forward(self, stage: int, inp: Tensor, batch: Batch) -> Tensor:
        """The stage's layers (on the step's weight version, if stashed), plus the loss share on the last stage."""
        if self.versions is not None and self._ctx.train:
            with self.versions.forward_weights(stage):
                out = run_layers(self.stage_layers[stage], inp, batch)
        else:
            out = run_layers(self.stage_layers[stage], inp, batch)
        if stage == self.topology.stages - 1:
            out = micro_batch_loss(self.model, out, batch, self._ctx.totals)
        return out

    def _keep(self, key: GraphKey, saved: _Saved) -> None:
        self._graphs[key] = saved
        self._stored += saved.nbytes
        self._ctx.peak_stored = max(self._ctx.peak_stored, self._stored)

    def _forward(self, action: Action, inputs: list[Tensor]) -> None:
        ctx, S, stage = self._ctx, self.topology.stages, action.stage
        recompute = ctx.train and stage in self.recompute
        for k, mb in enumerate(action.mbs):
            batch = ctx.micro_batches[mb]
            if self.versions is not None and ctx.train:
                self._signatures[mb] = batch_signature(batch)
            x = self.model.pipeline_input(batch) if stage == 0 else inputs[k]
            outputs = []
            for half in (0, 1) if mb in ctx.halved else (None,):
                part = batch if half is None else half_of(batch, half)
                inp = x if half is None else x.chunk(2)[half]
                key = (action.pipe, stage, mb, half)
                if recompute:  # keep the input and the RNG state only (GPipe re-materialization)
                    rng = RngState.capture(inp.device)
                    with torch.no_grad():
                        out = self._stage_forward(stage, inp, part)
                    _forget_autocast_casts()
                    kept = inp.numel() * inp.element_size() if stage > 0 else 0  # stage 0: the batch itself
                    self._keep(key, _Saved(inp, None, rng, kept))
                elif ctx.train:
                    if stage > 0:
                        inp = inp.detach().requires_grad_(True)
                    saved = SavedBytes(ctx.parameter_storages)
                    with saved.track():
                        out = self._stage_forward(stage, inp, part)
                    saved.add(out)
                    self._keep(key, _Saved(inp if stage > 0 else None, out, None, saved.nbytes))
                else:
                    out = self._stage_forward(stage, inp, part)
                if stage == S - 1:
                    ctx.losses.append(out.detach())
                else:
                    outputs.append(out)
            if stage < S - 1:
                sent = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
                self._produce(Message("act", action.pipe, stage, mb), sent)

    def _graph(self, action: Action, keep: bool) -> _Saved:
        """The saved graph of ``action``'s micro-batch (half) on its stage, re-materialised if it was
        recomputed; ``keep``: it stays saved (an ``I`` leaves it for its ``W``)."""
        key = (action.pipe, action.stage, action.mb, action.half)
        saved = self._graphs[key] if keep else self._graphs.pop(key)
        if not keep:
            self._stored -= saved.nbytes
        if saved.rng is not None and saved.out is None and saved.weight_grads is None:  # recompute, same RNG draws
            batch = self._ctx.micro_batches[action.mb]
            part = batch if action.half is None else half_of(batch, action.half)
            if action.stage > 0:
                saved.inp = saved.inp.detach().requires_grad_(True)
            with saved.rng.replay(), torch.enable_grad():
                saved.out = self._stage_forward(action.stage, saved.inp, part)
        return saved

    def _send_input_gradient(self, action: Action, grad: Tensor | None) -> None:
        if action.stage > 0:
            self._produce(Message("grad", action.pipe, action.stage, action.mb, action.half), grad)

    def _backward(self, action: Action, inputs: list[Tensor]) -> None:
        """``B``: input and weight gradients in one backward pass."""
        saved = self._graph(action, keep=False)
        if action.stage == self.topology.stages - 1:
            saved.out.backward()
        else:
            torch.autograd.backward(saved.out, inputs[0])
        self._send_input_gradient(action, saved.inp.grad if saved.inp is not None else None)
        self._signatures.pop(action.mb, None)  # the micro-batch is done on this stage

    def _input_gradient(self, action: Action, inputs: list[Tensor]) -> None:
        """``I`` (Zero Bubble Pipeline Parallelism §2): only the gradient of the stage's input, sent on at
        once; the intermediate gradients the weights need are kept for ``W``. The first stage has no
        input gradient: its ``I`` does nothing and its ``W`` runs the whole backward, as in
        torch.distributed.pipelining."""
        saved = self._graph(action, keep=True)
        saved.output_grad = None if action.stage == self.topology.stages - 1 else inputs[0]
        if action.stage == 0:
            return
        grads, saved.weight_grads = stage_backward_input(
            [saved.out], None if saved.output_grad is None else [saved.output_grad], [saved.inp],
            iter(self._stage_params[action.stage]),
        )
        saved.out = saved.output_grad = None  # stage_backward_input detached it: W starts from the kept groups
        self._send_input_gradient(action, grads[0])

    def _weight_gradient(self, action: Action, inputs: list[Tensor]) -> None:
        """``W``: the weight gradients from what ``I`` kept (accumulated into ``.grad``)."""
        saved = self._graph(action, keep=False)
        if action.stage == 0:
            torch.autograd.backward(saved.out, saved.output_grad)
        else:
            stage_backward_weight(iter(self._stage_params[action.stage]), saved.weight_grads)
        self._signatures.pop(action.mb, None)

    _BACKWARDS = {"B": _backward, "I": _input_gradient, "W": _weight_gradient}


def _unique_parameters(layers: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for layer in layers:
        for p in layer.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


def _forget_autocast_casts() -> None:
    """Drop autocast's cached weight casts after a no-grad forward: made without autograd history,
    a later forward with gradients would reuse them and its weights would get no gradient
    (pytorch/pytorch#112583 on older torch). Autocast clears the cache itself when its region ends."""
    if torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
        torch.clear_autocast_cache()


@dataclass
class _StepContext:
    schedule: Schedule
    micro_batches: Mapping[int, Batch]
    totals: Mapping[str, float | Tensor]
    halved: set[int]
    train: bool
    parameter_storages: frozenset[int]
    losses: list[Tensor] = field(default_factory=list)
    peak_stored: int = 0
