"""The model families, each registered once: its builder (the Hydra ``_target_`` of ``conf/model/*.yaml``)
and its ``transformers`` config and model classes.

As torchtitan registers a model's ``TrainSpec`` under its name, a family here is one :class:`ModelFamily`
in :data:`FAMILIES`; the presets (:mod:`.presets`), the decoder adapter (:mod:`.decoder`) and the tests
read this table. A new Hugging Face decoder family whose ``<Family>Model.forward`` is Llama's (see
:mod:`.decoder`) is one entry with ``builder=DECODER_BUILDER`` (its yaml under ``conf/model/`` optional).
Pure Python: no torch or ``transformers`` import.
"""

from __future__ import annotations

from dataclasses import dataclass

DECODER_BUILDER = "pipeline_recipes.models.build_decoder"


@dataclass(frozen=True)
class ModelFamily:
    """``builder``: the dotted path of the function that builds the pipeline model (a name exported by
    ``pipeline_recipes.models``); ``config_class`` and ``model_class``: names in ``transformers`` (the
    family's ``model_type`` is the :data:`FAMILIES` key)."""

    builder: str
    config_class: str
    model_class: str

    @property
    def is_decoder(self) -> bool:
        """Built by the Llama-style decoder adapter (:func:`~pipeline_recipes.models.decoder.build_decoder`)."""
        return self.builder == DECODER_BUILDER


FAMILIES: dict[str, ModelFamily] = {
    "gpt2": ModelFamily("pipeline_recipes.models.build_gpt2", "GPT2Config", "GPT2LMHeadModel"),
    "bert": ModelFamily("pipeline_recipes.models.build_bert", "BertConfig", "BertForPreTraining"),
    "llama": ModelFamily(DECODER_BUILDER, "LlamaConfig", "LlamaForCausalLM"),
    "mistral": ModelFamily(DECODER_BUILDER, "MistralConfig", "MistralForCausalLM"),
    "qwen2": ModelFamily(DECODER_BUILDER, "Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ModelFamily(DECODER_BUILDER, "Qwen3Config", "Qwen3ForCausalLM"),
}


def decoder_families() -> list[str]:
    """The families the decoder adapter builds, sorted."""
    return sorted(name for name, family in FAMILIES.items() if family.is_decoder)


def model_family(name: str) -> ModelFamily:
    """The registered family ``name``; a ``ValueError`` naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; expected one of {sorted(FAMILIES)} "
                         "(pipeline_recipes.models.families.FAMILIES)")
    return FAMILIES[name]
