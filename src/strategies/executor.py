"""Executes one rank's actions of a schedule: forward/backward of local stages and p2p.

The schedule decides the order (:mod:`strategies.schedules`); this module owns the stage
buffers (inputs kept for backward, outputs or losses) and moves activations forward and
activation gradients backward through a :class:`~strategies.p2p.Messenger`.

Losses are normalised globally (see :func:`micro_batch_loss`), so summing every micro-batch's
loss over all ranks gives exactly the unsplit model's mini-batch loss, and summing gradients
gives exactly its gradients (mini-batch SGD, Chimera §2).

A doubled forward (Chimera §3.5) runs its two micro-batches as two graphs in one action; a
halved backward's forward runs two half-micro-batch graphs so each half backward is exact.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .p2p import Messenger
from .pipeline_model import Batch, PipelineModel, run_layers
from .schedules import Action, Schedule
from .topology import Topology

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


def micro_batch_loss(model: PipelineModel, output: Tensor, batch: Batch, totals: Mapping[str, float]) -> Tensor:
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
    """What one step on this rank measured: per-action wall times and the local loss sum."""

    loss_sum: Tensor
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)


class StageExecutor:
    """Runs this rank's actions on its local stages (one per pipeline for Chimera)."""

    def __init__(
        self,
        model: PipelineModel,
        stage_layers: Mapping[int, Sequence[nn.Module]],
        topology: Topology,
        rank: int,
        messenger: Messenger,
    ) -> None:
        self.model = model
        self.stage_layers = stage_layers
        self.topology = topology
        self.rank = rank
        self.messenger = messenger
        self._graphs: dict[GraphKey, tuple[Tensor | None, Tensor]] = {}

    def run(
        self, schedule: Schedule, micro_batches: Sequence[Batch], totals: Mapping[str, float], train: bool = True
    ) -> StepRecord:
        worker = self.topology.worker_of(self.rank)
        actions = [a for a in schedule.workers[worker] if train or a.kind == "F"]
        halved = {a.mb for acts in schedule.workers for a in acts if a.half is not None}
        record = StepRecord(torch.zeros((), dtype=torch.float64))
        self._ctx = _StepContext(schedule, micro_batches, totals, halved, train, record)
        with torch.set_grad_enabled(train):
            for action in actions:
                start = time.perf_counter()
                (self._forward if action.kind == "F" else self._backward)(action)
                record.timeline.append((action, start, time.perf_counter()))
        self.messenger.flush()
        if self._graphs:
            raise RuntimeError(f"rank {self.rank}: activations left after the step: {sorted(self._graphs)}")
        return record

    # -- actions -------------------------------------------------------------------------------

    def _forward(self, action: Action) -> None:
        ctx, D = self._ctx, self.topology.stages
        for mb in action.mbs:
            batch = ctx.micro_batches[mb]
            signature = batch_signature(batch)
            if action.stage == 0:
                x = self.model.pipeline_input(batch)
            else:
                src = self.topology.peer(self.rank, action.pipe, action.stage - 1)
                x = self.messenger.recv(src, ctx.tag("act", action.pipe, action.stage - 1, mb), ("act", action.pipe, action.stage - 1, signature))
            halves = (0, 1) if mb in ctx.halved else (None,)
            outputs = []
            for half in halves:
                part = batch if half is None else half_of(batch, half)
                inp = x if half is None else x.chunk(2)[half]
                if action.stage > 0 and ctx.train:
                    inp = inp.detach().requires_grad_(True)
                out = run_layers(self.stage_layers[action.stage], inp, part)
                if action.stage == D - 1:
                    out = micro_batch_loss(self.model, out, part, ctx.totals)
                    ctx.record.loss_sum += out.detach().to(torch.float64).cpu()
                else:
                    outputs.append(out)
                if ctx.train:
                    self._graphs[(action.pipe, action.stage, mb, half)] = (inp if action.stage > 0 else None, out)
            if action.stage < D - 1:
                dst = self.topology.peer(self.rank, action.pipe, action.stage + 1)
                sent = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
                self.messenger.send(sent, dst, ctx.tag("act", action.pipe, action.stage, mb), ("act", action.pipe, action.stage, signature))

    def _backward(self, action: Action) -> None:
        ctx, D = self._ctx, self.topology.stages
        mb, half = action.mb, action.half
        inp, out = self._graphs.pop((action.pipe, action.stage, mb, half))
        signature = (batch_signature(ctx.micro_batches[mb]), half)
        if action.stage == D - 1:
            out.backward()
        else:
            src = self.topology.peer(self.rank, action.pipe, action.stage + 1)
            grad = self.messenger.recv(src, ctx.tag("grad", action.pipe, action.stage + 1, mb, half), ("grad", action.pipe, action.stage + 1, signature))
            torch.autograd.backward(out, grad)
        if action.stage > 0:
            dst = self.topology.peer(self.rank, action.pipe, action.stage - 1)
            self.messenger.send(inp.grad, dst, ctx.tag("grad", action.pipe, action.stage, mb, half), ("grad", action.pipe, action.stage, signature))


@dataclass
class _StepContext:
    schedule: Schedule
    micro_batches: Sequence[Batch]
    totals: Mapping[str, float]
    halved: set[int]
    train: bool
    record: StepRecord

    def tag(self, kind: str, pipe: int, stage: int, mb: int, half: int | None = None) -> int:
        """A message id unique within the step for (kind, pipe, sending stage, micro-batch, half)."""
        s = self.schedule
        code = (((0 if kind == "act" else 1) * s.pipelines + pipe) * s.stages + stage) * s.micro_batches + mb
        return code * 3 + (2 if half is None else half)
