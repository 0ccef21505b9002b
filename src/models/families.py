"""The model families, each registered once with everything the recipe, the planner and the FLOP count need of it.

As torchtitan registers a model's ``TrainSpec`` under its name (its model, its data loader, its parallelisation),
a family here is one :class:`ModelFamily` in :data:`FAMILIES`, keyed by its ``transformers`` ``model_type``:

* its adapter: ``builder``, the dotted path of the function that builds its pipeline model (the Hydra ``_target_``
  of its ``conf/model/*.yaml``), and the ``transformers`` config and model classes it builds from;
* its data format (``data_format``): the data the data configs make for it (``gpt2``: causal-LM blocks; ``bert``:
  masked-LM sentence pairs, :mod:`pipeline_recipes.datamodules`), which the planner's profile makes too;
* the keys of its config: its blocks (``layers_key``: the layout's rules count them and a refusal proposes more),
  its width (``width_key``) and its position table (``positions_key``);
* its FLOP shape (:meth:`ModelFamily.shape`): the blocks and the attention width of the attention term of the model
  FLOPs (:mod:`pipeline_recipes.recipe.report.flops`) and of the planner's derived times
  (:mod:`pipeline_recipes.planner.derived_costs`); ``flop_shape`` replaces the default, :func:`attention_shape`.

The defaults are the spellings of ``transformers``' decoder configs. A Hugging Face decoder family whose
``<Family>Model.forward`` is Llama's (see :mod:`.decoder`) is one entry with ``builder=DECODER_BUILDER``; a decoder
with a forward of its own is its adapter (a module holding its builder) and one entry naming that builder; a size
of either is one ``conf/model/<name>.yaml`` (:mod:`.presets`). A config of no registered family (another builder's)
is read by the registered families' spellings and :data:`OTHER_SPELLINGS` (:func:`config_key`).
Pure Python: no torch import; ``transformers`` only in :meth:`ModelFamily.classes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DECODER_BUILDER = "pipeline_recipes.models.build_decoder"

Shape = tuple[int, int]
"""(blocks, attention width) of a model config."""

KEY_FACTS = ("layers_key", "width_key", "positions_key")
"""The fields of :class:`ModelFamily` that name a key of its configs."""

OTHER_SPELLINGS: dict[str, tuple[str, ...]] = {"layers_key": ("num_layers",), "width_key": ("d_model",)}
"""Spellings of configs outside the registry (T5's), read after the registered families' (:func:`config_key`)."""


def attention_shape(cfg: Mapping[str, Any], layers_key: str | None, width_key: str | None) -> Shape | None:
    """``(blocks, attention width)`` of ``cfg``: its ``layers_key`` and the query heads' width,
    ``num_attention_heads · head_dim`` where the config sets ``head_dim`` (Llama 3, Qwen3), else its ``width_key``
    (the ``h`` of "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §5.1).
    Grouped-query attention shrinks only the key/value projections, which a parameter count already has. None when
    the config gives either number not."""
    layers = cfg.get(layers_key) if layers_key else None
    width = cfg.get(width_key) if width_key else None
    if cfg.get("head_dim") is not None and cfg.get("num_attention_heads") is not None:
        width = int(cfg["head_dim"]) * int(cfg["num_attention_heads"])
    return (int(layers), int(width)) if layers is not None and width is not None else None


@dataclass(frozen=True)
class ModelFamily:
    """One model family (see the module docstring). ``builder``: the dotted path of its adapter's build function
    (the Hydra ``_target_`` of its yaml; it takes the yaml's keys); ``config_class`` and ``model_class``: names in
    ``transformers`` (the family's ``model_type`` is its :data:`FAMILIES` key); ``data_format``: a data format of
    :mod:`pipeline_recipes.datamodules` (``gpt2`` or ``bert``); ``layers_key``, ``width_key``, ``positions_key``:
    the config keys of its blocks, its width and its position table; ``flop_shape``: its ``(blocks, attention
    width)`` from a config where :func:`attention_shape` of its keys is not it."""

    builder: str
    config_class: str
    model_class: str
    data_format: str = "gpt2"
    layers_key: str = "num_hidden_layers"
    width_key: str = "hidden_size"
    positions_key: str = "max_position_embeddings"
    flop_shape: Callable[[Mapping[str, Any]], Shape | None] | None = None

    @property
    def is_decoder(self) -> bool:
        """Built by the Llama-style decoder adapter (:func:`~pipeline_recipes.models.decoder.build_decoder`)."""
        return self.builder == DECODER_BUILDER

    def shape(self, cfg: Mapping[str, Any]) -> Shape | None:
        """``(blocks, attention width)`` of a config of this family (None: it lacks one)."""
        if self.flop_shape is not None:
            return self.flop_shape(cfg)
        return attention_shape(cfg, self.layers_key, self.width_key)

    def classes(self) -> tuple[type, type]:
        """The ``transformers`` config and model classes (imports ``transformers``)."""
        import transformers

        return getattr(transformers, self.config_class), getattr(transformers, self.model_class)


FAMILIES: dict[str, ModelFamily] = {
    "gpt2": ModelFamily("pipeline_recipes.models.build_gpt2", "GPT2Config", "GPT2LMHeadModel",
                        layers_key="n_layer", width_key="n_embd", positions_key="n_positions"),
    "bert": ModelFamily("pipeline_recipes.models.build_bert", "BertConfig", "BertForPreTraining", data_format="bert"),
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


def family_of(cfg: Mapping[str, Any]) -> ModelFamily | None:
    """The registered family a model config names (its ``family``), or None (a config of another builder)."""
    return FAMILIES.get(str(cfg.get("family")))


def spellings(fact: str) -> tuple[str, ...]:
    """Every key that may hold ``fact`` (one of :data:`KEY_FACTS`): the registered families' (in the registry's
    order, each once), then :data:`OTHER_SPELLINGS`."""
    return (*dict.fromkeys(getattr(family, fact) for family in FAMILIES.values()), *OTHER_SPELLINGS.get(fact, ()))


def candidate_keys(cfg: Mapping[str, Any], fact: str) -> tuple[str, ...]:
    """The keys of model config ``cfg`` that may hold ``fact`` (one of :data:`KEY_FACTS`): its family's one; for a
    config of no registered family, :func:`spellings`."""
    family = family_of(cfg)
    return (getattr(family, fact),) if family is not None else spellings(fact)


def config_key(cfg: Mapping[str, Any], fact: str) -> str | None:
    """The key of model config ``cfg`` that holds ``fact`` (one of :data:`KEY_FACTS`: ``layers_key``, ...): the first
    of :func:`candidate_keys` that it sets; None when it sets none."""
    return next((key for key in candidate_keys(cfg, fact) if cfg.get(key) is not None), None)


def transformer_shape(cfg: Mapping[str, Any]) -> Shape | None:
    """``(blocks, attention width)`` of a model config (:meth:`ModelFamily.shape` of its family; for a config of no
    registered family, :func:`attention_shape` of the keys :func:`config_key` finds); None when it gives neither."""
    family = family_of(cfg)
    if family is not None:
        return family.shape(cfg)
    return attention_shape(cfg, config_key(cfg, "layers_key"), config_key(cfg, "width_key"))


def data_format(family: str) -> str:
    """The data format of a model family's training data (a model of no registered family: causal-LM blocks, ``gpt2``,
    as every decoder's)."""
    known = FAMILIES.get(family)
    return known.data_format if known is not None else ModelFamily.data_format
