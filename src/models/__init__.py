"""Models for the pipeline runtime: GPT-2, BERT and decoder-only LMs (Llama, Mistral, Qwen2, Qwen3) built
from ``transformers`` configs (no weights unless ``pretrained`` names a checkpoint).

Public API::

    build_model(name_or_cfg, **overrides) -> HFPipelineModel   # presets: model_names(), conf/model/*.yaml
    build_gpt2(**cfg) / build_bert(**cfg) / build_decoder(**cfg)  # Hydra targets of conf/model/*.yaml
    model.reference()                                           # the unsplit HF model, same parameters
    model.layer_costs(kind) / model.partition(stages, kind) / model.partition_table(partition, kind)
    balanced_partition(costs, stages) / format_partition_table(partition, names, param_counts)

Names are imported lazily, so ``pipeline_recipes.models.partition`` stays pure Python (no torch/transformers import).
Building from configs never touches the Hugging Face hub (only ``pretrained=<hub name>`` does); nothing
here sets ``HF_HUB_OFFLINE`` (doing so at import would also switch the hub off for the wikitext2/wikipedia
loaders of users with network).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "COST_KINDS": "base", "HFPipelineModel": "base",
    "BertPipelineModel": "bert", "build_bert": "bert",
    "DecoderPipelineModel": "decoder", "build_decoder": "decoder",
    "GPT2PipelineModel": "gpt2", "build_gpt2": "gpt2",
    "balanced_partition": "partition", "format_partition_table": "partition", "stage_costs": "partition",
    "PAPER_PARAMS": "presets", "build_model": "presets", "hydra_config": "presets",
    "model_names": "presets", "preset": "presets",
    "FAMILIES": "families", "ModelFamily": "families", "decoder_families": "families", "model_family": "families",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
