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
(``wandb.finish()``) calls :meth:`BackgroundWandbLogger.stop` first: :func:`finish_wandb` does both. A failed
write is raised on the training thread by the next logger call or by ``finalize`` after a successful run (unless
it says the backend is gone, below); no wait is unbounded (``drain_timeout_s``).

A logger never decides how a job ends. W&B writes through a service process of its own (``wandb-core``), and a
scheduler's signal reaches it as well as the ranks (SLURM signals every process of a job step): once it is gone,
every call that needs it fails (:func:`backend_gone`). The first such failure, wherever it shows (a queued row,
the hyper-parameters, the summary, ``finalize``, ``wandb.finish()``), is one warning line
(:func:`lose_backend`); the logger then logs nothing more for the rest of the run, and training, its stop and
``results.json`` (rank 0's metrics, :mod:`pipeline_recipes.recipe.worker.metrics`, which need no logger) go on as if it had
not been there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

from pipeline_recipes.recipe.check.settings import check_drain_timeout

_STOP = object()
_HANDLED = object()  # finish_wandb: the exception being handled where it is called
LOST_ATTRIBUTE = "_backend_lost"  # on a logger whose backend is gone: why (the warning said it once)
LOST_WAIT_S = 10.0  # the longest wait for W&B (the writer, wandb.finish, its teardown) once its service is gone
# wandb 0.31's errors for a connection to its service that closed (named: their modules are internal)
GONE_ERRORS = frozenset({"MailboxClosedError", "HandleAbandonedError", "WandbAttachFailedError",
                         "WandbServiceConnectionError", "WandbServiceNotOwnedError"})
CONNECTION_LOST_NOTICE = "socket.send() raised exception."  # asyncio's, for writes to a socket whose peer is gone
SHOW_INFO = "WANDB_SHOW_INFO"  # wandb 0.31's setting show_info: whether it prints its information lines


def _not_a_lost_connection(record: logging.LogRecord) -> bool:
    return record.getMessage() != CONNECTION_LOST_NOTICE


def quiet_lost_connection_notices() -> None:
    """Drop asyncio's ``socket.send() raised exception.``: wandb talks to its service through asyncio (the only
    asyncio socket of a training process), and once that service is gone (a signal reached it) every queued write
    logs it, before and besides :func:`lose_backend`'s one warning."""
    logger = logging.getLogger("asyncio")
    if _not_a_lost_connection not in logger.filters:
        logger.addFilter(_not_a_lost_connection)


def quiet_wandb_info() -> None:
    """W&B prints none of its information lines: its banner at ``wandb.init`` and, at ``wandb.finish``, its history
    and summary panels and its sync advice (34 lines an offline run; the figures are in the run and ``results.json``);
    its warnings and errors still print. :func:`finish_wandb` says where the run is, and how to upload it, in one
    line (:func:`run_location`). Called before the run starts, in a job's process only (wandb reads the setting
    once, when it sets itself up); ``WANDB_SHOW_INFO=true`` in the environment keeps W&B's own lines."""
    os.environ.setdefault(SHOW_INFO, "false")


def run_location(run: Any) -> str | None:
    """One line for W&B's run ``run``: an offline one's directory and the command that uploads it, a live one's
    address and local copy; None where the run cannot tell (its settings unreadable)."""
    try:
        sync_dir, offline = run.sync_dir, run.offline
        url = None if offline else run.url
    except Exception:  # noqa: BLE001 - a run that cannot say where it is gets no line, never an error
        return None
    if offline or not url:
        return f"wandb: offline run in {sync_dir}; upload it with: wandb sync {sync_dir}"
    return f"wandb: run at {url} (local copy in {sync_dir})"


def service_exited() -> bool | None:
    """Whether this process's W&B service (``wandb-core``) has exited; None where that cannot be told (no service
    started here, or a wandb whose internals are not 0.31's)."""
    try:
        from wandb.sdk import wandb_setup

        return wandb_setup._singleton._connection._proc._process.poll() is not None  # noqa: SLF001
    except Exception:  # noqa: BLE001 - unknown is an answer
        return None


def backend_gone(error: BaseException) -> bool:
    """Whether ``error`` says the logger's backend is gone: a lost connection to W&B's service anywhere in its chain
    (the socket's ``ConnectionError``, ``EOFError``, or wandb's closed-mailbox errors, :data:`GONE_ERRORS`), or any
    error once that service process has exited. A ``KeyboardInterrupt`` or ``SystemExit`` is never one."""
    if not isinstance(error, Exception):
        return False
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, (ConnectionError, EOFError)) or type(link).__name__ in GONE_ERRORS:
            return True
        link = link.__cause__ or link.__context__
    return service_exited() is True


def lost(logger: Any) -> str | None:
    """Why ``logger`` stopped logging (its backend is gone), None while it logs."""
    return getattr(logger, LOST_ATTRIBUTE, None)


def lose_backend(logger: Any, error: BaseException) -> None:
    """``logger``'s backend is gone: say so in one warning line, the first time only, and mark it so that it logs
    nothing more (:func:`lost`)."""
    if lost(logger) is not None:
        return
    reason = f"{type(error).__name__}: {error}".rstrip(": ")
    setattr(logger, LOST_ATTRIBUTE, reason)
    name = type(logger).__name__
    print(f"warning: {name} stopped logging for the rest of the run, its backend is gone ({reason}; a signal to "
          "the job reaches W&B's service too): the job goes on, its metrics are in results.json and the log",
          file=sys.stderr, flush=True)


@contextlib.contextmanager
def backend_failures_warned(logger: Any) -> Iterator[None]:
    """Inside it, an error saying ``logger``'s backend is gone (:func:`backend_gone`) is :func:`lose_backend`'s
    warning instead; any other error is raised."""
    try:
        yield
    except Exception as error:
        if not backend_gone(error):
            raise
        lose_backend(logger, error)


def call_bounded(call: Callable[[], Any], timeout_s: float, what: str) -> BaseException | None:
    """Run ``call`` in a daemon thread for at most ``timeout_s``: None if it returned, else what it raised, or a
    ``TimeoutError`` naming ``what`` if it had not returned in time (it is left running; daemon threads end with the
    process)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - returned to the caller (sys.exit included)
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, name=f"bounded-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return TimeoutError(f"{what} did not return within {timeout_s:g} s")
    return outcome[0]


class BackgroundWandbLogger(WandbLogger):
    """``WandbLogger`` (same arguments) writing metrics from a background thread; see the module docstring."""

    def __init__(self, *args: Any, drain_timeout_s: float = 300.0, **kwargs: Any) -> None:
        self.drain_timeout_s = check_drain_timeout(drain_timeout_s)
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        quiet_lost_connection_notices()
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous", "unset") is None:
            # Lightning passes anonymous=None when not asked for and wandb (0.31) warns about any value given
            # ("The anonymous setting has no effect"): an unset one is not passed at all.
            del self._wandb_init["anonymous"]

    @property
    @override
    def experiment(self) -> Any:
        """The W&B run, once every queued row is written (from the writer itself: at once)."""
        if self._writer is not None and threading.current_thread() is not self._writer and lost(self) is None:
            self.drain()
        return super().experiment

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._raise_write_error()
        if lost(self) is not None:
            return
        if self._experiment is None:
            _ = self.experiment  # the run starts on the training thread (wandb.init installs signal handlers)
        if self._writer is None:  # one writer at a time (stop() keeps a writer that did not end)
            self._writer = threading.Thread(target=self._write_rows, name="wandb-writer", daemon=True)
            self._writer.start()
        self._queue.put((convert_tensors_to_scalars(dict(metrics)), step))

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        if lost(self) is None:
            with backend_failures_warned(self):
                super().log_hyperparams(params)

    @override
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        if lost(self) is None:
            with backend_failures_warned(self):
                super().after_save_checkpoint(checkpoint_callback)

    def drain(self) -> None:
        """Wait until the writer has written every queued row (at most ``drain_timeout_s``); raise what a
        write raised (a write that found the backend gone: :func:`lose_backend`). Once the backend is gone the
        writer drops what is queued: nothing to wait for."""
        if lost(self) is not None:
            self._write_error = None
            return
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
            # once the backend is gone the writer may be inside a call to it: not worth the whole drain timeout
            writer.join(timeout=self.drain_timeout_s if lost(self) is None
                        else min(self.drain_timeout_s, LOST_WAIT_S))
            if not writer.is_alive():
                self._writer = None

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        """After training the queued rows are written (a failed write raises); after a failure Lightning
        finalises with another status while the error propagates: a logger error must not replace it. A
        backend that is gone is a warning either way."""
        try:
            if status == "success":
                self.stop()
            else:
                try:
                    self.stop()
                except Exception as error:  # noqa: BLE001 - reported, not raised over the run's own error
                    rank_zero_warn(f"W&B rows may be missing: {error}")
        finally:
            if lost(self) is None:
                with backend_failures_warned(self):
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
        if error is None:
            return
        if backend_gone(error):
            lose_backend(self, error)
            return
        raise RuntimeError(f"writing metrics to the W&B run failed: {error!r}") from error

    def _write_rows(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                # after a failure, drop rows until the training thread hears of it; once the backend is gone, all
                if self._write_error is None and lost(self) is None:
                    super().log_metrics(*item)
            except BaseException as error:  # noqa: BLE001 - handed to the training thread
                self._write_error = error
            finally:
                self._queue.task_done()


def finish_wandb(loggers: Sequence[Any], run_error: BaseException | None | object = _HANDLED) -> None:
    """Rank 0's end of the job's W&B run (one per job), whether or not training raised (``run_error``; by default
    the exception being handled where it is called, so in a ``finally:`` the one that ended the run): each
    background writer stopped, then ``wandb.finish()``, every wait bounded (the loggers' ``drain_timeout_s``;
    :data:`LOST_WAIT_S` once the service is gone), then W&B's teardown (its service's end, which its exit hook would
    wait for without a bound). A service that is gone or does not answer in time is :func:`lose_backend`'s one
    warning; another error of ``wandb.finish()`` is raised only after a run that raised nothing itself. Then one line
    says where the run is and how to upload it (:func:`run_location`, in place of W&B's own block:
    :func:`quiet_wandb_info`)."""
    if run_error is _HANDLED:
        run_error = sys.exc_info()[1]
    wandb_loggers = [lg for lg in loggers if isinstance(lg, WandbLogger)]
    if not wandb_loggers:
        return
    import wandb  # local: wandb 0.5-0.9 s (python -X importtime), only for runs logging to W&B

    for logger in wandb_loggers:  # rows still queued, whether or not Lightning finalised the logger
        if isinstance(logger, BackgroundWandbLogger):
            with contextlib.suppress(Exception):  # never hide the error that ended the run
                logger.stop()
    gone = next((lg for lg in wandb_loggers if lost(lg) is not None), None)
    location = run_location(wandb.run) if wandb.run is not None else None  # before finish() lets it go
    limits = [lg.drain_timeout_s for lg in wandb_loggers if isinstance(lg, BackgroundWandbLogger)]
    limit = LOST_WAIT_S if gone is not None else max(limits, default=300.0)
    error = call_bounded(wandb.finish, limit, "wandb.finish()")  # one W&B run per job
    raised = None
    if error is not None and (gone is not None or isinstance(error, TimeoutError) or backend_gone(error)):
        lose_backend(gone or wandb_loggers[0], error)
    elif isinstance(error, Exception) and run_error is None:
        raised = error  # a W&B error that is not its service gone: raised, once W&B has been torn down
    elif error is not None:
        print(f"warning: wandb.finish() failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    # wandb's exit hook ends its service, waiting without a bound, and meets a dead one again (a traceback at
    # exit): it runs here instead, bounded; what it raises (SystemExit: the service's own exit status) is W&B's
    gone = next((lg for lg in wandb_loggers if lost(lg) is not None), None)
    error = call_bounded(wandb.teardown, LOST_WAIT_S if gone is not None else limit, "wandb.teardown()")
    if error is not None and not (isinstance(error, SystemExit) and not error.code):
        lose_backend(gone or wandb_loggers[0], error)
    if location is not None:
        print(location, flush=True)
    if raised is not None:
        raise raised
