"""Named model presets and ``build_model``: a preset is its Hydra config, ``conf/model/<name>.yaml``, read here as
it is (plain YAML, no Hydra composition), so that scripts, the planner and the tests build the sizes training runs.

Paper sizes follow Chimera (Li & Hoefler, SC'21), Table 2: GPT-2 with 64 layers, hidden 1280,
20 heads, untied LM head (1,389,327,360 parameters, sequence length 632) and BERT with 48 layers,
hidden 1024, 16 heads, FFN 4096, untied decoder (669,790,012 parameters, sequence length 128).
Standard sizes follow the GPT-2 and BERT releases; the tiny ones train in seconds on a CPU.
Decoder-only models (:mod:`~pipeline_recipes.models.decoder`): ``llama3-1b`` is Llama 3.2 1B's architecture (16 layers,
hidden 2048, 32 query and 8 key/value heads, SwiGLU FFN 8192, tied embeddings, llama3 RoPE scaling:
1,235,814,400 parameters), so ``model.pretrained=meta-llama/Llama-3.2-1B`` loads into it; ``llama-tiny``
(grouped-query attention, untied head) and ``qwen2-tiny`` (Qwen2's q/k/v biases, tied head, as the small
Qwen2 models) are CPU-sized. Each yaml's ``family`` names its entry of :data:`~.families.FAMILIES`, whose
builder its ``_target_`` is.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .families import FAMILIES, model_family

if TYPE_CHECKING:
    from .base import HFPipelineModel

CONF_MODEL = Path(__file__).resolve().parents[2] / "conf" / "model"  # the checkout's model group (src/models/..)

# Paper parameter counts (checked by tests/models/test_models.py on the meta device).
PAPER_PARAMS = {"gpt2": 1_389_327_360, "bert48": 669_790_012, "gpt2-small": 124_439_808,
                "llama3-1b": 1_235_814_400}


@functools.cache
def _configs() -> dict[str, dict[str, Any]]:
    """Every ``conf/model/*.yaml`` by name, read once."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    configs = {path.stem: yaml.load(path.read_text(), Loader=loader) for path in sorted(CONF_MODEL.glob("*.yaml"))}
    bad = sorted(name for name, cfg in configs.items() if not isinstance(cfg, dict))
    if bad:
        raise ValueError(f"{CONF_MODEL}: {', '.join(bad)} must each hold a mapping (a model config)")
    return configs


def model_names() -> list[str]:
    """The presets: the names of ``conf/model/*.yaml``, sorted."""
    return sorted(_configs())


def hydra_config(name: str) -> dict[str, Any]:
    """What ``conf/model/<name>.yaml`` holds (``_target_`` and every key), a copy."""
    if name not in _configs():
        raise ValueError(f"unknown model {name!r}; known: {', '.join(model_names()) or 'none'} "
                         f"(the yaml files of {CONF_MODEL})")
    return copy.deepcopy(_configs()[name])


def preset(name: str) -> dict[str, Any]:
    """A copy of the preset's keyword arguments (the YAML file's keys, minus ``_target_``)."""
    cfg = hydra_config(name)
    cfg.pop("_target_", None)
    return cfg


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
            if kwargs.get("name") not in model_names():
                raise ValueError(f"a model config needs 'family' ({', '.join(sorted(FAMILIES))}) or a preset 'name'")
            kwargs = {**preset(kwargs["name"]), **kwargs}
    kwargs.update(overrides)
    return _builder(kwargs["family"])(**kwargs)
