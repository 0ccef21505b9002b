"""GPT-2 (Radford et al., 2019) as a pipeline of layers around ``transformers.GPT2LMHeadModel``.

Layers: ``[embeddings (wte + wpe + dropout), block_0 .. block_{L-1}, head (ln_f + lm_head)]``.
The blocks get the causal mask of ``transformers.masking_utils.create_causal_mask`` for the
configured attention implementation, as ``GPT2Model.forward`` passes it: a standalone ``GPT2Block``
given no mask is causal under ``sdpa`` but attends to the future under ``eager``. The mask is built
once per stage forward and shared by the stage's blocks (:class:`~pipeline_recipes.models.masks.MaskCache`); under
``sdpa`` it is ``None`` and the kernel's ``is_causal`` applies.

The loss is the causal-LM cross entropy on shifted labels (``batch["labels"]``, else the inputs),
averaged over the non-ignored tokens, i.e. ``transformers.loss.loss_utils.ForCausalLMLoss``. With
``loss_chunk_tokens`` set (the default) the head layer returns ``ln_f``'s output and the loss projects it
onto the vocabulary a chunk of tokens at a time (:func:`.lm_loss.linear_cross_entropy`), so the
logits of a whole micro-batch never exist; :meth:`GPT2PipelineModel.logits` gives them when wanted.
``loss_chunk_tokens=None`` makes the head return the logits, as ``GPT2LMHeadModel`` does.

The MLP's GELU is ``gelu_pytorch_tanh`` by default: the tanh approximation of the GELU (Hendrycks &
Gimpel, "Gaussian Error Linear Units", §2) as one op, where GPT-2's own ``gelu_new`` writes the same
formula as several kernels that also keep their intermediates for the backward; the two agree to fp32
rounding.
With ``tie_word_embeddings`` the embedding layer and the head share one ``Parameter``; the paper's
1.39 B model (Chimera, Li & Hoefler, SC'21, Table 2) unties it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import create_causal_mask

from .base import build_on_meta, finish_build, make_hf_config
from .causal_lm import CausalLMPipelineModel
from .lm_loss import DEFAULT_CHUNK_TOKENS, ChunkedLMHead, check_chunk_tokens
from .masks import MaskCache


def _positions(x: Tensor) -> Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


class GPT2Embeddings(nn.Module):
    """``input_ids -> dropout(wte(input_ids) + wpe(positions))`` (as ``GPT2Model.forward``)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.drop(self.wte(input_ids) + self.wpe(_positions(input_ids)))


class GPT2BlockLayer(nn.Module):
    """One ``GPT2Block`` with the causal mask HF would pass it (no padding: LM batches are full); the
    blocks of one model share ``masks``, so a stage builds the mask once per forward."""

    def __init__(self, block: nn.Module, masks: MaskCache | None = None) -> None:
        super().__init__()
        self.block = block
        self.masks = MaskCache() if masks is None else masks

    def forward(self, hidden: Tensor) -> Tensor:
        position_ids = _positions(hidden)
        # The attention module's own config decides the kernel, hence the mask format.
        mask = self.masks.get(create_causal_mask, self.block.attn.config, hidden, None, position_ids)
        return self.block(hidden, attention_mask=mask, position_ids=position_ids)


class GPT2Head(ChunkedLMHead):
    """``lm_head(ln_f(hidden))`` (:class:`~pipeline_recipes.models.lm_loss.ChunkedLMHead`)."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear, chunk_tokens: int | None = None) -> None:
        super().__init__("ln_f", ln_f, lm_head, chunk_tokens)


class GPT2PipelineModel(CausalLMPipelineModel):
    """GPT-2 LM split into ``n_layer + 2`` pipeline layers sharing parameters with ``reference()``; the
    loss is :class:`~.causal_lm.CausalLMPipelineModel`'s."""

    family = "gpt2"
    embedding_name = "wte"

    def __init__(self, hf: GPT2LMHeadModel, *, loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
                 **kwargs: Any) -> None:
        super().__init__(hf, **kwargs)
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)
        t = hf.transformer
        self.layers.append(GPT2Embeddings(t.wte, t.wpe, t.drop))
        masks = MaskCache()
        self.layers.extend(GPT2BlockLayer(block, masks) for block in t.h)
        self.layers.append(GPT2Head(t.ln_f, hf.lm_head, self.loss_chunk_tokens))
        self.layer_names_ = ["embeddings", *(f"block.{i}" for i in range(len(t.h))), "head"]
        self.check_seq_len(self.seq_len)


def build_gpt2(
    name: str = "gpt2",
    seq_len: int = 1024,
    *,
    family: str = "gpt2",
    attn_implementation: str = "sdpa",
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
    init_seed: int | None = None,
    device: str | torch.device | None = None,
    loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    activation_function: str = "gelu_pytorch_tanh",
    **config: Any,
) -> GPT2PipelineModel:
    """Hydra target of ``conf/model/gpt2*.yaml``: ``GPT2Config(**config)`` -> ``GPT2PipelineModel``.

    ``config`` holds ``GPT2Config`` fields (``n_layer``, ``n_embd``, ``tie_word_embeddings``, ...);
    ``device="meta"`` builds without memory (parameter counts, or a pipeline that materialises only its
    own layers: ``model.materialize(layers, device)``); any other device materialises every layer there.
    ``init_seed`` seeds the per-module init streams (:mod:`~pipeline_recipes.models.materialize`); ``None``
    draws it from the global generator. ``loss_chunk_tokens``: tokens whose logits the loss computes at a time
    (``None``: the head returns the whole logits). ``activation_function``: ``GPT2Config``'s, by default
    the one-op tanh GELU (``gelu_new``, GPT-2's own config value, computes the same function in several ops).
    """
    if family != "gpt2":
        raise ValueError(f"build_gpt2 got family={family!r}")
    config.pop("compile", None)  # model.compile: the trainer compiles the blocks (pipeline_recipes.strategies.compute.compile)
    vocab = int(config.get("vocab_size", 50257))
    config.setdefault("bos_token_id", vocab - 1)
    config.setdefault("eos_token_id", vocab - 1)
    hf_config = make_hf_config(GPT2Config, {**config, "activation_function": activation_function,
                                            "attn_implementation": attn_implementation})
    hf, seed = build_on_meta(GPT2LMHeadModel, hf_config, init_seed)
    model = GPT2PipelineModel(hf, name=name, seq_len=seq_len, embedding_cost=embedding_cost, head_cost=head_cost,
                              init_seed=seed, loss_chunk_tokens=loss_chunk_tokens)
    return finish_build(model, device)
