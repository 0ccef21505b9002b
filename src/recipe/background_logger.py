"""W&B logging off the training step's critical path.

``wandb``'s ``Run.log`` blocks until W&B's own I/O thread has handed the record to the W&B service:
about 1 ms per call on a busy 2-core host, most of it waiting for that thread to be scheduled. Only
rank 0 logs, and under a pipeline schedule rank 0 holds the first stage, whose last backward ends
every step (GPipe §2, and 1F1B in Chimera §2): each call there delays every rank's next step.

:class:`BackgroundWandbLogger` is Lightning's ``WandbLogger`` whose ``log_metrics`` calls go to one
writer thread, in call order (W&B's steps stay monotonic). Every other use of the run through the
logger's ``experiment`` (hyper-parameters, the summary) first waits until the writer has written
everything queued, so the run sees the same records in the same order as with the plain logger
(images go through ``log_metrics``: queued in order too). Code that calls ``wandb`` directly
(``wandb.finish()``) calls :meth:`BackgroundWandbLogger.stop` first. A failed write is raised on the
training thread by the next logger call or by ``finalize`` after a successful run; no wait is
unbounded (``drain_timeout_s``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

from .settings import check_drain_timeout

_STOP = object()


class BackgroundWandbLogger(WandbLogger):
    """``WandbLogger`` (same arguments) writing metrics from a background thread; see the module docstring."""

    def __init__(self, *args: Any, drain_timeout_s: float = 300.0, **kwargs: Any) -> None:
        self.drain_timeout_s = check_drain_timeout(drain_timeout_s)
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous", "unset") is None:
            # Lightning passes anonymous=None when not asked for and wandb (0.31) warns about any value given
            # ("The anonymous setting has no effect"): an unset one is not passed at all.
            del self._wandb_init["anonymous"]

    @property
    @override
    def experiment(self) -> Any:
        """The W&B run, once every queued row is written (from the writer itself: at once)."""
        if self._writer is not None and threading.current_thread() is not self._writer:
            self.drain()
        return super().experiment

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._raise_write_error()
        if self._experiment is None:
            _ = self.experiment  # the run starts on the training thread (wandb.init installs signal handlers)
        if self._writer is None:  # one writer at a time (stop() keeps a writer that did not end)
            self._writer = threading.Thread(target=self._write_rows, name="wandb-writer", daemon=True)
            self._writer.start()
        self._queue.put((convert_tensors_to_scalars(dict(metrics)), step))

    def drain(self) -> None:
        """Wait until the writer has written every queued row (at most ``drain_timeout_s``); raise what a
        write raised."""
        pending = self._queue
        # bounded even where the waiting thread interrupted its own put() (a signal handler finalising)
        if not pending.mutex.acquire(timeout=self.drain_timeout_s):
            raise TimeoutError(f"the W&B row queue stayed locked for {self.drain_timeout_s:.0f} s "
                               "(logger.drain_timeout_s)")
        try:
            if not pending.all_tasks_done.wait_for(lambda: pending.unfinished_tasks == 0,
                                                   timeout=self.drain_timeout_s):
                raise TimeoutError(f"{pending.unfinished_tasks} W&B rows were still queued after waiting "
                                   f"{self.drain_timeout_s:.0f} s for the writer thread (logger.drain_timeout_s)")
        finally:
            pending.mutex.release()
        self._raise_write_error()

    def stop(self) -> None:
        """Drain and end the writer thread (a later ``log_metrics`` starts a new one)."""
        writer = self._writer
        if writer is None:
            return
        try:
            self.drain()
        finally:
            self._queue.put(_STOP)
            writer.join(timeout=self.drain_timeout_s)
            if not writer.is_alive():
                self._writer = None

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        """After training the queued rows are written (a failed write raises); after a failure Lightning
        finalises with another status while the error propagates: a logger error must not replace it."""
        try:
            if status == "success":
                self.stop()
            else:
                try:
                    self.stop()
                except Exception as error:  # noqa: BLE001 - reported, not raised over the run's own error
                    rank_zero_warn(f"W&B rows may be missing: {error}")
        finally:
            super().finalize(status)

    @override
    def __getstate__(self) -> dict[str, Any]:
        self.stop()
        state = super().__getstate__()
        for key in ("_queue", "_writer", "_write_error"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._queue, self._writer, self._write_error = queue.Queue(), None, None

    def _raise_write_error(self) -> None:
        error, self._write_error = self._write_error, None
        if error is not None:
            raise RuntimeError(f"writing metrics to the W&B run failed: {error!r}") from error

    def _write_rows(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if self._write_error is None:  # after a failure, drop rows until the training thread hears of it
                    super().log_metrics(*item)
            except BaseException as error:  # noqa: BLE001 - handed to the training thread
                self._write_error = error
            finally:
                self._queue.task_done()
