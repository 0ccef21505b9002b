"""A tiny pipelinable MLP for runtime tests (optionally with tied first/last weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline_recipes.core.pipeline_model import PipelineModel


class ToyMLP(nn.Module, PipelineModel):
    def __init__(self, layers: int = 8, width: int = 8, tied: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks.append(nn.Sequential(nn.Linear(width, width), nn.Tanh()))
        self.layers = nn.ModuleList(blocks)
        self.tied = tied
        if tied:  # share the first and last linear weight, like tied word embeddings
            self.layers[-1][0].weight = self.layers[0][0].weight

    def pipeline_layers(self) -> nn.ModuleList:
        return self.layers

    def pipeline_input(self, batch):
        return batch["x"]

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch["y"])

    def tied_parameters(self):
        return [((0, "0.weight"), (len(self.layers) - 1, "0.weight"))] if self.tied else []


def toy_batches(steps: int, samples: int, width: int = 8, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(samples, width, generator=g), "y": torch.randn(samples, width, generator=g)}
            for _ in range(steps)]


def train_sgd(model: nn.Module, loss_fn, batches, lr: float, momentum: float = 0.9,
              trained: nn.Module | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process mini-batch SGD (the reference every pipeline run must equal): the losses
    per step and the parameters after the last one, named as in ``model`` (``trained``'s parameters
    are the ones optimised, default ``model``; they may be shared views such as an HF reference)."""
    opt = torch.optim.SGD((trained or model).parameters(), lr=lr, momentum=momentum)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
