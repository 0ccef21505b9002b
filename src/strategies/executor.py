"""Executes one rank's actions of a schedule: forward/backward of local stages and p2p.

The schedule decides the order (:mod:`strategies.schedules`); this module owns the stage
buffers (inputs kept for backward, outputs or losses) and moves activations forward and
activation gradients backward through a :class:`~strategies.p2p.Messenger`.

Losses are normalised globally (see :func:`micro_batch_loss`), so summing every micro-batch's
loss over all ranks gives exactly the unsplit model's mini-batch loss, and summing gradients
gives exactly its gradients (mini-batch SGD, Chimera §2).

A doubled forward (Chimera §3.5) runs its two micro-batches as two graphs in one action; a
halved backward's forward runs two half-micro-batch graphs so each half backward is exact.

Communication overlap: the receives of the next ``prefetch`` actions are posted before the
current action runs, sends are non-blocking, and no host synchronisation (``.item()``) happens
inside the step. With recomputation (:mod:`strategies.recompute`, GPipe re-materialization) a
stage keeps only its input between forward and backward; the step record reports the peak bytes
kept.

Asynchronous schedules (:mod:`strategies.schedules.asynchronous`) run one *window* per step:
micro-batches are numbered globally, the graphs of micro-batches still in flight carry over to
the next step, forwards run on the step's stashed weight version (:class:`~strategies.versions.WeightVersions`),
and the receives of the next window whose messages this window sends are posted before the step
ends (gloo and NCCL complete a send only once its receive is posted).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .p2p import Messenger, PendingRecv
from .pipeline_model import Batch, PipelineModel, run_layers
from .recompute import RngState, SavedBytes, parameter_storages
from .schedules import Action, Schedule
from .schedules.asynchronous import crossing_receives
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
    input and the RNG state to replay it."""

    inp: Tensor | None
    out: Tensor | None
    rng: RngState | None
    nbytes: int


Receive = tuple[int, int, tuple]  # source rank, tag, shape key


class StageExecutor:
    """Runs this rank's actions on its local stages (one per pipeline for Chimera)."""

    def __init__(
        self,
        model: PipelineModel,
        stage_layers: Mapping[int, Sequence[nn.Module]],
        topology: Topology,
        rank: int,
        messenger: Messenger,
        recompute: frozenset[int] = frozenset(),
        prefetch: int = 2,
        versions: WeightVersions | None = None,
    ) -> None:
        self.model = model
        self.stage_layers = stage_layers
        self.topology = topology
        self.rank = rank
        self.messenger = messenger
        self.recompute = recompute
        self.prefetch = prefetch
        self.versions = versions
        self._graphs: dict[GraphKey, _Saved] = {}
        self._stored = 0
        self._signatures: dict[int, tuple] = {}  # micro-batches in flight across steps (asynchronous)
        self._preposted: dict[Action, list[PendingRecv]] = {}

    def run(
        self,
        schedule: Schedule,
        micro_batches: Sequence[Batch] | Mapping[int, Batch],
        totals: Mapping[str, float | Tensor],
        train: bool = True,
        after_backward: Callable[[Action], None] | None = None,
        next_window: Schedule | None = None,
    ) -> StepRecord:
        """Execute this rank's actions; ``after_backward(action)`` runs after each backward.

        ``micro_batches`` maps micro-batch indices to batches (a sequence: indices 0…N-1). A window
        of an asynchronous schedule passes ``next_window``, whose receives of messages sent in this
        window are posted before returning."""
        worker = self.topology.worker_of(self.rank)
        actions = [a for a in schedule.workers[worker] if train or a.kind == "F"]
        halved = {a.mb for acts in schedule.workers for a in acts if a.half is not None}
        params = [p for layers in self.stage_layers.values() for layer in layers for p in layer.parameters()]
        batches = dict(micro_batches) if isinstance(micro_batches, Mapping) else dict(enumerate(micro_batches))
        ctx = _StepContext(schedule, batches, totals, halved, train, parameter_storages(params))
        carried = train and "step" in schedule.meta  # an asynchronous window: graphs stay in flight
        self._ctx = ctx
        if train and not carried:
            self._stored = 0
        record = StepRecord(torch.zeros((), dtype=torch.float64), ActionClock(self.messenger.device))
        receives = [self._receives(a) for a in actions]
        posted: dict[int, list[PendingRecv]] = {}
        if carried:
            posted = {i: self._preposted.pop(a) for i, a in enumerate(actions) if a in self._preposted}
        with torch.set_grad_enabled(train):
            for i, action in enumerate(actions):
                for j in range(i, min(i + 1 + self.prefetch, len(actions))):
                    if j not in posted:
                        posted[j] = [self.messenger.post_recv(*r) for r in receives[j]]
                inbox = posted.pop(i)
                for pending in inbox:  # the box starts once its inputs arrived: waiting for a peer is a bubble
                    self.messenger.wait_recv(pending)
                start = record.clock.now()
                if action.kind == "F":
                    self._forward(action, inbox)
                else:
                    self._backward(action, inbox)
                    if after_backward is not None:
                        after_backward(action)
                record.clock.box(action, start)
        if carried and next_window is not None:
            for action in crossing_receives(schedule, next_window, worker):
                self._preposted[action] = [self.messenger.post_recv(*r) for r in self._receives(action)]
                for pending in self._preposted[action]:
                    self.messenger.post_data(pending)
        self.messenger.flush()
        if self._graphs and train and not carried:
            raise RuntimeError(f"rank {self.rank}: activations left after the step: {sorted(self._graphs)}")
        if ctx.losses:
            dtype = torch.float32 if ctx.losses[0].device.type == "mps" else torch.float64
            record.loss_sum = torch.stack([x.to(dtype) for x in ctx.losses]).sum()
        record.peak_stored_bytes = ctx.peak_stored
        return record

    # -- receives ------------------------------------------------------------------------------

    def _receives(self, action: Action) -> list[Receive]:
        """The messages ``action`` consumes, in the order it waits for them."""
        ctx, D = self._ctx, self.topology.stages
        if action.kind == "F":
            if action.stage == 0:
                return []
            src = self.topology.peer(self.rank, action.pipe, action.stage - 1)
            return [
                (src, ctx.tag("act", action.pipe, action.stage - 1, mb),
                 ("act", action.pipe, action.stage - 1, self._signature(mb)))
                for mb in action.mbs
            ]
        if action.stage == D - 1:
            return []
        src = self.topology.peer(self.rank, action.pipe, action.stage + 1)
        signature = (self._signature(action.mb), action.half)
        return [(src, ctx.tag("grad", action.pipe, action.stage + 1, action.mb, action.half),
                 ("grad", action.pipe, action.stage + 1, signature))]

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

    def _forward(self, action: Action, inbox: list[PendingRecv]) -> None:
        ctx, D, stage = self._ctx, self.topology.stages, action.stage
        recompute = ctx.train and stage in self.recompute
        for k, mb in enumerate(action.mbs):
            batch = ctx.micro_batches[mb]
            if self.versions is not None and ctx.train:
                self._signatures[mb] = batch_signature(batch)
            x = self.model.pipeline_input(batch) if stage == 0 else self.messenger.wait_recv(inbox[k])
            outputs = []
            for half in (0, 1) if mb in ctx.halved else (None,):
                part = batch if half is None else half_of(batch, half)
                inp = x if half is None else x.chunk(2)[half]
                key = (action.pipe, stage, mb, half)
                if recompute:  # keep the input and the RNG state only (GPipe re-materialization)
                    rng = RngState.capture(inp.device)
                    with torch.no_grad():
                        out = self._stage_forward(stage, inp, part)
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
                if stage == D - 1:
                    ctx.losses.append(out.detach())
                else:
                    outputs.append(out)
            if stage < D - 1:
                dst = self.topology.peer(self.rank, action.pipe, stage + 1)
                sent = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
                signature = batch_signature(batch)
                tag = ctx.tag("act", action.pipe, stage, mb)
                self.messenger.send(sent, dst, tag, ("act", action.pipe, stage, signature))

    def _backward(self, action: Action, inbox: list[PendingRecv]) -> None:
        ctx, D, stage = self._ctx, self.topology.stages, action.stage
        mb, half = action.mb, action.half
        saved = self._graphs.pop((action.pipe, stage, mb, half))
        self._stored -= saved.nbytes
        inp, out = saved.inp, saved.out
        if saved.rng is not None:  # recompute the forward with the same RNG draws, then backpropagate
            batch = ctx.micro_batches[mb]
            part = batch if half is None else half_of(batch, half)
            if stage > 0:
                inp = inp.detach().requires_grad_(True)
            with saved.rng.replay(), torch.enable_grad():
                out = self._stage_forward(stage, inp, part)
        if stage == D - 1:
            out.backward()
        else:
            torch.autograd.backward(out, self.messenger.wait_recv(inbox[0]))
        if stage > 0:
            dst = self.topology.peer(self.rank, action.pipe, stage - 1)
            signature = (self._signature(mb), half)
            tag = ctx.tag("grad", action.pipe, stage, mb, half)
            self.messenger.send(inp.grad, dst, tag, ("grad", action.pipe, stage, signature))
        self._signatures.pop(mb, None)  # the micro-batch is done on this stage


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

    def tag(self, kind: str, pipe: int, stage: int, mb: int, half: int | None = None) -> int:
        """A message id unique among the messages in flight for (kind, pipe, sending stage, micro-batch,
        half). Asynchronous windows keep at most N + D - 1 consecutive micro-batches in flight."""
        s = self.schedule
        span = s.micro_batches + s.stages
        code = (((0 if kind == "act" else 1) * s.pipelines + pipe) * s.stages + stage) * span + mb % span
        return code * 3 + (2 if half is None else half)
