"""Stop signals, recorded: the handler a training process runs instead of dying or raising mid-step.

SLURM sends SIGTERM before it ends or preempts a job (and the signal of ``--signal=<sig>@<s>`` before its time
limit, USR1 by convention), a user presses Ctrl-C (SIGINT), ``timeout`` sends SIGTERM. A process that records
them (:class:`SignalRecord`) can stop at the next step boundary with its work saved
(:mod:`pipeline_recipes.strategies.lightning.stop`). No torch here: a worker installs it before its slow imports.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class SignalRecord:
    """Records the first stop signal this process receives (the handler does nothing else).

    :meth:`install` puts the handler in place of the current ones for ``STOP_SIGNALS`` (main thread
    only), keeping handlers of others that were there (called after recording: e.g. a job scheduler's
    client logging the signal) but not Python's ``KeyboardInterrupt`` nor Lightning's SIGTERM handlers;
    :meth:`restore` puts back what :meth:`install` replaced.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._chained: dict[int, list[Callable[[int, FrameType | None], Any]]] = {}
        self._replaced: dict[int, Any] = {}

    @property
    def received(self) -> bool:
        return self.signum is not None

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        for other in self._chained.get(signum, []):
            other(signum, frame)

    def install(self, signals: Iterable[int] = STOP_SIGNALS) -> bool:
        """Handle ``signals`` here, then take those that were held back (:func:`held_back`) until now; False
        (nothing done) off the main thread, where no handler can be set."""
        if threading.current_thread() is not threading.main_thread():
            return False
        signals = tuple(signals)
        for signum in signals:
            previous = signal.getsignal(signum)
            self._replaced.setdefault(signum, previous)
            self._chained.setdefault(signum, [h for h in _handlers_in(previous) if self._keeps(h)])
            signal.signal(signum, self.handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        return True

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._replaced.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._replaced = {}

    def _keeps(self, handler: Any) -> bool:
        if not callable(handler) or handler is signal.default_int_handler:
            return False
        if isinstance(getattr(handler, "__self__", None), SignalRecord):  # this one, or one it takes over from
            return False
        owner = type(getattr(handler, "__self__", None)).__name__
        return owner != "_SignalConnector"  # Lightning's notifier broadcasts inside the handler


@contextmanager
def held_back(signals: Iterable[int] = STOP_SIGNALS) -> Iterator[None]:
    """Hold ``signals`` back in this thread while the block runs: one that arrives is pending, not lost, and is
    handled when the block ends. A child process started inside the block starts with them held back too (the
    signal mask survives ``fork`` and ``exec``) and takes them once :meth:`SignalRecord.install` has put its
    handler in place: a stop signal sent to a worker that is still starting is never its death."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, tuple(signals))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_EARLY: list[SignalRecord] = []  # train.py's record of the signals before its launcher's own (install_early)


def install_early() -> None:
    """Record stop signals from the first line of ``train.py`` on, before its imports and Hydra's set-up, where a
    signal would otherwise end the process without a word (:func:`early_signal` hands it to the launcher)."""
    if not _EARLY:
        record = SignalRecord()
        if record.install():
            _EARLY.append(record)


def early_signal() -> int | None:
    """The stop signal recorded since :func:`install_early` (None if none), handed over once: the launcher's own
    record takes over from here."""
    signum = _EARLY[0].signum if _EARLY else None
    if _EARLY:
        _EARLY[0].signum = None
    return signum


def _handlers_in(handler: Any) -> list[Any]:
    """The handlers a composed handler calls (Lightning's ``_HandlersCompose``), or the handler itself."""
    return list(getattr(handler, "signal_handlers", [handler]))



PARENT_PID_ENV = "PIPELINE_LAUNCHER_PID"  # set by train.py for the workers it starts
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGKILL when the process that started this one (``parent_pid``) dies (Linux's
    ``PR_SET_PDEATHSIG``), and exit at once if it is already gone: a worker never outlives its launcher."""
    import ctypes
    import os

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's handlers and its final kill remain
        return
    if os.getppid() != parent_pid:
        os._exit(128 + signal.SIGKILL)
