"""The causal-LM loss path shared by GPT-2 (:mod:`.gpt2`) and the decoder-only families (:mod:`.decoder`).

Language modelling as in "Language Models are Unsupervised Multitask Learners" (Radford et al., 2019,
§2): position ``t`` predicts token ``t+1``, the loss is the cross entropy averaged over the predicted
tokens that are not ``IGNORE_INDEX``, i.e. ``transformers.loss.loss_utils.ForCausalLMLoss``. The labels
are ``batch["labels"]``, else the inputs.

With ``loss_chunk_tokens`` set the head layer (a :class:`~.lm_loss.ChunkedLMHead`) returns the
normalised hidden states and the loss projects them onto the vocabulary a chunk of tokens at a time
(:func:`~.lm_loss.linear_cross_entropy`); with ``None`` the head returns the logits, as the HF model does.
Micro-batch losses are given as per-term sums and counts (``loss_terms``/``loss_counts``, term
``tokens``), so micro-batches of any size add up to the token mean of the mini-batch (what HF computes on
the unsplit batch).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from pipeline_recipes.core.pipeline_model import IGNORE_INDEX, Batch, TiedGroup

from .base import HFPipelineModel
from .lm_loss import ChunkedLMHead


def shift_labels(labels: Tensor) -> Tensor:
    """Position t predicts token t+1; the last position predicts nothing (``IGNORE_INDEX``)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross entropy ignoring ``IGNORE_INDEX`` (``ForCausalLMLoss`` without ``num_items``): the
    mean over predicted tokens, or their sum with ``reduction="sum"``."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                           shift_labels(labels).reshape(-1).to(logits.device), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


class CausalLMPipelineModel(HFPipelineModel):
    """A causal LM whose pipeline layers are ``[embeddings, blocks..., head]``: the first layer embeds
    ``batch["input_ids"]`` (its word embedding held as ``embedding_name``), the last is a
    :class:`~.lm_loss.ChunkedLMHead` of ``loss_chunk_tokens`` (see the module docstring)."""

    embedding_name = "embed_tokens"  # the first layer's word embedding (tied to ``lm_head`` when shared)
    loss_chunk_tokens: int | None

    def head(self) -> ChunkedLMHead:
        """The last pipeline layer."""
        return self.layers[-1]

    @staticmethod
    def _labels(batch: Batch) -> Tensor:
        return batch["labels"] if "labels" in batch else batch["input_ids"]

    def logits(self, output: Tensor) -> Tensor:
        """The logits over the vocabulary of the head layer's ``output``."""
        return self.head().logits(output)

    @override
    def pipeline_loss(self, output: Tensor, batch: Batch) -> Tensor:
        if self.loss_chunk_tokens is None:
            return causal_lm_loss(output, self._labels(batch))
        targets = shift_labels(self._labels(batch))
        return self.head().token_losses(output, targets).sum() / (targets != IGNORE_INDEX).sum()

    def loss_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {"tokens": (shift_labels(self._labels(batch)) != IGNORE_INDEX).sum()}

    def loss_terms(self, output: Tensor, batch: Batch) -> dict[str, Tensor]:
        if self.loss_chunk_tokens is None:
            return {"tokens": causal_lm_loss(output, self._labels(batch), reduction="sum")}
        return {"tokens": self.head().token_losses(output, shift_labels(self._labels(batch))).sum()}

    @override
    def tied_parameters(self) -> list[TiedGroup]:
        name = f"{self.embedding_name}.weight"
        if getattr(self.layers[0], self.embedding_name).weight is self.head().lm_head.weight:
            return [((0, name), (len(self.layers) - 1, "lm_head.weight"))]
        return []
