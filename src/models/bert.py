"""BERT pre-training (Devlin et al., 2019) as a pipeline around ``transformers.BertForPreTraining``.

Layers: ``[embeddings, encoder_layer_0 .. encoder_layer_{L-1}, heads (pooler + MLM + NSP)]``.
The embeddings read ``batch["token_type_ids"]`` and the encoder layers get the padding mask of
``batch["attention_mask"]`` from ``transformers.masking_utils.create_bidirectional_mask`` (additive
float mask under ``eager``, boolean or none under ``sdpa``), as ``BertModel.forward`` builds it: once
per stage forward, shared by the stage's layers (:class:`~pipeline_recipes.models.masks.MaskCache`); both set
``needs_batch = True``. The heads layer returns ``(mlm_logits, nsp_logits)``.

The loss is HF's pre-training loss: MLM cross entropy over labels != -100 plus NSP cross entropy
(the NSP term is skipped when the batch has no ``next_sentence_label``). With ``loss_chunk_tokens`` set
(the default) the heads layer returns the MLM head's transformed hidden states (dense, GELU, LayerNorm)
in place of the MLM logits, and the loss applies the vocabulary decoder a chunk of tokens at a time
(:func:`.lm_loss.linear_cross_entropy`).

With ``tie_word_embeddings=False`` transformers 5 keeps a second, unused vocabulary bias
``cls.predictions.bias`` beside ``cls.predictions.decoder.bias``; it is re-aliased to the decoder
bias so the model has one output bias as in the paper and no parameter without a gradient (the
Chimera paper's 48-layer BERT then has exactly 669,790,012 parameters).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig, BertForPreTraining
from transformers.masking_utils import create_bidirectional_mask

from pipeline_recipes.core.pipeline_model import IGNORE_INDEX, Batch, TiedGroup

from .base import HFPipelineModel, build_on_meta, finish_build, make_hf_config
from .lm_loss import DEFAULT_CHUNK_TOKENS, check_chunk_tokens, linear_cross_entropy
from .masks import MaskCache

class BertEmbeddingLayer(nn.Module):
    """``input_ids -> BertEmbeddings(input_ids, token_type_ids)`` (word + position + type, LayerNorm, dropout)."""

    needs_batch = True

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: Tensor, batch: Batch) -> Tensor:
        return self.embeddings(input_ids=input_ids, token_type_ids=batch.get("token_type_ids"))


class BertEncoderLayer(nn.Module):
    """One ``BertLayer`` with the padding mask HF would build from ``batch["attention_mask"]``; the layers
    of one model share ``masks``, so a stage builds the mask once per forward."""

    needs_batch = True

    def __init__(self, layer: nn.Module, masks: MaskCache | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.masks = MaskCache() if masks is None else masks

    def forward(self, hidden: Tensor, batch: Batch) -> Tensor:
        mask = self.masks.get(create_bidirectional_mask, self.layer.attention.self.config, hidden,
                              batch.get("attention_mask"))
        return self.layer(hidden, mask)


class BertHeads(nn.Module):
    """``hidden -> (mlm_logits [B, S, V], nsp_logits [B, 2])``: pooler, MLM head and NSP head; with
    ``chunk_tokens`` the MLM part is the transformed hidden states ``[B, S, H]``, which
    :meth:`token_losses` decodes a chunk of tokens at a time."""

    def __init__(self, pooler: nn.Module, cls: nn.Module, chunk_tokens: int | None = None) -> None:
        super().__init__()
        self.pooler, self.cls = pooler, cls
        self.chunk_tokens = chunk_tokens

    def forward(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        if self.chunk_tokens is None:
            return self.cls(hidden, self.pooler(hidden))
        return self.cls.predictions.transform(hidden), self.cls.seq_relationship(self.pooler(hidden))

    def logits(self, mlm_output: Tensor) -> Tensor:
        """The MLM logits of this layer's MLM output."""
        return self.cls.predictions.decoder(mlm_output) if self.chunk_tokens is not None else mlm_output

    def token_losses(self, mlm_output: Tensor, labels: Tensor) -> Tensor:
        """Per-token MLM cross entropy (fp32, 0 where ``labels`` is -100) of the chunked MLM output."""
        decoder = self.cls.predictions.decoder
        return linear_cross_entropy(mlm_output, decoder.weight, decoder.bias, labels, self.chunk_tokens)

    def extra_repr(self) -> str:
        return f"chunk_tokens={self.chunk_tokens}"


def pretraining_terms(mlm_logits: Tensor, nsp_logits: Tensor, labels: Tensor, next_sentence_label: Tensor | None,
                      reduction: str = "mean") -> dict[str, Tensor]:
    """``BertForPreTraining``'s loss terms: CE(MLM, ignore -100) and CE(NSP), means or sums."""
    terms = {"mlm": F.cross_entropy(mlm_logits.reshape(-1, mlm_logits.shape[-1]), labels.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction=reduction)}
    if next_sentence_label is not None:
        terms["nsp"] = F.cross_entropy(nsp_logits.reshape(-1, 2), next_sentence_label.reshape(-1), reduction=reduction)
    return terms


def pretraining_loss(mlm_logits: Tensor, nsp_logits: Tensor, labels: Tensor,
                     next_sentence_label: Tensor | None) -> Tensor:
    """``BertForPreTraining``'s loss: CE(MLM, ignore -100) + CE(NSP)."""
    terms = pretraining_terms(mlm_logits, nsp_logits, labels, next_sentence_label)
    return terms["mlm"] + terms["nsp"] if "nsp" in terms else terms["mlm"]


def dedupe_decoder_bias(hf: BertForPreTraining) -> None:
    """Make ``cls.predictions.bias`` the decoder's bias (one output bias, as in the paper)."""
    pred = hf.cls.predictions
    if pred.bias is not pred.decoder.bias:
        pred.bias = pred.decoder.bias


class BertPipelineModel(HFPipelineModel):
    """BERT pre-training split into ``num_hidden_layers + 2`` layers sharing parameters with ``reference()``.

    ``pipeline_loss`` takes the heads layer's ``(mlm_logits, nsp_logits)`` tuple.
    """

    family = "bert"

    def __init__(self, hf: BertForPreTraining, *, loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
                 **kwargs: Any) -> None:
        super().__init__(hf, **kwargs)
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)
        if hf.bert.pooler is None:
            raise ValueError("BERT pre-training needs the pooler (NSP head)")
        dedupe_decoder_bias(hf)
        self.layers.append(BertEmbeddingLayer(hf.bert.embeddings))
        masks = MaskCache()
        self.layers.extend(BertEncoderLayer(layer, masks) for layer in hf.bert.encoder.layer)
        self.layers.append(BertHeads(hf.bert.pooler, hf.cls, self.loss_chunk_tokens))
        self.layer_names_ = ["embeddings", *(f"layer.{i}" for i in range(len(hf.bert.encoder.layer))), "heads"]
        self.check_seq_len(self.seq_len)

    def pipeline_input(self, batch: Batch) -> Tensor:
        return batch["input_ids"]

    def logits(self, output: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """``(mlm_logits, nsp_logits)`` of the heads layer's ``output``."""
        return self.layers[-1].logits(output[0]), output[1]

    def pipeline_loss(self, output: tuple[Tensor, Tensor], batch: Batch) -> Tensor:  # type: ignore[override]
        if self.loss_chunk_tokens is None:
            mlm_logits, nsp_logits = output
            return pretraining_loss(mlm_logits, nsp_logits, batch["labels"], batch.get("next_sentence_label"))
        terms = self.loss_terms(output, batch)
        counts = self.loss_counts(batch)
        return sum(value / counts[name] for name, value in terms.items())

    # Optional runtime hooks: per-term sums and counts (MLM over masked tokens, NSP over samples), so that
    # micro-batches add up to the loss of the whole mini-batch.
    def loss_counts(self, batch: Batch) -> dict[str, Tensor]:
        counts = {"mlm": (batch["labels"] != IGNORE_INDEX).sum()}
        if batch.get("next_sentence_label") is not None:
            nsp = batch["next_sentence_label"]
            counts["nsp"] = torch.tensor(nsp.numel(), device=nsp.device)  # same device as the MLM count
        return counts

    def loss_terms(self, output: tuple[Tensor, Tensor], batch: Batch) -> dict[str, Tensor]:
        mlm, nsp_logits = output
        if self.loss_chunk_tokens is None:
            return pretraining_terms(mlm, nsp_logits, batch["labels"], batch.get("next_sentence_label"), "sum")
        terms = {"mlm": self.layers[-1].token_losses(mlm, batch["labels"]).sum()}
        if batch.get("next_sentence_label") is not None:
            label = batch["next_sentence_label"]
            terms["nsp"] = F.cross_entropy(nsp_logits.reshape(-1, 2), label.reshape(-1), reduction="sum")
        return terms

    def tied_parameters(self) -> list[TiedGroup]:
        emb = self.layers[0].embeddings.word_embeddings.weight
        if emb is self.layers[-1].cls.predictions.decoder.weight:
            last = len(self.layers) - 1
            return [((0, "embeddings.word_embeddings.weight"), (last, "cls.predictions.decoder.weight"))]
        return []


def build_bert(
    name: str = "bert",
    seq_len: int = 128,
    *,
    family: str = "bert",
    attn_implementation: str = "sdpa",
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
    init_seed: int | None = None,
    device: str | torch.device | None = None,
    loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    **config: Any,
) -> BertPipelineModel:
    """Hydra target of ``conf/model/bert*.yaml``: ``BertConfig(**config)`` -> ``BertPipelineModel``.

    ``config`` holds ``BertConfig`` fields (``num_hidden_layers``, ``hidden_size``, ...); ``device`` and
    ``init_seed`` as in :func:`~pipeline_recipes.models.gpt2.build_gpt2`; ``loss_chunk_tokens``: tokens whose
    MLM logits the loss computes at a time (``None``: the heads layer returns the whole MLM logits).
    """
    if family != "bert":
        raise ValueError(f"build_bert got family={family!r}")
    config.pop("compile", None)  # model.compile: the trainer compiles the blocks (pipeline_recipes.strategies.compute.compile)
    hf_config = make_hf_config(BertConfig, {**config, "attn_implementation": attn_implementation})
    hf, seed = build_on_meta(BertForPreTraining, hf_config, init_seed)
    model = BertPipelineModel(hf, name=name, seq_len=seq_len, embedding_cost=embedding_cost, head_cost=head_cost,
                              init_seed=seed, loss_chunk_tokens=loss_chunk_tokens)
    return finish_build(model, device)
