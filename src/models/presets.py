"""Named model presets and ``build_model``; ``conf/model/<name>.yaml`` mirror ``PRESETS`` (a test checks).

Paper sizes follow Chimera (Li & Hoefler, SC'21), Table 2: GPT-2 with 64 layers, hidden 1280,
20 heads, untied LM head (1,389,327,360 parameters, sequence length 632) and BERT with 48 layers,
hidden 1024, 16 heads, FFN 4096, untied decoder (669,790,012 parameters, sequence length 128).
Standard sizes follow the GPT-2 and BERT releases; the tiny ones train in seconds on a CPU.
Decoder-only models (:mod:`~pipeline_recipes.models.decoder`): ``llama3-1b`` is Llama 3.2 1B's architecture (16 layers,
hidden 2048, 32 query and 8 key/value heads, SwiGLU FFN 8192, tied embeddings, llama3 RoPE scaling:
1,235,814,400 parameters), so ``model.pretrained=meta-llama/Llama-3.2-1B`` loads into it; ``llama-tiny``
(grouped-query attention, untied head) and ``qwen2-tiny`` (Qwen2's q/k/v biases, tied head, as the small
Qwen2 models) are CPU-sized.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .families import FAMILIES, model_family

if TYPE_CHECKING:
    from .base import HFPipelineModel



def _gpt2(name: str, seq_len: int, n_layer: int, n_embd: int, n_head: int, *, tied: bool,
          vocab_size: int = 50257, n_positions: int = 1024, dropout: float = 0.1) -> dict[str, Any]:
    return {
        "name": name, "family": "gpt2", "seq_len": seq_len, "attn_implementation": "sdpa",
        "compile": "auto",
        "embedding_cost": 0.0, "head_cost": 0.0, "init_seed": None, "loss_chunk_tokens": 4096,
        "n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "n_positions": n_positions,
        "vocab_size": vocab_size, "tie_word_embeddings": tied, "activation_function": "gelu_pytorch_tanh",
        "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout,
    }


def _bert(name: str, seq_len: int, layers: int, hidden: int, heads: int, ffn: int, *, tied: bool,
          vocab_size: int = 30522, max_positions: int = 512, dropout: float = 0.1) -> dict[str, Any]:
    return {
        "name": name, "family": "bert", "seq_len": seq_len, "attn_implementation": "sdpa",
        "compile": "auto",
        "embedding_cost": 0.0, "head_cost": 0.0, "init_seed": None, "loss_chunk_tokens": 4096,
        "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "intermediate_size": ffn, "max_position_embeddings": max_positions, "type_vocab_size": 2,
        "vocab_size": vocab_size, "tie_word_embeddings": tied,
        "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout,
    }


def _decoder(name: str, family: str, seq_len: int, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, *,
             tied: bool, vocab_size: int, max_positions: int, rope: dict[str, Any], rms_norm_eps: float = 1e-6,
             **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "family": family, "data_family": "gpt2", "seq_len": seq_len, "attn_implementation": "sdpa",
        "compile": "auto",
        "embedding_cost": 0.0, "head_cost": 0.0, "init_seed": None, "loss_chunk_tokens": 4096, "pretrained": None,
        "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "intermediate_size": ffn, "max_position_embeddings": max_positions,
        "vocab_size": vocab_size, "tie_word_embeddings": tied, "rms_norm_eps": rms_norm_eps, "rope_parameters": rope,
        "attention_dropout": 0.0, **extra,
    }


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": _gpt2("gpt2", 632, 64, 1280, 20, tied=False),
    "gpt2-small": _gpt2("gpt2-small", 1024, 12, 768, 12, tied=True),
    "gpt2-medium": _gpt2("gpt2-medium", 1024, 24, 1024, 16, tied=True),
    "gpt2-large": _gpt2("gpt2-large", 1024, 36, 1280, 20, tied=True),
    "gpt2-xl": _gpt2("gpt2-xl", 1024, 48, 1600, 25, tied=True),
    "gpt2-tiny": _gpt2("gpt2-tiny", 32, 4, 64, 4, tied=True, vocab_size=1000, n_positions=64, dropout=0.0),
    "bert48": _bert("bert48", 128, 48, 1024, 16, 4096, tied=False),
    "bert-base": _bert("bert-base", 128, 12, 768, 12, 3072, tied=True),
    "bert-large": _bert("bert-large", 128, 24, 1024, 16, 4096, tied=True),
    "bert-tiny": _bert("bert-tiny", 32, 4, 64, 4, 128, tied=False, vocab_size=1000, max_positions=64, dropout=0.0),
    "llama3-1b": _decoder("llama3-1b", "llama", 2048, 16, 2048, 32, 8, 8192, tied=True, vocab_size=128256,
                          max_positions=131072, rope=LLAMA3_ROPE, rms_norm_eps=1e-5, head_dim=64,
                          bos_token_id=128000, eos_token_id=128001),
    "llama-tiny": _decoder("llama-tiny", "llama", 32, 4, 64, 4, 2, 128, tied=False, vocab_size=1000, max_positions=64,
                           rope={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5),
    "qwen2-tiny": _decoder("qwen2-tiny", "qwen2", 32, 4, 64, 4, 2, 128, tied=True, vocab_size=1000, max_positions=64,
                           rope={"rope_type": "default", "rope_theta": 1000000.0}),
}

# Paper parameter counts (checked by tests/models/test_models.py on the meta device).
PAPER_PARAMS = {"gpt2": 1_389_327_360, "bert48": 669_790_012, "gpt2-small": 124_439_808,
                "llama3-1b": 1_235_814_400}


def model_names() -> list[str]:
    return sorted(PRESETS)


def preset(name: str) -> dict[str, Any]:
    """A copy of the preset's keyword arguments (the YAML file's keys, minus ``_target_``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(model_names())}")
    return dict(PRESETS[name])


def hydra_config(name: str) -> dict[str, Any]:
    """What ``conf/model/<name>.yaml`` holds: ``_target_`` plus the preset."""
    p = preset(name)
    return {"_target_": model_family(p["family"]).builder, **p}


def _builder(name: str) -> Callable[..., HFPipelineModel]:
    """The registered family's builder, imported when asked for: each family's ``transformers`` classes
    load when it is built."""
    module, _, attr = model_family(name).builder.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def build_model(name_or_cfg: str | Mapping[str, Any], **overrides: Any) -> HFPipelineModel:
    """Build a pipeline model from a preset name or a (Hydra) config mapping, plus overrides.

    ``build_model("gpt2-tiny", n_layer=2, attn_implementation="eager")``;
    ``build_model(cfg.model)`` (``_target_`` is ignored; ``family`` picks the builder);
    ``build_model("gpt2", device="meta")`` counts parameters without allocating them.
    """
    if isinstance(name_or_cfg, str):
        kwargs = preset(name_or_cfg)
    else:
        try:  # an omegaconf DictConfig
            from omegaconf import DictConfig, OmegaConf

            if isinstance(name_or_cfg, DictConfig):
                name_or_cfg = OmegaConf.to_container(name_or_cfg, resolve=True)  # type: ignore[assignment]
        except ImportError:  # pragma: no cover
            pass
        kwargs = {str(k): v for k, v in dict(name_or_cfg).items()}
        kwargs.pop("_target_", None)
        if "family" not in kwargs:
            if kwargs.get("name") not in PRESETS:
                raise ValueError(f"a model config needs 'family' ({', '.join(sorted(FAMILIES))}) or a preset 'name'")
            kwargs = {**preset(kwargs["name"]), **kwargs}
    kwargs.update(overrides)
    return _builder(kwargs["family"])(**kwargs)
