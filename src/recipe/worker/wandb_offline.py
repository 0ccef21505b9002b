"""Read an offline W&B run (``run-*.wandb``) without network or a W&B server.

wandb 0.31 writes no ``wandb-summary.json`` offline: everything lives in the run's ``.wandb``
file, a LevelDB-style log (7-byte file header, 32 KiB blocks, records of ``crc32 | length |
type``) of ``wandb_internal_pb2.Record`` messages. This reads the run's name, group, job type,
tags, config, summary and history, so tests and ``scripts/compare.py`` users can inspect offline runs. A run whose
service was killed (a signal to the job reaches it too) or is still writing reads up to its last whole record.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    path: Path
    name: str = ""
    group: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


def _records(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (missing ':W&B' header)")
    out, pending, pos = [], b"", _HEADER
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left - 7
            continue
        if pos + length > len(data):  # still being written (W&B's service writes on after finish() returns)
            break
        pending += data[pos:pos + length]
        pos += length
        if kind in (_FULL, _LAST):
            out.append(pending)
            pending = b""
    return out


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_offline_run(path: str | Path) -> OfflineRun:
    """Parse one ``run-*.wandb`` file (or the ``offline-run-*`` directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = next(path.glob("run-*.wandb"))
    run = OfflineRun(path)
    for raw in _records(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.name, run.group, run.job_type = record.run.display_name, record.run.run_group, record.run.job_type
            run.tags = list(record.run.tags)
            run.config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run.config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "summary":
            run.summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
    return run


def find_offline_runs(root: str | Path) -> list[OfflineRun]:
    """Every offline run under ``root`` (e.g. a multirun directory), in path order."""
    return [read_offline_run(p) for p in sorted(Path(root).rglob("offline-run-*/run-*.wandb"))]
