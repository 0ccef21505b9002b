"""A decoder family whose forward is not Llama's, added as the registry says: this adapter plus one entry.

Gemma 2 (Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024, §2) caps its final logits
softly, ``cap · tanh(logits / cap)``, after the LM head; everything before (scaled embeddings, the alternating
sliding and full attention layers with their own logit capping, the final norm) happens inside the modules the
Llama-style adapter already runs. So its adapter is a :class:`~pipeline_recipes.models.decoder.DecoderPipelineModel`
whose head caps the logits, built by :func:`~pipeline_recipes.models.decoder.build_decoder_as`. The tests register
:data:`ENTRY` under ``gemma2`` (its ``transformers`` ``model_type``) for the test's length only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from pipeline_recipes.models.decoder import DecoderHead, DecoderPipelineModel, build_decoder_as
from pipeline_recipes.models.families import ModelFamily

ENTRY = ModelFamily("toy_family.build_gemma2", "Gemma2Config", "Gemma2ForCausalLM")
"""The family's registry entry: this module's builder, Gemma 2's classes, the registry's default keys and data."""


class SoftCappedHead(DecoderHead):
    """``cap · tanh(lm_head(norm(hidden)) / cap)``: the whole logits (no chunked loss, which would project without
    the cap)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, cap: float) -> None:
        super().__init__(norm, lm_head, None)
        self.cap = float(cap)

    @override
    def forward(self, hidden: Tensor) -> Tensor:
        return self.cap * torch.tanh(super().forward(hidden) / self.cap)


class Gemma2PipelineModel(DecoderPipelineModel):
    """Gemma 2 as pipeline layers: the decoder adapter's, with the soft-capping head."""

    def __init__(self, hf: nn.Module, **kwargs: Any) -> None:
        if kwargs.get("loss_chunk_tokens") is not None:
            raise ValueError("gemma2 caps its logits: model.loss_chunk_tokens must be null (the whole logits)")
        super().__init__(hf, **kwargs)
        self.layers[-1] = SoftCappedHead(hf.model.norm, hf.lm_head, hf.config.final_logit_softcapping)


def build_gemma2(name: str = "gemma2", seq_len: int = 2048, *, family: str = "gemma2", **kwargs: Any
                 ) -> DecoderPipelineModel:
    """The family's builder (the ``_target_`` of its yaml): ``Gemma2Config(**config)`` -> :class:`Gemma2PipelineModel`,
    with :func:`~pipeline_recipes.models.decoder.build_decoder`'s settings."""
    return build_decoder_as(Gemma2PipelineModel, name, seq_len, family=family, **kwargs)
