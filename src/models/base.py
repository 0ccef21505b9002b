"""Shared plumbing of the Hugging Face models wrapped for the pipeline runtime.

A ``HFPipelineModel`` owns an ``nn.ModuleList`` of thin layers around the submodules of one
``transformers`` model built from a config (no weights are ever downloaded). The unsplit HF model is
kept as an unregistered reference (``reference()``): it shares every parameter with the layers, so it
serves as the numerical reference of the pipelined model and ``model.to(...)``/``train()`` reach it.

The HF model is always built on the meta device and then materialised (:mod:`~pipeline_recipes.models.materialize`):
wholly for a single-process build, or only a rank's own layers under a pipeline
(:meth:`HFPipelineModel.materialize`), with per-module init streams so both give identical weights.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipeline_recipes.core.pipeline_model import PipelineModel, TiedGroup

from .lm_loss import transient_bytes
from .materialize import materialize_layers, resolve_seed
from .partition import balanced_partition, format_partition_table

COST_KINDS = ("layers", "params")


def config_fields(config_cls: type) -> set[str]:
    """The keyword arguments a ``transformers`` config class understands (including aliases)."""
    names = {
        p.name
        for p in inspect.signature(config_cls.__init__).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
    }
    names |= set(getattr(config_cls, "attribute_map", {}) or {})
    return names | {"attn_implementation"}


def make_hf_config(config_cls: type, fields: Mapping[str, Any]) -> Any:
    """Build ``config_cls(**fields)``, rejecting names the class does not know (typos in overrides
    like ``model.n_layers=4`` would otherwise be stored silently and ignored)."""
    known = config_fields(config_cls)
    unknown = sorted(set(fields) - known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"unknown {config_cls.__name__} field(s): {', '.join(hints)}")
    return config_cls(**dict(fields))


def build_on_meta(model_cls: type, hf_config: Any, init_seed: int | None) -> tuple[nn.Module, int]:
    """``model_cls(hf_config)`` on the meta device (no memory, no init work) and the model's init seed
    (``init_seed``, or one drawn from the global generator)."""
    seed = resolve_seed(init_seed)
    with torch.device("meta"):
        hf = model_cls(hf_config)
    return hf, seed


def finish_build(model: HFPipelineModel, device: str | torch.device | None) -> HFPipelineModel:
    """``device="meta"``: leave every layer on meta (pipelines materialise their own); otherwise
    materialise the whole model on ``device`` (the CPU by default)."""
    if device is None or torch.device(device).type != "meta":
        model.materialize(None, "cpu" if device is None else device)
    return model


def unique_numel(params: Iterator[nn.Parameter]) -> int:
    seen: set[int] = set()
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


class HFPipelineModel(nn.Module, PipelineModel):
    """Base of the GPT-2 and BERT pipeline models (see the module docstring).

    Subclasses set ``self.layers`` (``nn.ModuleList``), ``self.layer_names_`` and implement
    ``pipeline_loss``/``tied_parameters``.
    """

    family: str = ""

    def __init__(self, hf_model: nn.Module, *, name: str, seq_len: int,
                 embedding_cost: float = 0.0, head_cost: float = 0.0, init_seed: int = 0) -> None:
        super().__init__()
        object.__setattr__(self, "_hf", hf_model)  # not a submodule: its parameters live in self.layers
        self.init_seed = int(init_seed)  # the per-module init streams derive from it (models.materialize)
        self.name = name
        self.seq_len = int(seq_len)
        self.embedding_cost = float(embedding_cost)
        self.head_cost = float(head_cost)
        self.layers = nn.ModuleList()
        self.layer_names_: list[str] = []

    # --- PipelineModel -------------------------------------------------------------------------
    def pipeline_layers(self) -> Sequence[nn.Module]:
        return self.layers

    def tied_parameters(self) -> list[TiedGroup]:
        return []

    def materialize(self, layers: Iterable[int] | None, device: str | torch.device) -> None:
        """Give pipeline layers ``layers`` (all when ``None``) real tensors on ``device``, initialised as
        ``transformers`` does from per-module streams of ``init_seed``; the other layers stay on meta.
        Call it before remote layers are dropped: a head tied to the embedding runs layer 0's init."""
        indices = range(len(self.layers)) if layers is None else layers
        materialize_layers(self.layers, indices, device, seed=self.init_seed, init_module=self._hf._init_weights)

    # --- reference and helpers -----------------------------------------------------------------
    @property
    def config(self) -> Any:
        """The HF config (shared with the reference model)."""
        return self._hf.config

    def reference(self) -> nn.Module:
        """The unsplit ``transformers`` model; it shares every parameter with ``pipeline_layers()``
        (layers never materialised stay on the meta device there too)."""
        return self._hf

    def train(self, mode: bool = True) -> HFPipelineModel:
        super().train(mode)
        self._hf.train(mode)
        return self

    def set_attn_implementation(self, impl: str) -> None:
        """Switch attention kernels (``"eager"``, ``"sdpa"``, ...) for the layers and the reference."""
        self._hf.set_attn_implementation(impl)

    def loss_transient_bytes(self, batch_size: int, itemsize: int) -> int:
        """Bytes the chunked LM loss's backward holds at its peak beyond the saved tensors, for a
        micro-batch of ``batch_size`` sequences whose products run in a dtype of ``itemsize`` bytes
        (:func:`~pipeline_recipes.models.lm_loss.transient_bytes`; 0 when the head returns the logits)."""
        chunk = getattr(self, "loss_chunk_tokens", None)
        config = self.config
        return transient_bytes(batch_size * self.seq_len, int(config.vocab_size), int(config.hidden_size), chunk,
                               itemsize)

    def check_seq_len(self, seq_len: int) -> None:
        limit = self.config.max_position_embeddings
        if seq_len > limit:
            raise ValueError(f"{self.name}: sequence length {seq_len} exceeds max positions {limit}")

    def num_parameters(self) -> int:
        """Distinct parameters (a tied weight counts once)."""
        return unique_numel(self.parameters())

    def layer_names(self) -> list[str]:
        return list(self.layer_names_)

    def layer_param_counts(self) -> list[int]:
        """Parameters held by each layer (a tied weight is counted in every layer holding it)."""
        return [unique_numel(layer.parameters()) for layer in self.layers]

    def layer_costs(self, kind: str = "layers") -> list[float]:
        """Per-layer cost for ``balanced_partition``.

        ``"layers"``: 1 per transformer block, ``embedding_cost``/``head_cost`` for the first/last layer
        (0 by default, so D stages hold equal numbers of blocks as in the Chimera paper).
        ``"params"``: parameter count of each layer.
        """
        if kind == "layers":
            costs = [1.0] * len(self.layers)
            costs[0] = self.embedding_cost
            costs[-1] = self.head_cost
            return costs
        if kind == "params":
            return [float(c) for c in self.layer_param_counts()]
        raise ValueError(f"unknown cost kind {kind!r}; expected one of {COST_KINDS}")

    def partition(self, stages: int, kind: str = "layers") -> list[range]:
        """``balanced_partition(self.layer_costs(kind), stages)``."""
        return balanced_partition(self.layer_costs(kind), stages)

    def partition_table(self, partition: Sequence[range], kind: str = "layers") -> str:
        """``format_partition_table`` of this model (with a note when tied weights are counted twice)."""
        counts = self.layer_param_counts()
        table = format_partition_table(partition, self.layer_names(), counts, self.layer_costs(kind))
        distinct = self.num_parameters()
        if distinct != sum(counts):
            table += f"\n(tied weights are counted in every layer holding them; distinct parameters: {distinct:,})"
        return table

    def extra_repr(self) -> str:
        return f"name={self.name!r}, seq_len={self.seq_len}, attn={self.config._attn_implementation!r}"
