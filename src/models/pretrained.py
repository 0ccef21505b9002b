"""Pretrained weights for the decoder pipelines, read layer by layer from safetensors.

``model.pretrained=<hub name or local directory>`` names a ``save_pretrained`` checkpoint
(``config.json`` plus ``model.safetensors`` or ``model.safetensors.index.json`` and its shards).
:func:`checkpoint_config` takes the architecture from its ``config.json``; :func:`load_layers` maps
each parameter of the chosen pipeline layers to its ``transformers`` name (the unsplit model's
``named_parameters``, every alias of a tied weight) and reads only those tensors, with
``safetensors.safe_open``, from only the shard files that hold them. A pipeline rank therefore reads
its own layers and never the whole model (Chimera, Li & Hoefler, SC'21, §1: each stage holds a group
of consecutive layers).

A local directory is read as is. Any other name is a hub repository: ``config.json``, the index and
only the shards a rank needs are fetched with ``huggingface_hub`` (which honours ``HF_HUB_OFFLINE``
and its cache), so the hub is used only when the user names a hub model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Config fields that may differ from the checkpoint's: training-time settings, not the architecture.
TRAINING_FIELDS = frozenset({"attention_dropout", "initializer_range", "use_cache", "pad_token_id", "bos_token_id",
                             "eos_token_id", "dtype", "torch_dtype"})


def _is_local(name: str) -> bool:
    return Path(name).expanduser().is_dir()


def _fetch(name: str, filename: str) -> Path | None:
    """A file of the checkpoint: from the local directory, else from the hub (cached); None when the
    checkpoint has no such file."""
    if _is_local(name):
        path = Path(name).expanduser() / filename
        return path if path.exists() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(name, filename))
    except EntryNotFoundError:
        return None


def checkpoint_config(name: str, family: str, requested: Any, given: Iterable[str]) -> Any:
    """The checkpoint's ``transformers`` config, checked against the model config.

    ``requested`` is the config built from the model config's fields; ``given`` names the fields the
    model config sets. Each given architecture field must equal the checkpoint's (training-time
    settings such as ``attention_dropout`` are taken from the model config); otherwise a ``ValueError``
    lists the differences and the overrides that match the checkpoint.
    """
    from transformers import AutoConfig

    try:
        ckpt = AutoConfig.from_pretrained(str(Path(name).expanduser()) if _is_local(name) else name)
    except OSError as err:
        raise ValueError(f"model.pretrained={name!r}: no transformers checkpoint there, its config.json could not "
                         f"be read ({err}); give a local directory written by save_pretrained, or a hub model name "
                         "with network access (or already in the Hugging Face cache)") from err
    if ckpt.model_type != family:
        raise ValueError(f"model.pretrained={name!r} is a {ckpt.model_type!r} model but model.family={family!r}: "
                         f"use a {ckpt.model_type} model config (or model.family={ckpt.model_type})")
    differ = []
    for key in sorted(set(given) - TRAINING_FIELDS):
        mine, theirs = getattr(requested, key, None), getattr(ckpt, key, None)
        if mine != theirs:
            differ.append((key, mine, theirs))
    if differ:
        lines = "; ".join(f"{k}: model config {mine!r}, checkpoint {theirs!r}" for k, mine, theirs in differ)
        fix = " ".join(f"model.{k}={theirs if isinstance(theirs, str) else json.dumps(theirs)}"
                       for k, _, theirs in differ)
        raise ValueError(f"model.pretrained={name!r} does not match the model config ({lines}). Choose a model "
                         f"config of the checkpoint's architecture, or override: {fix}")
    for key in sorted(set(given) & TRAINING_FIELDS):
        setattr(ckpt, key, getattr(requested, key))
    return ckpt


def weight_map(name: str) -> dict[str, str]:
    """``{tensor name: file name}`` of the checkpoint's safetensors (one file or an index of shards)."""
    index = _fetch(name, INDEX_FILE)
    if index is not None:
        return dict(json.loads(index.read_text())["weight_map"])
    single = _fetch(name, SINGLE_FILE)
    if single is None:
        raise FileNotFoundError(f"model.pretrained={name!r}: neither {INDEX_FILE} nor {SINGLE_FILE} found "
                                "(only safetensors checkpoints are read; re-save with save_pretrained)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {key: SINGLE_FILE for key in f.keys()}


def hf_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(tensor) -> its names in the unsplit HF model`` (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    ref = model.reference()
    for key, t in (*ref.named_parameters(remove_duplicate=False), *ref.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(key)
    return names


def load_layers(model: nn.Module, indices: Iterable[int], name: str) -> int:
    """Copy the checkpoint's tensors into the (materialised) pipeline layers ``indices``; return how many
    tensors were read. Every parameter of those layers must be in the checkpoint (a tied head takes
    the embedding's tensor); buffers the checkpoint lacks (rotary frequencies) keep their values."""
    from safetensors import safe_open

    layers = model.pipeline_layers()
    names = hf_names(model)
    available = weight_map(name)
    wanted: dict[str, list[tuple[str, torch.Tensor]]] = {}  # file -> [(checkpoint key, tensor)]
    missing: list[str] = []
    seen: set[int] = set()
    for i in indices:
        for key, t in (*layers[i].named_parameters(), *layers[i].named_buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            found = next((n for n in names.get(id(t), []) if n in available), None)
            if found is None:
                if isinstance(t, nn.Parameter):
                    missing.append(f"{model.layer_names()[i]}.{key} ({', '.join(names.get(id(t), ['?']))})")
                continue
            wanted.setdefault(available[found], []).append((found, t))
    if missing:
        raise ValueError(f"model.pretrained={name!r} lacks {len(missing)} parameter(s) of the model, e.g. "
                         f"{missing[:3]}: it is not a checkpoint of this architecture")
    read = 0
    with torch.no_grad():
        for filename, pairs in sorted(wanted.items()):
            path = _fetch(name, filename)
            if path is None:
                raise FileNotFoundError(f"model.pretrained={name!r}: shard {filename} of its index is missing")
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key, t in pairs:
                    value = f.get_tensor(key)
                    if tuple(value.shape) != tuple(t.shape):
                        raise ValueError(f"model.pretrained={name!r}: {key} has shape {tuple(value.shape)} in the "
                                         f"checkpoint but {tuple(t.shape)} in the model")
                    t.copy_(value.to(dtype=t.dtype))
                    read += 1
    return read
