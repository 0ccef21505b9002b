"""A pipeline's model and optimizer state in torch.distributed.checkpoint (DCP), under names no layout changes.

One logical state dict, keyed by the unsplit model's names, which every rank saves its part of and any rank of any
other layout reads its part from (``dcp.load`` with the keys, and for sharded optimizer state the element ranges, it
needs)::

    model.layers.3.block.attn.c_attn.weight          the LightningModule's state-dict key (canonical name of a
                                                     tied parameter; its aliases are in meta.json's index)
    optimizer.0.state.<parameter name>.exp_avg       per-element state, shaped like the parameter
    optimizer.0.state.<parameter name>.step          scalar state, as the optimizer keeps it
    optimizer.0.param_groups                         the groups' hyper-parameters (a list, without parameters)
    optimizer.0.group.<parameter name>               the index of the parameter's group

A tensor held by several ranks (the W replicas, Chimera's down and up copy of a stage, the tied embedding on the
first and the last stage) is one entry, written once: DCP's planner deduplicates write items of the same key and
offset. With ``strategy.shard_optimizer`` each rank holds a slice of each parameter's flattened state; it saves the
slice as the rectangular chunks of the parameter's shape the slice covers (:func:`flat_range_boxes`), so the saved
entry is the whole parameter's state, whoever held which part, and DCP checks that the chunks of all ranks cover it
exactly once. Reading asks for any element range the same way.

This module needs torch only; saving is a collective over the process group given (None: the default group),
loading reads without collectives (``no_dist``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["CheckpointException", "FlatPiece", "flat_range_boxes", "load", "read_metadata", "save"]

METADATA_FILE = ".metadata"  # DCP's own index, written last by the coordinator: all ranks' parts are on disk
MODEL_PREFIX = "model."


def optimizer_key(optimizer: int, *parts: str) -> str:
    return ".".join([f"optimizer.{optimizer}", *parts])


def state_key(optimizer: int, name: str, entry: str) -> str:
    return optimizer_key(optimizer, "state", name, entry)


def group_key(optimizer: int, name: str) -> str:
    return optimizer_key(optimizer, "group", name)


def groups_key(optimizer: int) -> str:
    return optimizer_key(optimizer, "param_groups")


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a rectangular chunk


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The rectangular chunks of a row-major tensor of ``shape`` that make up its flattened elements
    ``[start, stop)``, in order: each chunk is itself a contiguous run of the flattened tensor (at most
    2·len(shape) − 1 of them)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    (row, col), (end_row, end_col) = divmod(start, inner), divmod(stop, inner)
    if row == (stop - 1) // inner:  # inside one row
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(rest, col, stop - row * inner)]
    boxes: list[Box] = []
    if col:  # the first row's tail
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(rest, col, inner)]
        row += 1
    if end_row > row:  # whole rows
        boxes.append(((row, *(0,) * len(rest)), (end_row - row, *rest)))
    if end_col:  # the last row's head
        boxes += [((end_row, *o), (1, *s)) for o, s in flat_range_boxes(rest, 0, end_col)]
    return boxes


@dataclass(frozen=True)
class FlatPiece:
    """Elements ``[offset, offset + flat.numel())`` of a logical tensor of ``shape`` flattened: a rank's slice of a
    parameter's optimizer state, or (loading) the range a rank asks for, read into ``flat``."""

    shape: tuple[int, ...]
    offset: int
    flat: Tensor

    def boxes(self) -> list[tuple[Box, Tensor]]:
        """Each chunk of :func:`flat_range_boxes` with the view of ``flat`` holding it."""
        out, cursor = [], 0
        for offsets, sizes in flat_range_boxes(self.shape, self.offset, self.offset + self.flat.numel()):
            n = math.prod(sizes)
            out.append(((offsets, sizes), self.flat[cursor:cursor + n].view(sizes)))
            cursor += n
        return out

    def box_at(self, offsets: Iterable[int]) -> Tensor:
        wanted = tuple(offsets)
        for (box_offsets, _), view in self.boxes():
            if box_offsets == wanted:
                return view
        raise KeyError(f"no chunk at {wanted}")


def _pieces_apart(state_dict: dict[str, Any]) -> tuple[dict[str, FlatPiece], dict[str, Any]]:
    """The :class:`FlatPiece` entries of ``state_dict`` (this module's planners chunk them) and the others (DCP's)."""
    pieces = {k: v for k, v in state_dict.items() if isinstance(v, FlatPiece)}
    return pieces, {k: v for k, v in state_dict.items() if k not in pieces}


class _PieceSavePlanner(DefaultSavePlanner):
    """DCP's default planner, plus :class:`FlatPiece` entries written as chunks of their logical tensor."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces: dict[str, FlatPiece] = {}

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.pieces, rest = _pieces_apart(state_dict)
        super().set_up_planner(rest, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                               properties=TensorProperties.create_from_tensor(view), size=torch.Size(piece.shape)))
                 for fqn, piece in self.pieces.items() for (offsets, sizes), view in piece.boxes()]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        piece = self.pieces.get(write_item.index.fqn)
        if piece is None:
            return super().resolve_data(write_item)
        return piece.box_at(write_item.index.offset)


class _PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, plus :class:`FlatPiece` entries read from the chunks of their logical tensor; other
    objects (hyper-parameters) are unpickled with ``weights_only=True``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces: dict[str, FlatPiece] = {}

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.pieces, rest = _pieces_apart(state_dict)
        super().set_up_planner(rest, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items: list[ReadItem] = []
        for fqn, piece in self.pieces.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for (o, s), _ in piece.boxes()]
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn],  # type: ignore[union-attr]
                                                      chunks)
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        piece = self.pieces.get(index.fqn)
        if piece is None:
            return super().lookup_tensor(index)
        return piece.box_at(index.offset)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def save(state: Mapping[str, Any], path: str | Path, process_group: dist.ProcessGroup | None = None) -> None:
    """Write every rank's ``state`` (tensors, :class:`FlatPiece` slices, small picklable objects) as one DCP
    checkpoint in ``path``; a collective over ``process_group``. Raises DCP's ``CheckpointException`` on every rank
    when any rank's write failed."""
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True, overwrite=True)
    dcp.save(dict(state), storage_writer=writer, planner=_PieceSavePlanner(), process_group=process_group)


def read_metadata(path: str | Path) -> Metadata:
    return dcp.FileSystemReader(path).read_metadata()


def empty_like_entry(metadata: Metadata, key: str) -> Tensor:
    """An uninitialised tensor of the saved entry's shape and dtype, to read it into."""
    return torch.empty(entry_shape(metadata, key), dtype=entry_dtype(metadata, key))


def optimizer_entries(entries: Mapping[str, Any]) -> list[dict[str, list[str]]]:
    """Per optimizer saved, each parameter name with a group entry → the names of its saved state entries."""
    out: list[dict[str, list[str]]] = []
    for key in entries:
        head, _, rest = key.partition(".")
        if head != "optimizer":
            continue
        number, _, rest = rest.partition(".")
        kind, _, rest = rest.partition(".")
        i = int(number)
        while len(out) <= i:
            out.append({})
        if kind == "group":
            out[i].setdefault(rest, [])
        elif kind == "state":
            name, _, entry = rest.rpartition(".")
            out[i].setdefault(name, []).append(entry)
    return out


def entry_shape(metadata: Metadata, key: str) -> tuple[int, ...]:
    return tuple(_tensor_metadata(metadata, key).size)


def entry_dtype(metadata: Metadata, key: str) -> torch.dtype:
    return _tensor_metadata(metadata, key).properties.dtype


def per_element_entry(metadata: Metadata, key: str) -> bool:
    """A state entry with one value per parameter element (Adam's moments), not a scalar (its step)."""
    md = metadata.state_dict_metadata.get(key)
    return isinstance(md, TensorStorageMetadata) and len(md.size) > 0


def _tensor_metadata(metadata: Metadata, key: str) -> TensorStorageMetadata:
    md = metadata.state_dict_metadata[key]
    if not isinstance(md, TensorStorageMetadata):
        raise TypeError(f"{key} is saved as an object, not a tensor")
    return md


def load(request: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """Read the entries ``request`` names into its tensors and :class:`FlatPiece` ranges (in place); other values
    are replaced by what was saved. Reads only those chunks of the files; no collective."""
    planner = _PieceLoadPlanner()
    with warnings.catch_warnings():  # no_dist is meant: each rank reads its own keys
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(request, storage_reader=dcp.FileSystemReader(path), planner=planner, no_dist=True)
    return {**request, **{k: v for k, v in planner.state_dict.items() if k in request}}
