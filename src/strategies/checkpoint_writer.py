"""Checkpoint saves in the foreground or in the background, one at a time, each one timed.

In the background (``checkpoint.async_save=true``) a save is what torchtitan's asynchronous checkpointing and DCP's
``async_save`` do: the training thread stages the state (copies of the tensors in host memory, the RNG states, the
trainer state) and goes on training while a worker thread writes it. At most one save is in flight: the next save,
a stop and the end of training wait for it, each wait bounded. The worker's collectives (DCP's planning, the
agreement on failures) run on a process group of their own, so they never interleave with the training thread's.

A failed background save (a full disk) leaves the checkpoints already written as they were (the save's
``.partial`` directory is removed) and is raised in the training thread at its next step boundary
(:meth:`CheckpointWriter.raise_if_failed`). Work that must wait for a save to be complete (removing the checkpoint it
replaces) runs after it (:meth:`CheckpointWriter.after_save`), and never if it failed.

This module needs torch only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline_recipes.strategies.dcp_state import FlatPiece


@dataclass
class SaveRecord:
    """One save, as ``results.json`` lists it (``checkpoint_saves``): the step saved, how long the training thread
    was held (waiting for the previous save, staging, and for a foreground save the writing), the time from the
    save's start until its files were complete, and the checkpoint's bytes on disk."""

    step: int
    blocking_s: float
    write_s: float | None = None
    bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def staged(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` whose tensors (and :class:`FlatPiece` slices) live in host memory of their own, so that
    training may change the originals while the copy is written."""

    def copy(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value.detach().to("cpu", copy=True)
        if isinstance(value, FlatPiece):
            return FlatPiece(value.shape, value.offset, copy(value.flat))
        return value

    return {k: copy(v) for k, v in state.items()}


def any_rank(failed: bool, group: dist.ProcessGroup) -> bool:
    """Whether any rank of ``group`` says ``failed`` (a collective: every rank of it calls)."""
    flag = torch.tensor([int(failed)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class CheckpointWriter:
    """Runs each save (a callable that writes one checkpoint and returns its path) in the foreground, or with
    ``background`` in a worker thread, one at a time; ``timeout_s`` bounds every wait for a save in flight."""

    def __init__(self, background: bool = False, timeout_s: float = 600.0) -> None:
        self.background, self.timeout_s = background, timeout_s
        self.saves: list[SaveRecord] = []
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer") if background else None
        self._future: Future[Path] | None = None
        self._path: Path | None = None
        self._lock = threading.Lock()
        self._after: list[Callable[[Path], None]] = []  # run once the save in flight is written
        self._written: Path | None = None  # the last background save, once written (None while in flight)
        self._failed = False  # the last background save failed (its error raised)

    def save(self, step: int, path: str | Path, write: Callable[[], Path], started: float) -> None:
        """Write one checkpoint (``write``), staged by the caller since ``started`` (``time.perf_counter()``,
        taken before it waited for the previous save: :meth:`wait`)."""
        record = SaveRecord(step, 0.0)
        self.saves.append(record)

        def run() -> Path:
            saved = write()
            record.write_s = time.perf_counter() - started
            record.bytes = directory_bytes(saved) if saved.is_dir() else saved.stat().st_size
            with self._lock:
                after, self._after, self._written = self._after, [], saved
            for work in after:
                work(saved)
            return saved

        if self._executor is None:
            run()
        else:
            with self._lock:
                self._written, self._failed = None, False
            self._path, self._future = Path(path), self._executor.submit(run)
        record.blocking_s = time.perf_counter() - started

    def in_flight(self) -> bool:
        return self._future is not None and not self._future.done()

    def after_save(self, work: Callable[[Path], None]) -> bool:
        """After the last background save: run ``work(its path)`` once it is written (now if it is; never if it
        fails) and return True. Without one (foreground saves, or none yet) return False: the caller does the
        work now."""
        with self._lock:
            if self._failed:
                return True  # never after a failed save
            if self._future is None:
                return False
            written = self._written
            if written is None:
                self._after.append(work)
                return True
        work(written)
        return True

    def wait(self) -> None:
        """Wait for the save in flight (at most ``timeout_s``) and raise its error, if it failed."""
        future = self._future
        if future is None or (future.done() and future.exception() is None):
            return
        try:
            future.result(timeout=self.timeout_s)
        except FutureTimeout as err:
            self._future = None
            raise TimeoutError(f"the background save of {self._path} did not finish within {self.timeout_s:.0f} s "
                               "(checkpoint.async_save): a rank's write is stuck or slow") from err
        except BaseException:
            self._future, self._failed = None, True  # its error is raised once
            raise

    def raise_if_failed(self) -> None:
        """Raise the error of a background save that has failed; return at once otherwise."""
        if self._future is not None and self._future.done() and self._future.exception() is not None:
            self.wait()

    def close(self) -> None:
        """Wait for the save in flight and stop the worker thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
