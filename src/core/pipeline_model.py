"""How a model offers itself to the pipeline runtime: an ordered list of layers plus a loss.

The runtime splits ``pipeline_layers()`` into D contiguous stages. Every rank of a replica reads
the same micro-batch, so stage 0 builds its input from the batch (``pipeline_input``), the last
stage computes ``pipeline_loss`` against the batch's labels, and only one activation tensor
travels between stages. A layer that also needs the micro-batch (attention masks, say) sets
``needs_batch = True`` and is called as ``layer(x, batch)``; other layers as ``layer(x)``.

Parameters that are one tensor shared by several layers (tied word embeddings) are listed by
``tied_parameters()`` as groups of (layer index, parameter name); the runtime sums their
gradients across the stages that hold them, so training equals the unsplit model.

Per-stage construction: a model may be built on the meta device (no memory) and define
``materialize(layers, device)``, which gives only the listed layers real, initialised tensors on
``device`` (:meth:`pipeline_recipes.models.base.HFPipelineModel.materialize`); the runtime calls it for the rank's
own layers, so no rank ever holds the whole model.

Exact mini-batch losses: a model whose loss is a mean over items that differ per micro-batch
(tokens, masked tokens) may define ``loss_counts(batch) -> {term: count}`` and
``loss_terms(output, batch) -> {term: sum}``; the runtime divides each term's sum by its count
over the whole mini-batch, so micro-batch losses add up exactly to the unsplit loss (GPT-2:
``tokens``; BERT: ``mlm`` and ``nsp``). Counts must add up over samples (a batch's count is the sum
of its parts'): the runtime counts a replica's whole mini-batch at once. Without them, losses are
weighted by sample count.

Example, a user's own model in ten lines::

    class MyMLP(nn.Module, PipelineModel):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)])
        def pipeline_layers(self): return self.layers
        def pipeline_input(self, batch): return batch["x"]
        def pipeline_loss(self, output, batch): return F.mse_loss(output, batch["y"])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

Batch = Mapping[str, Any]
# The label of a position no loss is computed for (PyTorch's ``cross_entropy`` default, HF's convention).
IGNORE_INDEX = -100
TiedGroup = tuple[tuple[int, str], ...]


class PipelineModel:
    """Mixin for an ``nn.Module`` that can be pipelined (see the module docstring)."""

    def pipeline_layers(self) -> Sequence[nn.Module]:
        raise NotImplementedError

    def pipeline_input(self, batch: Batch) -> Tensor:
        """What the first layer consumes; by default ``batch["input_ids"]``."""
        return batch["input_ids"]

    def pipeline_loss(self, output: Any, batch: Batch) -> Tensor:
        """Mean loss of one micro-batch from the last layer's output (a tensor, or a tuple of them)."""
        raise NotImplementedError

    def tied_parameters(self) -> list[TiedGroup]:
        return []


def materialize_local(model: PipelineModel, layers: Iterable[int], device: torch.device) -> None:
    """Materialise ``layers`` of a model built on the meta device on ``device`` (nothing to do for a
    model with real tensors); raise a clear error for a meta model that cannot materialise itself."""
    indices = sorted(set(layers))
    modules = model.pipeline_layers()
    if not any(t.is_meta for i in indices for t in (*modules[i].parameters(), *modules[i].buffers())):
        return
    materialize = getattr(model, "materialize", None)
    if not callable(materialize):
        raise TypeError(f"{type(model).__name__} was built on the meta device but has no "
                        "materialize(layers, device): build it on a real device, or define materialize")
    materialize(indices, device)


def call_layer(layer: nn.Module, x: Tensor, batch: Batch) -> Tensor:
    """Apply one pipeline layer, passing the micro-batch to layers that ask for it."""
    return layer(x, batch) if getattr(layer, "needs_batch", False) else layer(x)


def run_layers(layers: Sequence[nn.Module], x: Tensor, batch: Batch) -> Tensor:
    for layer in layers:
        x = call_layer(layer, x, batch)
    return x


def sequential_loss(model: PipelineModel, batch: Batch) -> Tensor:
    """The unsplit reference: all layers in one process, then the loss."""
    return model.pipeline_loss(run_layers(model.pipeline_layers(), model.pipeline_input(batch), batch), batch)


def split_batch(batch: Batch, parts: int) -> list[dict[str, Any]]:
    """Split every tensor of ``batch`` along dim 0 into ``parts`` equal micro-batches."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor)}
    if len(sizes) != 1:
        raise ValueError(f"all batch tensors must share their first dimension, got sizes {sorted(sizes)}")
    (size,) = sizes
    if size % parts:
        raise ValueError(f"a batch of {size} samples cannot be split into {parts} equal micro-batches")
    chunks = {k: v.chunk(parts) if isinstance(v, torch.Tensor) else [v] * parts for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]


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
