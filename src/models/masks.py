"""Attention masks of the pipeline layers: built once per stage forward, with the installed signature.

``GPT2Model.forward``, ``LlamaModel.forward`` and ``BertModel.forward`` build their attention mask once
per forward with ``transformers.masking_utils`` and hand it to every block. A pipeline stage runs its
blocks one after the other on one activation tensor, so the blocks of one model share a
:class:`MaskCache`: the first block of a stage's forward builds the mask and the others reuse it while
what decides it is unchanged (the builder, the config and its attention implementation and sliding window,
the activation's type (fake or real), batch size, length, dtype and device, inference mode, and the
micro-batch's own ``attention_mask`` tensor; positions are ``0..T-1``, decided by the length).

Llama-style decoders also compute their rotary ``(cos, sin)`` once per forward and hand it to every
layer; :meth:`MaskCache.rotary` does the same for a stage's layers (the pair depends only on the rotary
module's buffers and the activation's length, dtype and device).

The mask builders' arguments moved between ``transformers`` 5 releases: ``past_key_values`` became
``cache`` (the old name warns, then goes in 5.40), ``cache_position`` is gone, ``input_embeds`` became
``inputs_embeds``. :func:`mask_kwargs` reads the installed signature and passes what it takes: no cache
(training), positions ``0..T-1``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

MaskFn = Callable[..., Any]


@cache
def _parameters(fn: MaskFn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)  # follows __wrapped__ past deprecation decorators


def mask_kwargs(fn: MaskFn, hidden: Tensor, attention_mask: Tensor | None,
                position_ids: Tensor | None = None) -> dict[str, Any]:
    """Keyword arguments of ``fn`` (a ``transformers.masking_utils`` builder) for a forward without a
    KV cache over positions ``0..T-1`` of ``hidden`` ``[B, T, H]``, in the names the installed version takes."""
    params = _parameters(fn)
    kwargs: dict[str, Any] = {"inputs_embeds" if "inputs_embeds" in params else "input_embeds": hidden,
                              "attention_mask": attention_mask}
    if "cache" in params:
        kwargs["cache"] = None
    elif "past_key_values" in params:
        kwargs["past_key_values"] = None
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    if position_ids is not None and "position_ids" in params:
        kwargs["position_ids"] = position_ids
    return kwargs


class MaskCache:
    """The last mask per builder and what it was built from; shared by the blocks of one model.

    Not state of the model: a copy or a pickle of it starts empty.
    """

    def __init__(self) -> None:
        self._last: dict[MaskFn, tuple[tuple[Any, ...], Tensor | None, Any]] = {}
        self.builds = 0  # how many masks were built (tests count them)

    def get(self, fn: MaskFn, config: Any, hidden: Tensor, attention_mask: Tensor | None,
            position_ids: Tensor | None = None) -> Any:
        """``fn``'s mask for ``hidden`` under ``config``, built only when it differs from the last one's inputs."""
        key = (id(config), getattr(config, "_attn_implementation", None), getattr(config, "sliding_window", None),
               type(hidden), tuple(hidden.shape[:2]), hidden.dtype, hidden.device,
               torch.is_inference_mode_enabled())  # an inference tensor cannot be saved for a backward
        last = self._last.get(fn)  # one tuple read: safe when two stages of a rank run in threads
        if last is not None and last[0] == key and last[1] is attention_mask:
            return last[2]
        mask = fn(config=config, **mask_kwargs(fn, hidden, attention_mask, position_ids))
        self._last[fn] = (key, attention_mask, mask)  # positions: 0..T-1 of hidden, so in the key
        self.builds += 1
        return mask

    def rotary(self, rotary_emb: torch.nn.Module, hidden: Tensor, position_ids: Tensor) -> Any:
        """``rotary_emb(hidden, position_ids)`` (positions ``0..T-1``), computed again only when its inputs
        differ from the last call's: the module, its ``inv_freq`` tensor and that tensor's version, and the
        activation's type, length, dtype and device, and inference mode."""
        inv_freq = rotary_emb.inv_freq
        if any(kind in str(getattr(rotary_emb, "rope_type", "")) for kind in ("dynamic", "longrope")):
            return rotary_emb(hidden, position_ids=position_ids)  # its frequencies follow the lengths seen so far
        key = (type(hidden), hidden.shape[1], hidden.dtype, hidden.device, inv_freq._version,
               torch.is_inference_mode_enabled())
        last = self._last.get(rotary_emb)
        if last is not None and last[0] == key and last[1] is inv_freq:
            return last[2]
        pair = rotary_emb(hidden, position_ids=position_ids)
        self._last[rotary_emb] = (key, inv_freq, pair)
        return pair

    def __deepcopy__(self, memo: dict[int, Any]) -> MaskCache:
        return MaskCache()

    @override
    def __reduce__(self) -> tuple[type[MaskCache], tuple[()]]:
        return MaskCache, ()
