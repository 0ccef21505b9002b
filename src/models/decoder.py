"""Decoder-only language models from ``transformers`` (Llama and the families of the same layout) as pipelines.

Llama (Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", 2023, §2.2) and its
descendants share one layout in ``transformers``: ``<Family>ForCausalLM.model`` holds ``embed_tokens``,
``layers`` (decoder layers), ``norm`` (RMSNorm) and ``rotary_emb`` (rotary position embeddings, Su et
al., "RoFormer", §3.4), and ``lm_head`` projects to the vocabulary. The pipeline layers are
``[embeddings, decoder_0 .. decoder_{L-1}, head (norm + lm_head)]``.

Every decoder layer is given what ``<Family>Model.forward`` gives it, rebuilt locally because only one
activation tensor travels between stages:

* ``position_embeddings = rotary_emb(hidden, position_ids)`` (the ``(cos, sin)`` pair; position ids
  ``0..T-1``). The rotary module (buffers only) is shared by the decoder layers, so every stage holds
  its own copy;
* the causal mask of that layer's kind, from ``transformers.masking_utils`` for the configured
  attention implementation: ``create_causal_mask`` for full attention and
  ``create_sliding_window_causal_mask`` for sliding-window layers (Mistral's ``sliding_window``,
  Qwen's ``layer_types``), with the batch's 2-D ``attention_mask`` when it has one (padding). A bare
  decoder layer given no mask attends to the future under ``eager`` (no ``is_causal`` there);
  under ``sdpa`` the mask builder returns ``None`` and the kernel's ``is_causal`` applies, as in HF.
  Each kind's mask, and the rotary pair, is built once per stage forward and shared by the stage's
  layers (:class:`~pipeline_recipes.models.masks.MaskCache`), as ``<Family>Model.forward`` builds one per kind.

The loss is the causal-LM cross entropy shared with GPT-2's pipeline (:mod:`~pipeline_recipes.models.causal_lm`,
``transformers.loss.loss_utils.ForCausalLMLoss``); as there, with ``loss_chunk_tokens`` set (the default)
the head layer returns the normalised hidden states and the loss projects them onto the vocabulary a
chunk of tokens at a time (:func:`.lm_loss.linear_cross_entropy`). Tied word embeddings (the small Llama 3.2 and
Qwen2 models) make the embedding layer and the head share one ``Parameter``, listed by
``tied_parameters`` so the runtime sums the two stages' gradients.

Only the families whose ``<Family>Model.forward`` is exactly the above are accepted (the decoder entries of
:data:`~pipeline_recipes.models.families.FAMILIES`);
others (Gemma scales its embeddings, Gemma 2 soft-caps logits, ...) would train a different model here. Such a
family is an adapter of its own, a :class:`DecoderPipelineModel` whose layers do what its forward does, built by
:func:`build_decoder_as`, and its registry entry naming that adapter's builder.

``pretrained=<hub name or local directory>`` takes the architecture from the checkpoint's
``config.json`` and, in :meth:`DecoderPipelineModel.materialize`, reads from its safetensors only the
tensors of the layers being materialised (:mod:`~pipeline_recipes.models.pretrained`): each pipeline rank loads its own
layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from typing_extensions import override

from pipeline_recipes.core.pipeline_model import Batch

from .base import build_on_meta, finish_build, make_hf_config
from .causal_lm import CausalLMPipelineModel
from .families import decoder_families, model_family
from .lm_loss import DEFAULT_CHUNK_TOKENS, ChunkedLMHead, check_chunk_tokens
from .masks import MaskCache
from .pretrained import checkpoint_config, load_layers

MASK_KINDS = ("full_attention", "sliding_attention")


def _positions(x: Tensor) -> Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's attention kind, as ``<Family>Model.forward`` picks its mask: the config's
    ``layer_types`` (Qwen2/Qwen3), else sliding everywhere when ``sliding_window`` is set (Mistral)."""
    n = int(config.num_hidden_layers)
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        kinds = ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"] * n
    kinds = list(kinds)[:n]
    bad = sorted(set(kinds) - set(MASK_KINDS))
    if bad:
        raise ValueError(f"unsupported attention layer types {bad} in {type(config).__name__}.layer_types; "
                         f"this adapter builds masks for {MASK_KINDS}")
    return kinds


class DecoderEmbeddings(nn.Module):
    """``input_ids -> embed_tokens(input_ids)``."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    @override
    def forward(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)


class DecoderLayer(nn.Module):
    """One HF decoder layer with the rotary embeddings and causal mask its model would pass it; the
    layers of one model share ``masks``, so a stage builds each kind's mask once per forward."""

    needs_batch = True  # the padding mask, when the batch has one

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, kind: str, masks: MaskCache | None = None) -> None:
        super().__init__()
        self.layer, self.rotary_emb, self.kind = layer, rotary_emb, kind
        self.masks = MaskCache() if masks is None else masks
        self._mask_fn = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask

    @override
    def forward(self, hidden: Tensor, batch: Batch) -> Tensor:
        position_ids = _positions(hidden)
        # The attention module's own config decides the kernel, hence the mask format.
        mask = self.masks.get(self._mask_fn, self.layer.self_attn.config, hidden, batch.get("attention_mask"),
                              position_ids)
        cos_sin = self.masks.rotary(self.rotary_emb, hidden, position_ids)
        return self.layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)

    @override
    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"


class DecoderHead(ChunkedLMHead):
    """``lm_head(norm(hidden))`` (:class:`~pipeline_recipes.models.lm_loss.ChunkedLMHead`)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, chunk_tokens: int | None = None) -> None:
        super().__init__("norm", norm, lm_head, chunk_tokens)


class DecoderPipelineModel(CausalLMPipelineModel):
    """A Llama-style causal LM split into ``num_hidden_layers + 2`` layers sharing parameters with
    ``reference()`` (see the module docstring)."""

    def __init__(self, hf: nn.Module, *, pretrained: str | None = None,
                 loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, **kwargs: Any) -> None:
        super().__init__(hf, **kwargs)
        self.family = str(hf.config.model_type)
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)
        self.pretrained = pretrained
        base = hf.model
        kinds = layer_kinds(hf.config)
        self.layers.append(DecoderEmbeddings(base.embed_tokens))
        masks = MaskCache()
        self.layers.extend(DecoderLayer(layer, base.rotary_emb, kinds[i], masks) for i, layer in enumerate(base.layers))
        self.layers.append(DecoderHead(base.norm, hf.lm_head, self.loss_chunk_tokens))
        self.layer_names_ = ["embeddings", *(f"layer.{i}" for i in range(len(base.layers))), "head"]
        self.check_seq_len(self.seq_len)

    @override
    def materialize(self, layers: Iterable[int] | None, device: str | torch.device) -> None:
        """As :meth:`~pipeline_recipes.models.base.HFPipelineModel.materialize`; with ``pretrained`` the layers'
        tensors are then read from the checkpoint (only those of ``layers``)."""
        indices = range(len(self.layers)) if layers is None else sorted(set(layers))
        super().materialize(indices, device)
        if self.pretrained:
            load_layers(self, indices, self.pretrained)


def plain(value: Any) -> Any:
    """A Hydra ``DictConfig``/``ListConfig`` field (``rope_parameters``, ``layer_types``) as a dict/list:
    ``transformers`` configs validate their types strictly."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover
        return value
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def family_classes(family: str) -> tuple[type, type]:
    """The ``transformers`` config and causal-LM classes of a family whose forward is Llama's."""
    if family not in decoder_families():
        raise ValueError(f"model family {family!r} is not supported by the decoder adapter; supported: "
                         f"{', '.join(decoder_families())} (their HF forward is embeddings -> decoder layers with "
                         "rotary embeddings -> RMSNorm -> lm_head, which the pipeline layers reproduce)")
    return model_family(family).classes()


def build_decoder(
    name: str = "llama",
    seq_len: int = 2048,
    *,
    family: str = "llama",
    **settings: Any,
) -> DecoderPipelineModel:
    """Hydra target of ``conf/model/{llama,qwen2}*.yaml``: ``<Family>Config(**config)`` ->
    ``DecoderPipelineModel``.

    ``family``: a decoder family of :data:`~pipeline_recipes.models.families.FAMILIES` (the HF ``model_type``);
    ``settings``: :func:`build_decoder_as`'s keyword arguments, the rest being fields of its config class (``num_hidden_layers``, ``num_key_value_heads``, ``rope_parameters``, ...).
    ``pretrained``: a hub name or local directory whose ``config.json`` gives the architecture (the
    fields given here must agree with it, see :func:`~pipeline_recipes.models.pretrained.checkpoint_config`) and whose
    weights replace the initialisation, layer by layer as each rank materialises its own.
    ``data_family``: the data format the data configs read, the family's
    (:attr:`~pipeline_recipes.models.families.ModelFamily.data_format`: causal-LM blocks, as GPT-2's); None: that one.
    ``loss_chunk_tokens``: tokens whose logits the loss computes at a time (``None``: the head returns
    the whole logits).
    ``device`` and ``init_seed`` as in :func:`~pipeline_recipes.models.gpt2.build_gpt2`.
    """
    family_classes(family)
    return build_decoder_as(DecoderPipelineModel, name, seq_len, family=family, **settings)


def build_decoder_as(
    pipeline_class: type[DecoderPipelineModel],
    name: str,
    seq_len: int,
    *,
    family: str,
    attn_implementation: str = "sdpa",
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
    init_seed: int | None = None,
    device: str | torch.device | None = None,
    pretrained: str | None = None,
    data_family: str | None = None,
    loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    **config: Any,
) -> DecoderPipelineModel:
    """:func:`build_decoder`'s work for any registered decoder family (its ``transformers`` classes from
    :data:`~pipeline_recipes.models.families.FAMILIES`), as ``pipeline_class``: the adapter of a decoder whose
    forward differs from Llama's subclasses :class:`DecoderPipelineModel` with its layers and builds it here."""
    spec = model_family(family)
    if data_family not in (None, spec.data_format):
        raise ValueError(f"model.data_family={data_family!r}: model.family={family!r} trains on "
                         f"{spec.data_format!r} data (data_family: {spec.data_format})")
    config_cls, model_cls = spec.classes()
    config.pop("compile", None)  # model.compile: the trainer compiles the blocks (pipeline_recipes.strategies.compute.compile)
    config = {k: plain(v) for k, v in config.items()}
    hf_config = make_hf_config(config_cls, {**config, "attn_implementation": attn_implementation})
    if pretrained:
        hf_config = checkpoint_config(pretrained, family, hf_config, given=set(config))
        hf_config._attn_implementation = attn_implementation
    hf, seed = build_on_meta(model_cls, hf_config, init_seed)
    model = pipeline_class(hf, name=name, seq_len=seq_len, embedding_cost=embedding_cost, head_cost=head_cost,
                           init_seed=seed, pretrained=pretrained or None, loss_chunk_tokens=loss_chunk_tokens)
    return finish_build(model, device)
