"""Sharded checkpoints of pipelined models: torch.distributed.checkpoint (DCP) under stable names; no gathering.

A checkpoint written under a pipeline strategy (``Trainer.save_checkpoint``, ``ModelCheckpoint``) is
a directory::

    step-000003.ckpt/
      .metadata       DCP's index of the state below (written last by DCP: every rank's part is on disk)
      __0_0.distcp    each rank's part of the model and optimizer state (DCP, one file per rank); names and
      __1_0.distcp    chunking: :mod:`pipeline_recipes.strategies.dcp_state`
      meta.json       format, layout (schedule, D, W, partition), epoch, step, parameter names/aliases,
                      the model's Hydra config (also in trainer.pt; checked by the launcher before a resume),
                      and the manifest: every other file of the directory with its size in bytes
      trainer.pt      Lightning's checkpoint dict without model and optimizer: loop progress (with the
                      data loader position), callbacks, LR schedulers, precision plugin, hyper-parameters
      rng/rank0.pt    each rank's RNG states (restored when the layout is unchanged)

The state is one logical state dict keyed by the unsplit LightningModule's names
(``model.layers.3.block.attn.c_attn.weight``, ``optimizer.0.state.<name>.exp_avg``): every tensor is saved once,
whichever ranks hold it, and a rank of any other layout (other D, W, schedule, partition, sharded optimizer state
or not) reads exactly its keys and element ranges. DCP's own tools read it: ``dcp_to_torch_save(directory, file)``
(``torch.distributed.checkpoint.format_utils``) writes one file that ``torch.load`` reads. A parameter shared by
several layers (tied embeddings; BERT's deduplicated decoder bias) has one canonical name, its first name in the
unsplit model's ``named_parameters()``; the other names are aliases (``meta.json: index.aliases``).

Checkpoints of the format before DCP (``meta.json`` version 1: ``stage<k>.pt`` files, each stage saved by the
lowest rank holding it with its optimizer state by parameter name, or ``optim/rank<r>.pt`` pieces of a sharded
optimizer) are still read: resumed, consolidated, exported.

:func:`consolidate` merges a checkpoint into one ordinary Lightning checkpoint file of the unsplit
model (``scripts/consolidate_ckpt.py``): ``state_dict`` holds every key, ``optimizer_states`` are in
torch's positional format for the unsplit model's trainable parameters in module order (what
``PipelineModule.configure_optimizers`` builds), so it also resumes under ``strategy=single`` or
``ddp``; ``pipeline.param_names`` names each position. :func:`read_checkpoint` reads all three kinds
(sharded directory, consolidated file, plain Lightning checkpoint of the same module).

:func:`verify_checkpoint` proves a checkpoint complete before it is used: every file the manifest lists is there
with its size, and every torch file (a zip archive whose records each carry a CRC-32) is whole and passes its
records' CRCs.

This module needs torch only (no Lightning, no process group): the strategy passes its barrier.
"""

from __future__ import annotations

import json
import random
import shutil
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pipeline_recipes.core.disk import no_space, no_space_message
from torch import Tensor, nn

from pipeline_recipes.strategies import dcp_state
from pipeline_recipes.strategies.dcp_state import FlatPiece
from pipeline_recipes.strategies.legacy import old_module_names, upgrade_targets

SHARDED_FORMAT = "pipeline-sharded"
CONSOLIDATED_FORMAT = "pipeline-consolidated"
VERSION = 2  # 2: model and optimizer state in DCP; 1: stage files (read, no longer written)
DCP_VERSION = 2
META_FILE = "meta.json"
MANIFEST_KEY = "manifest"  # meta.json: every other file of the directory (relative POSIX path) -> its size in bytes
TRAINER_FILE = "trainer.pt"
PARTIAL_SUFFIX = ".partial"  # a sharded checkpoint being written (renamed without it once complete)
MODEL_CONFIG_KEY = "model_config"  # how to rebuild the model (a Hydra config), stored by PipelineModule
PIPELINE_KEY = "pipeline"  # the consolidated file's own section
# Plain (single/DDP) Lightning checkpoints: per optimizer, the parameter name of each position (written by
# PipelineModule; the parameter groups put positions out of module order)
OPTIMIZER_NAMES_KEY = "optimizer_param_names"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not fit the model being trained."""


def stage_file(stage: int) -> str:
    return f"stage{stage}.pt"


def rng_file(rank: int) -> str:
    return f"rng/rank{rank}.pt"


# -- names ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelIndex:
    """Where a module's state lives: each pipeline layer's key prefix, tied aliases, parameter order.

    Built from the unsplit module (before a pipeline drops remote layers) by :meth:`of`.
    """

    prefixes: tuple[str, ...]  # layer i -> "model.layers.i."
    aliases: Mapping[str, str]  # alias name -> canonical name (a parameter shared by several names)
    param_order: tuple[str, ...]  # canonical names of the trainable parameters, in module order

    @classmethod
    def of(cls, root: nn.Module, layers: Sequence[nn.Module]) -> ModelIndex:
        names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        missing = [i for i, layer in enumerate(layers) if id(layer) not in names]
        if missing:
            raise ValueError(f"pipeline layers {missing} are not submodules of {type(root).__name__}")
        prefixes = tuple(names[id(layer)] + "." for layer in layers)
        first: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for name, p in root.named_parameters(remove_duplicate=False):
            if id(p) in first:
                aliases[name] = first[id(p)]
            else:
                first[id(p)] = name
        order = tuple(n for n, p in root.named_parameters() if p.requires_grad)
        return cls(prefixes, aliases, order)

    def layer_of(self, key: str) -> int | None:
        """The pipeline layer holding ``key``, or None (state outside the layers)."""
        lookup = self._lookup
        parts = key.split(".")
        for j in range(len(parts) - 1, 0, -1):
            layer = lookup.get(".".join(parts[:j]) + ".")
            if layer is not None:
                return layer
        return None

    @property
    def _lookup(self) -> dict[str, int]:
        cached = self.__dict__.get("_lookup_cache")
        if cached is None:
            cached = {p: i for i, p in enumerate(self.prefixes)}
            object.__setattr__(self, "_lookup_cache", cached)
        return cached

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    def as_dict(self) -> dict[str, Any]:
        return {"prefixes": list(self.prefixes), "aliases": dict(self.aliases), "param_order": list(self.param_order)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelIndex:
        return cls(tuple(raw["prefixes"]), dict(raw["aliases"]), tuple(raw["param_order"]))


def parameter_names(module: nn.Module, index: ModelIndex) -> dict[int, str]:
    """``id(parameter)`` -> canonical name, for the parameters ``module`` holds now (any subset of layers)."""
    return {id(p): index.canonical(n) for n, p in module.named_parameters()}


# -- saving -----------------------------------------------------------------------------------


def _group_hparams(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def stage_payload(
    layers: Iterable[int],
    module: nn.Module,
    module_state: Mapping[str, Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
    index: ModelIndex,
    with_common: bool,
) -> dict[str, Any]:
    """One stage's file: the state-dict entries of its ``layers`` (and, ``with_common``, the entries
    outside every layer) and, per optimizer, the state of the parameters of those layers by name."""
    layers = set(layers)

    def mine(key: str) -> bool:
        layer = index.layer_of(key)
        return layer in layers if layer is not None else with_common

    model = {k: v.detach() for k, v in module_state.items() if mine(k)}
    owned = {id(p) for n, p in module.named_parameters(remove_duplicate=False) if mine(n)}
    names = parameter_names(module, index)
    out: list[dict[str, Any]] = []
    for optimizer in optimizers:
        packed = optimizer.state_dict()  # positional: index i is the i-th parameter over the groups
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        position = 0
        for group, packed_group in zip(optimizer.param_groups, packed["param_groups"]):
            group_names = []
            for p in group["params"]:
                if id(p) in owned:
                    name = names[id(p)]
                    group_names.append(name)
                    if position in packed["state"]:
                        state[name] = packed["state"][position]
                position += 1
            groups.append({**_group_hparams(packed_group), "params": group_names})
        assert position == len(params)
        out.append({"state": state, "param_groups": groups})
    return {"model": model, "optimizers": out}


def rank_state(module_state: Mapping[str, Tensor], index: ModelIndex,
               optimizers: Sequence[torch.optim.Optimizer], groups: Sequence[Sequence[Sequence[nn.Parameter]]],
               names: Mapping[int, str], segments: Mapping[int, tuple[nn.Parameter, int]]) -> dict[str, Any]:
    """This rank's part of the checkpoint's DCP state (:mod:`dcp_state` names): its state-dict entries under their
    canonical names, and per optimizer the state of each parameter it steps, its groups' hyper-parameters and each
    parameter's group (``groups[i]``: optimizer i's groups of whole parameters, also where it steps only segments).
    ``segments``: a stepped segment (by id) → its parameter and offset in the flattened parameter; its per-element
    state is saved as that slice of the parameter's (:class:`FlatPiece`)."""
    state: dict[str, Any] = {index.canonical(k): v.detach() for k, v in module_state.items()}
    for i, (optimizer, whole_groups) in enumerate(zip(optimizers, groups)):
        packed = optimizer.state_dict()  # positional: index i is the i-th parameter over the groups
        position = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                for entry, value in packed["state"].get(position, {}).items():
                    param, offset = segments.get(id(p), (p, None))
                    key = dcp_state.state_key(i, names[id(param)], entry)
                    state[key] = (FlatPiece(tuple(param.shape), offset, value.reshape(-1))
                                  if offset is not None and _per_element(value) else value)
                position += 1
        state[dcp_state.groups_key(i)] = [_group_hparams(g) for g in packed["param_groups"]]
        for g, params in enumerate(whole_groups):
            for p in params:
                state[dcp_state.group_key(i, names[id(p)])] = g
    return state


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)  # weights-only
    return state


def read_rng(path: str | Path, rank: int) -> dict[str, Any] | None:
    file = Path(path) / rng_file(rank)
    return torch.load(file, weights_only=True) if file.is_file() else None


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (the disk is full, say); its partial files are removed and the
    previous checkpoint is untouched. ``consequence``: raised on a rank because another rank's write failed."""

    def __init__(self, message: str, consequence: bool = False) -> None:
        super().__init__(message)
        self.consequence = consequence


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested payload (what writing it needs, roughly)."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` through a Python file, so that a full disk raises ``OSError(ENOSPC)`` rather than the C++
    stream's ``basic_ios::clear: iostream error``."""
    with open(path, "wb") as file:
        torch.save(obj, file)


def _write_failure(rank: int, path: Path, err: BaseException, needed_bytes: int | None) -> str:
    if no_space(err, path, needed_bytes):
        return no_space_message(path, f"rank {rank} could not write", needed_bytes)
    return f"rank {rank} could not write {path}: {type(err).__name__}: {err}"


def stage_files(payloads: Mapping[int, Mapping[str, Any]],
                rank_files: Mapping[str, Any] | None = None) -> Callable[[Path], None]:
    """A rank's part in the format before DCP (version 1, still read): the stage files it owns (``payloads``, from
    :func:`stage_payload`) and its ``rank_files`` (relative path → payload: a sharded optimizer's part)."""

    def write(directory: Path) -> None:
        for stage, payload in payloads.items():
            save_file(dict(payload), directory / stage_file(stage))
        for name, payload in (rank_files or {}).items():
            (directory / name).parent.mkdir(exist_ok=True)
            save_file(payload, directory / name)

    return write


def dcp_files(state: Mapping[str, Any], process_group: Any = None) -> Callable[[Path], None]:
    """A rank's part of the DCP state (:func:`rank_state`), written by :func:`dcp_state.save` (a collective)."""
    return lambda directory: dcp_state.save(state, directory, process_group)


def _own_failure(err: BaseException, rank: int) -> BaseException | None:
    """This rank's cause in DCP's ``CheckpointException`` (which every rank raises when any rank failed), or None."""
    failures = getattr(err, "failures", None)
    if failures is None:
        return err
    own = failures.get(rank)
    return None if own is None else own[0]


def save_sharded(
    path: str | Path,
    *,
    rank: int,
    write_parts: Callable[[Path], None],
    meta: Mapping[str, Any] | None,
    trainer_state: Mapping[str, Any] | None,
    write_trainer_state: Callable[[Mapping[str, Any], Path], None],
    any_failed: Callable[[bool], bool],
    needed_bytes: int | None = None,
    rng: Mapping[str, Any] | None = None,
) -> Path:
    """Write one sharded checkpoint; every rank calls it (a collective through ``any_failed``, which tells
    every rank whether any rank's write failed).

    Each rank writes its part (``write_parts``: :func:`dcp_files`, or :func:`stage_files` for the format before
    DCP) and its RNG file into ``<path>.partial``; rank 0 then writes ``trainer.pt`` and ``meta.json`` and renames
    the directory into place, replacing an older checkpoint of that name. The directory must be on a file system
    every rank sees. When any write fails (a full disk, a quota) every rank raises :class:`CheckpointWriteError`
    (the failing one with the cause; ``needed_bytes``: what its part needed, for the message) and the partial
    directory is removed: the checkpoints already written stay as they were. ``rng``: the rank's RNG states as
    staged for a background save (default: taken now).
    """
    final = Path(path)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)

    def agree(failure: str | None) -> None:
        if not any_failed(failure is not None):
            return
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointWriteError(failure or f"rank {rank}: another rank could not write its part of {final} "
                                   "(its error ends the job)", consequence=failure is None)

    failure = None
    if rank == 0:
        try:
            if partial.exists():
                shutil.rmtree(partial)
            (partial / "rng").mkdir(parents=True)
        except OSError as err:
            failure = _write_failure(rank, partial, err, None)
    agree(failure)
    target = partial
    try:
        write_parts(partial)
        target = partial / rng_file(rank)
        save_file(rng_state() if rng is None else rng, target)
        failure = None
    except (OSError, RuntimeError, dcp_state.CheckpointException) as err:
        cause = _own_failure(err, rank)
        failure = None if cause is None else _write_failure(rank, target, cause, needed_bytes)
    agree(failure)
    if rank == 0:
        if meta is None or trainer_state is None:
            raise ValueError("rank 0 writes the checkpoint's meta.json and trainer.pt: pass both")
        try:
            target = partial / TRAINER_FILE
            write_trainer_state(trainer_state, target)
            target = partial / META_FILE  # last: the manifest lists every file the ranks wrote
            target.write_text(json.dumps({**meta, MANIFEST_KEY: file_sizes(partial)}, indent=1))
            if final.is_symlink() or final.is_file():
                final.unlink()
            elif final.exists():
                shutil.rmtree(final)
            partial.rename(final)
        except (OSError, RuntimeError) as err:
            failure = _write_failure(rank, target, err, None)
    agree(failure)
    return final


def file_sizes(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` except its ``meta.json``: relative POSIX path -> size in bytes."""
    files = (p for p in sorted(directory.rglob("*")) if p.is_file())
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in files if p != directory / META_FILE}


# -- reading ----------------------------------------------------------------------------------


def _per_element(value: Any) -> bool:
    """A state entry with one value per parameter element (Adam's moments), not a scalar (its step)."""
    return isinstance(value, Tensor) and value.dim() > 0


@dataclass
class StatePieces:
    """One parameter's optimizer state saved in slices of the flattened parameter (a sharded optimizer: each rank
    its own): ``pieces`` are (offset, state of the elements from offset on)."""

    numel: int
    shape: tuple[int, ...]
    pieces: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    def range(self, start: int, stop: int) -> dict[str, Any]:
        """The state of elements ``[start, stop)`` of the flattened parameter (per-element entries 1-D, copied;
        scalars such as Adam's step as saved)."""
        pieces = sorted(self.pieces, key=lambda piece: piece[0])
        out: dict[str, Any] = {}
        for key, first in pieces[0][1].items():
            if not _per_element(first):
                out[key] = first
                continue
            parts = [state[key][max(start, offset) - offset: min(stop, offset + state[key].numel()) - offset]
                     for offset, state in pieces if offset < stop and offset + state[key].numel() > start]
            joined = torch.cat(parts) if parts else first.new_empty(0)
            if joined.numel() != stop - start:
                raise CheckpointError(f"the saved pieces of a parameter cover {joined.numel()} of its elements "
                                      f"{start}..{stop}: a rank's optimizer part is missing from the checkpoint")
            out[key] = joined.clone()
        return out

    def whole(self) -> dict[str, Any]:
        """The state of the whole parameter, shaped like it."""
        return {k: v.view(self.shape) if _per_element(v) else v for k, v in self.range(0, self.numel).items()}


def state_range(entry: Mapping[str, Any] | StatePieces, start: int, stop: int) -> dict[str, Any]:
    """Elements ``[start, stop)`` of a parameter's saved state (whole or in pieces), per-element entries 1-D."""
    if isinstance(entry, StatePieces):
        return entry.range(start, stop)
    return {k: v.reshape(-1)[start:stop].clone() if _per_element(v) else v for k, v in entry.items()}


def whole_state(entry: Mapping[str, Any] | StatePieces) -> dict[str, Any]:
    """A parameter's saved state (whole or in pieces) as one state of the whole parameter."""
    return entry.whole() if isinstance(entry, StatePieces) else dict(entry)


@dataclass
class OptimizerState:
    """One optimizer's state by canonical parameter name (whole, or :class:`StatePieces` from a sharded
    optimizer), and its groups (hyper-parameters + names)."""

    state: dict[str, dict[str, Any] | StatePieces] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)

    def merge(self, other: Mapping[str, Any]) -> None:
        """Add one stage's part (stages sharing a tied parameter hold the same state for it)."""
        for name, value in other["state"].items():
            self.state.setdefault(name, value)
        self._merge_groups(other["param_groups"])

    def merge_pieces(self, other: Mapping[str, Any], wanted: Callable[[str], bool]) -> None:
        """Add one rank's ``optim/rank<r>.pt`` of a sharded optimizer (the format before DCP), the parameters
        ``wanted`` only."""
        for name, piece in other["pieces"].items():
            if wanted(name):
                entry = self.state.setdefault(name, StatePieces(piece["numel"], tuple(piece["shape"])))
                entry.pieces.append((piece["offset"], piece["state"]))
        self._merge_groups([{**g, "params": [n for n in g["params"] if wanted(n)]} for g in other["param_groups"]])

    def _merge_groups(self, groups: Sequence[Mapping[str, Any]]) -> None:
        for g, group in enumerate(groups):
            if g == len(self.param_groups):
                self.param_groups.append({**_group_hparams(group), "params": []})
            known = set(self.param_groups[g]["params"])
            self.param_groups[g]["params"].extend(n for n in group["params"] if n not in known)


@dataclass
class FullState:
    """What a checkpoint holds (or the part of it read): model entries, optimizers, everything else."""

    model: dict[str, Tensor]
    optimizers: list[OptimizerState]
    trainer_state: dict[str, Any]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def tensor(self, key: str) -> Tensor | None:
        """The entry of ``key`` or of another name of the same parameter."""
        if key in self.model:
            return self.model[key]
        canonical = self.aliases.get(key, key)
        for name in [canonical, *(a for a, c in self.aliases.items() if c == canonical)]:
            if name in self.model:
                return self.model[name]
        return None


def is_sharded(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not is_sharded(path):
        hint = (f" (a '{PARTIAL_SUFFIX}' directory is a save that did not finish)"
                if path.name.endswith(PARTIAL_SUFFIX) else "")
        raise CheckpointError(f"{path} is not a sharded pipeline checkpoint: it has no {META_FILE}{hint}")
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path / META_FILE} cannot be read: {err}") from err
    if meta.get("format") != SHARDED_FORMAT or int(meta.get("version", 0)) > VERSION:
        raise CheckpointError(f"{path}: unknown checkpoint format {meta.get('format')!r} version {meta.get('version')}")
    return meta


def stages_holding(meta: Mapping[str, Any], layers: Iterable[int | None]) -> list[int]:
    """Stage files holding ``layers`` (None: state outside the layers, kept in stage 0's file)."""
    owner = {i: s for s, (start, stop) in enumerate(meta["partition"]) for i in range(start, stop)}
    stages = set()
    for layer in layers:
        if layer is None:
            stages.add(0)
        elif layer not in owner:
            raise CheckpointError(f"layer {layer} is not in the checkpoint, which has {meta['num_layers']} layers: "
                                  "it was saved from another model")
        else:
            stages.add(owner[layer])
    return sorted(stages)


def _load(path: Path) -> Any:
    with old_module_names():
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def _load_file(path: Path) -> Any:
    with old_module_names():  # a file written before the packages moved under one name (strategies.legacy)
        return torch.load(path, map_location="cpu", weights_only=True)  # as Lightning loads checkpoints by default


def _current_names(trainer_state: Mapping[str, Any]) -> dict[str, Any]:
    """``trainer_state`` with the model config's ``_target_`` of an older checkpoint renamed (strategies.legacy)."""
    state = dict(trainer_state)
    if state.get(MODEL_CONFIG_KEY) is not None:
        state[MODEL_CONFIG_KEY] = upgrade_targets(state[MODEL_CONFIG_KEY])
    return state


def read_sharded(path: str | Path, stages: Iterable[int] | None = None,
                 load_trainer_state: Callable[[Path], dict[str, Any]] | None = None) -> FullState:
    """Read a sharded checkpoint: all of a DCP one; of one before DCP the stage files ``stages`` (default: all),
    memory-mapped."""
    path = Path(path)
    meta = read_meta(path)
    if is_dcp(meta):
        return read_dcp(path, meta, load_trainer_state=load_trainer_state)
    wanted = range(len(meta["partition"])) if stages is None else stages
    model: dict[str, Tensor] = {}
    optimizers: list[OptimizerState] = []
    for stage in wanted:
        payload = _load(path / stage_file(stage))
        model.update(payload["model"])
        for i, part in enumerate(payload["optimizers"]):
            if i == len(optimizers):
                optimizers.append(OptimizerState())
            optimizers[i].merge(part)
    if meta.get("optimizer_pieces"):  # a sharded optimizer: every rank's part, the wanted stages' parameters only
        aliases = meta["index"]["aliases"]
        held = {aliases.get(k, k) for k in model}
        for file in sorted((path / "optim").glob("rank*.pt")):
            for i, part in enumerate(_load(file)):
                if i == len(optimizers):
                    optimizers.append(OptimizerState())
                optimizers[i].merge_pieces(part, held.__contains__)
    with old_module_names():
        trainer_state = (load_trainer_state or _load_file)(path / TRAINER_FILE)
    index = meta["index"]
    return FullState(model, optimizers, _current_names(trainer_state), str(path), meta, dict(index["aliases"]))


def is_dcp(meta: Mapping[str, Any]) -> bool:
    """Whether a sharded checkpoint keeps its model and optimizer state in DCP (version 2 on) or in stage files."""
    return int(meta.get("version", 1)) >= DCP_VERSION


def read_dcp(path: str | Path, meta: Mapping[str, Any] | None = None, model_keys: Iterable[str] | None = None,
             optimizer_names: Iterable[str] | None = None, ranges: Mapping[str, tuple[int, int]] | None = None,
             load_trainer_state: Callable[[Path], dict[str, Any]] | None = None) -> FullState:
    """Read a DCP checkpoint: the entries of ``model_keys`` (state-dict keys, any of a parameter's names; default:
    all) and the optimizer state of ``optimizer_names`` (canonical names; default: all), of a name in ``ranges``
    only its flattened elements ``[start, stop)`` (a sharded optimizer's segment). Only those chunks are read."""
    path = Path(path)
    meta = dict(meta if meta is not None else read_meta(path))
    index = ModelIndex.from_dict(meta["index"])
    metadata = dcp_state.read_metadata(path)
    entries = metadata.state_dict_metadata
    if model_keys is None:
        wanted_model = [k for k in entries if k.startswith(dcp_state.MODEL_PREFIX)]
    else:
        wanted_model = sorted({index.canonical(k) for k in model_keys} & entries.keys())
    request: dict[str, Any] = {k: dcp_state.empty_like_entry(metadata, k) for k in wanted_model}
    saved = dcp_state.optimizer_entries(entries)  # optimizer -> name -> its state entries
    wanted_names = None if optimizer_names is None else set(optimizer_names)
    for i, by_name in enumerate(saved):
        request[dcp_state.groups_key(i)] = None
        for name in (by_name if wanted_names is None else wanted_names & by_name.keys()):
            request[dcp_state.group_key(i, name)] = None
            for entry in by_name[name]:
                key = dcp_state.state_key(i, name, entry)
                span = (ranges or {}).get(name)
                if span is not None and dcp_state.per_element_entry(metadata, key):
                    flat = torch.empty(span[1] - span[0], dtype=dcp_state.entry_dtype(metadata, key))
                    request[key] = FlatPiece(dcp_state.entry_shape(metadata, key), span[0], flat)
                else:
                    request[key] = dcp_state.empty_like_entry(metadata, key)
    try:
        loaded = dcp_state.load(request, path)
    except (dcp_state.CheckpointException, OSError, RuntimeError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read: {str(err).strip().splitlines()[-1]}") from err
    optimizers = []
    for i, by_name in enumerate(saved):
        out = OptimizerState(param_groups=[{**hparams, "params": []} for hparams in loaded[dcp_state.groups_key(i)]])
        for name in by_name:
            group = loaded.get(dcp_state.group_key(i, name))
            if group is None:
                continue
            out.param_groups[group]["params"].append(name)
            state = {e: loaded[dcp_state.state_key(i, name, e)] for e in by_name[name]}
            if name in (ranges or {}):
                start = ranges[name][0]  # type: ignore[index]
                shape = dcp_state.entry_shape(metadata, dcp_state.state_key(i, name, next(iter(by_name[name]))))
                pieces = StatePieces(int(torch.Size(shape).numel()), shape)
                pieces.pieces.append((start, {e: v.flat if isinstance(v, FlatPiece) else v for e, v in state.items()}))
                out.state[name] = pieces
            else:
                out.state[name] = state
        optimizers.append(out)
    with old_module_names():
        trainer_state = (load_trainer_state or _load_file)(path / TRAINER_FILE)
    return FullState({k: loaded[k] for k in wanted_model}, optimizers, _current_names(trainer_state), str(path),
                     meta, dict(index.aliases))


def _by_name(packed: Mapping[str, Any], names: Sequence[str]) -> OptimizerState:
    """Torch's positional optimizer state -> state by name (``names[i]`` is position i)."""
    total = sum(len(g["params"]) for g in packed["param_groups"])
    if total != len(names):
        raise CheckpointError(f"the checkpoint's optimizer holds {total} parameters but the model has "
                              f"{len(names)} trainable ones: it was saved from another model or optimizer set-up")
    out = OptimizerState()
    for group in packed["param_groups"]:
        out.param_groups.append({**_group_hparams(group), "params": [names[i] for i in group["params"]]})
    out.state = {names[i]: value for i, value in packed["state"].items()}
    return out


def from_lightning_checkpoint(checkpoint: Mapping[str, Any], source: str, index: ModelIndex | None) -> FullState:
    """A consolidated file, or a plain Lightning checkpoint of the unsplit module (single, DDP)."""
    section = checkpoint.get(PIPELINE_KEY) or {}
    rest = _current_names({k: v for k, v in checkpoint.items()
                           if k not in ("state_dict", "optimizer_states", PIPELINE_KEY, OPTIMIZER_NAMES_KEY)})
    if "state_dict" not in checkpoint:
        raise CheckpointError(f"{source} has no 'state_dict': not a Lightning checkpoint")
    optimizers: list[OptimizerState] = []
    packed_all = checkpoint.get("optimizer_states") or []
    for i, packed in enumerate(packed_all):
        if section:
            names = section["param_names"][i]
        elif checkpoint.get(OPTIMIZER_NAMES_KEY):
            names = [index.canonical(n) if index is not None else n for n in checkpoint[OPTIMIZER_NAMES_KEY][i]]
        elif index is not None:  # one parameter group in module order (files of earlier versions)
            names = list(index.param_order)
        else:  # a plain checkpoint read without the model: its optimizer state cannot be named
            optimizers = []
            break
        optimizers.append(_by_name(packed, names))
    aliases = dict(section.get("aliases") or (index.aliases if index is not None else {}))
    return FullState(dict(checkpoint["state_dict"]), optimizers, rest, source, dict(section.get("meta") or {}), aliases)


def read_checkpoint(path: str | Path, index: ModelIndex | None = None, stages: Iterable[int] | None = None,
                    load_file: Callable[[Path], dict[str, Any]] | None = None) -> FullState:
    """Any checkpoint: a sharded directory (only ``stages`` of it), a consolidated or a plain Lightning file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    load_file = load_file or _load_file
    if path.is_dir():
        return read_sharded(path, stages, load_file)
    with old_module_names():
        checkpoint = load_file(path)
    return from_lightning_checkpoint(checkpoint, str(path), index)



@dataclass(frozen=True)
class SavedCheckpoint:
    """A complete checkpoint as the launcher sees it before resuming (read without its tensors)."""

    path: Path
    sharded: bool
    step: int | None  # the training step it was saved at (its global_step)
    model_config: dict[str, Any] | None  # the Hydra config of the model it holds (old _target_ names upgraded)


def verify_checkpoint(path: str | Path) -> None:
    """Return when ``path`` is a complete, undamaged checkpoint; else raise a :class:`CheckpointError` whose one line
    names the file and what is wrong with it.

    A sharded directory: not a ``.partial`` save, ``meta.json`` readable, every file of its manifest present with
    the size listed (a checkpoint written before the manifest: ``trainer.pt`` and every stage file present), and
    every ``.pt`` file a whole zip archive whose records pass their CRC-32 check. A single file (a baseline's or a
    consolidated checkpoint): a whole zip archive whose records pass their CRC-32 check. Every byte is read once.
    """
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise CheckpointError(f"{path} is a save that did not finish (its name ends in '{PARTIAL_SUFFIX}')")
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        damage = torch_file_damage(path)
        if damage is not None:
            raise CheckpointError(f"{path} is {damage}")
        return
    meta = read_meta(path)
    listed: Mapping[str, int] = meta.get(MANIFEST_KEY) or {}
    parts = [dcp_state.METADATA_FILE] if is_dcp(meta) else list(map(stage_file, range(len(meta["partition"]))))
    required = [TRAINER_FILE, *parts]
    names = list(dict.fromkeys([*required, *listed]))
    missing = [name for name in names if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"{path} is incomplete: it lacks {', '.join(missing)}")
    for name, size in listed.items():
        found = (path / name).stat().st_size
        if found != size:
            raise CheckpointError(f"{path}: {name} has {found} bytes, its {META_FILE} lists {size}"
                                  + (" (cut short)" if found < size else ""))
    if not listed:  # written before the manifest: every torch file there is
        names += [p.relative_to(path).as_posix() for p in sorted(path.rglob("*.pt")) if p.is_file()]
    for name in dict.fromkeys(n for n in names if n.endswith(".pt")):
        damage = torch_file_damage(path / name)
        if damage is not None:
            raise CheckpointError(f"{path}: {name} is {damage}")


def torch_file_damage(path: Path) -> str | None:
    """What is wrong with the torch file ``path``, or None: a zip archive whose central directory torch's own reader
    accepts (it checks more of it than Python's ``zipfile``) and whose every record passes its CRC-32 check."""
    try:
        if not zipfile.is_zipfile(path):
            return "not a complete torch file (a save cut short lacks the zip index at its end)"
        torch._C.PyTorchFileReader(str(path))  # what torch.load opens it with; reads the index, not the records
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except Exception as err:  # a damaged index or header: BadZipFile, RuntimeError (torch), NotImplementedError...
        return f"damaged: {_first_sentence(err)}"
    return None if bad is None else f"damaged: its record {bad} fails its CRC-32 check"


def _first_sentence(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def inspect_checkpoint(path: str | Path) -> SavedCheckpoint:
    """What :class:`SavedCheckpoint` says of ``path``, or a :class:`CheckpointError` when it is not complete
    (:func:`verify_checkpoint`: a ``.partial`` save, a missing or cut file, a damaged torch file) or is no
    Lightning checkpoint.

    The model config comes from ``meta.json``, else (checkpoints written before it held one) from ``trainer.pt`` or
    the file itself, memory-mapped: the tensors are not read.
    """
    path = Path(path)
    verify_checkpoint(path)
    return _inspect_sharded(path) if path.is_dir() else _inspect_file(path)


def _inspect_sharded(path: Path) -> SavedCheckpoint:
    meta = read_meta(path)
    # meta.json holds the model config since it was added there; before, trainer.pt alone did
    config = meta[MODEL_CONFIG_KEY] if MODEL_CONFIG_KEY in meta else _read(path / TRAINER_FILE).get(MODEL_CONFIG_KEY)
    return SavedCheckpoint(path, True, meta.get("global_step"), upgrade_targets(config) if config else None)


def _inspect_file(path: Path) -> SavedCheckpoint:
    checkpoint = _read(path)
    if "state_dict" not in checkpoint:
        raise CheckpointError(f"{path} has no 'state_dict': not a Lightning checkpoint")
    config = checkpoint.get(MODEL_CONFIG_KEY)
    return SavedCheckpoint(path, False, checkpoint.get("global_step"), upgrade_targets(config) if config else None)


def _read(path: Path) -> Mapping[str, Any]:
    """A torch file's dict, memory-mapped; a :class:`CheckpointError` for one that is cut short or unreadable."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a complete torch file (a save cut short lacks the index at its end)")
    try:
        loaded = _load(path)
    except Exception as err:  # torch raises several kinds (RuntimeError, UnpicklingError, EOFError...)
        raise CheckpointError(f"{path} cannot be read: {type(err).__name__}: {err}") from err
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a checkpoint dict")
    return loaded

# -- fitting a checkpoint to the model being trained ------------------------------------------


def select_model_state(full: FullState, local: Mapping[str, Tensor], strict: bool = True) -> dict[str, Tensor]:
    """The entries of ``local``'s keys (this rank's layers), checked against the local shapes."""
    out: dict[str, Tensor] = {}
    missing: list[str] = []
    for key, value in local.items():
        tensor = full.tensor(key)
        if tensor is None:
            missing.append(key)
            continue
        if tensor.shape != value.shape:
            raise CheckpointError(f"{key} has shape {tuple(tensor.shape)} in {full.source} but {tuple(value.shape)} "
                                  "in this model: the checkpoint was saved from another model configuration")
        out[key] = tensor
    if missing and strict:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{full.source} lacks {len(missing)} entries of this model ({shown}): it was saved "
                              "from another model")
    return out


def select_optimizer_state(saved: OptimizerState, optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                           source: str, ranges: Mapping[int, tuple[int, int]] | None = None) -> dict[str, Any]:
    """Torch's positional state dict for ``optimizer`` (this rank's parameters) from state by name.

    ``ranges``: for an optimizer of sharded state, each segment it steps (by id) → the elements ``[start, stop)`` of
    its flattened parameter (``names`` names the segment as its parameter); the segment gets the state of those
    elements, whether the checkpoint holds it whole or in pieces.

    Hyper-parameters (learning rate, betas, ...) come from the checkpoint's group of the same index. A
    checkpoint with one group (saved before the weight-decay groups) fills every group; each keeps its
    own weight decay.
    """
    one_group = len(saved.param_groups) == 1 < len(optimizer.param_groups)
    if len(saved.param_groups) != len(optimizer.param_groups) and not one_group:
        raise CheckpointError(f"{source} has {len(saved.param_groups)} optimizer parameter groups, this optimizer "
                              f"{len(optimizer.param_groups)}: configure_optimizers must build the same groups")
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    position = 0
    for g, group in enumerate(optimizer.param_groups):
        saved_group = saved.param_groups[0 if one_group else g]
        known = set(saved_group["params"])
        ids = []
        for p in group["params"]:
            name = names[id(p)]
            if name not in known:
                raise CheckpointError(f"{source} has no optimizer entry for {name} in parameter group {g}: it was "
                                      "saved with another model or optimizer set-up")
            entry = saved.state.get(name)
            if entry is not None and ranges is not None and id(p) in ranges:
                state[position] = state_range(entry, *ranges[id(p)])
            elif entry is not None:  # copies: the optimizer updates its state in place, not the checkpoint's pages
                state[position] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in whole_state(entry).items()}
            ids.append(position)
            position += 1
        hparams = _group_hparams(saved_group)
        if one_group:
            hparams.pop("weight_decay", None)
        groups.append({**_group_hparams(group), **hparams, "params": ids})
    return {"state": state, "param_groups": groups}


# -- consolidation ----------------------------------------------------------------------------


def consolidate(path: str | Path) -> dict[str, Any]:
    """Merge a sharded checkpoint into one Lightning checkpoint dict of the unsplit model (see the
    module docstring); ``pipeline`` holds the names of the optimizer positions and the source meta."""
    full = read_sharded(path)
    meta = full.meta
    index = ModelIndex.from_dict(meta["index"])
    # every name of every parameter, as the unsplit module's state dict has them
    state_dict = dict(full.model)
    for alias, canonical in index.aliases.items():
        if alias not in state_dict and canonical in state_dict:
            state_dict[alias] = state_dict[canonical]
    order = {name: i for i, name in enumerate(index.param_order)}
    optimizer_states, param_names = [], []
    for saved in full.optimizers:
        names: list[str] = []
        groups = []
        for group in saved.param_groups:
            canon = sorted(dict.fromkeys(index.canonical(n) for n in group["params"]),
                           key=lambda n: (order.get(n, len(order)), n))
            groups.append({**_group_hparams(group), "params": list(range(len(names), len(names) + len(canon)))})
            names.extend(canon)
        state = {i: whole_state(saved.state[n]) for i, n in enumerate(names) if n in saved.state}
        optimizer_states.append({"state": state, "param_groups": groups})
        param_names.append(names)
    return {
        **full.trainer_state,
        "state_dict": state_dict,
        "optimizer_states": optimizer_states,
        PIPELINE_KEY: {"format": CONSOLIDATED_FORMAT, "version": VERSION, "param_names": param_names,
                       "aliases": dict(index.aliases), "meta": meta},
    }


def save_consolidated(path: str | Path, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(consolidate(path), out)
    return out


def model_state(checkpoint: str | Path | FullState, prefix: str = "model.") -> dict[str, Tensor]:
    """The full model's state dict (keys of the pipeline model, ``prefix`` removed) from any checkpoint."""
    full = checkpoint if isinstance(checkpoint, FullState) else read_checkpoint(checkpoint)
    state = dict(full.model)
    for alias, canonical in full.aliases.items():
        if alias not in state and canonical in state:
            state[alias] = state[canonical]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def optimizer_state_by_name(checkpoint: str | Path | FullState, optimizer: int = 0) -> dict[str, dict[str, Any]]:
    """One optimizer's state keyed by canonical parameter name, from any checkpoint."""
    full = checkpoint if isinstance(checkpoint, FullState) else read_checkpoint(checkpoint)
    return {name: whole_state(entry) for name, entry in full.optimizers[optimizer].state.items()}
