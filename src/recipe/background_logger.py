"""W&B logging off the training step's critical path.

``wandb``'s ``Run.log`` blocks until W&B's own I/O thread has handed the record to the W&B service:
about 1 ms per call on a busy 2-core host, most of it waiting for that thread to be scheduled. Only
rank 0 logs, and under a pipeline schedule rank 0 holds the first stage, whose last backward ends
every step (GPipe §2, and 1F1B in Chimera §2): each call there delays every rank's next step.

:class:`BackgroundWandbLogger` is Lightning's ``WandbLogger`` whose ``log_metrics`` calls go to one
writer thread, in call order (W&B's steps stay monotonic). Every other use of the run goes through
``experiment`` (hyper-parameters, the summary, images, ``wandb.finish``), which first waits until
the writer has written everything queued, so the run sees the same records in the same order as
with the plain logger. A failed write is raised on the training thread by the next logger call or
by ``finalize``; no wait is unbounded (``drain_timeout_s``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

_STOP = object()


class BackgroundWandbLogger(WandbLogger):
    """``WandbLogger`` (same arguments) writing metrics from a background thread; see the module docstring."""

    def __init__(self, *args: Any, drain_timeout_s: float = 300.0, **kwargs: Any) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        self.drain_timeout_s = float(drain_timeout_s)
        super().__init__(*args, **kwargs)

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
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_rows, name="wandb-writer", daemon=True)
            self._writer.start()
        self._queue.put((convert_tensors_to_scalars(dict(metrics)), step))

    def drain(self) -> None:
        """Wait until the writer has written every queued row; raise what a write raised."""
        pending = self._queue
        with pending.all_tasks_done:
            if not pending.all_tasks_done.wait_for(lambda: pending.unfinished_tasks == 0,
                                                   timeout=self.drain_timeout_s):
                raise TimeoutError(f"the W&B writer thread wrote nothing for {self.drain_timeout_s:.0f} s with "
                                   f"{pending.unfinished_tasks} rows queued (logger.drain_timeout_s)")
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
            self._writer = None

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.stop()
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
