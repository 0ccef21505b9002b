"""A stop signal ends training cleanly: every rank stops after the same step, the step reached is saved.

A scheduler stops a job with a signal: SLURM sends SIGTERM before it ends or preempts a job (and
``--signal=USR1@<s>`` before its time limit), a user presses Ctrl-C (SIGINT). Lightning (2.6) answers
SIGTERM alone, with a collective broadcast inside its signal handler — wherever the signalled rank
happens to be, so under a pipeline schedule the others wait for its activations instead (a hang until
the timeout) — plus one blocking broadcast before every step, paid in full by the rank that ends every
pipeline step (GPipe §2, 1F1B in Chimera §2). Its ``SIGTERMException`` then leaves without a checkpoint,
and, a ``SystemExit`` without a code, exits 0: a scheduler reads the stop as success.

:class:`StopOnSignal` replaces that while training runs:

* :class:`~pipeline_recipes.core.signals.SignalRecord`'s handler only records the signal (no collective, no exception in a handler);
* before each step every rank starts an all-reduce (max) of what it recorded, without waiting, and
  reads it when the step has ended (long completed by then): when any rank was signalled, every rank
  learns the same signal and rank after the same step — one step after the signal at most;
* then the checkpoint callbacks save the step reached (:func:`save_step_reached`: Lightning's
  ``ModelCheckpoint``, with its naming and ``save_top_k``), and ``trainer.should_stop`` ends training
  the ordinary way: ``on_train_end`` runs (figures, ``results.json``), then teardown.

Without a stop request the callback costs one small all-reduce per step that nothing waits for.
A process exits ``128 + signal number`` after a stop (:mod:`pipeline_recipes.core.exits`, as a shell
reports a process the signal ended), never 0.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from pipeline_recipes.core.exits import signal_name, stopped
from pipeline_recipes.core.signals import STOP_SIGNALS, SignalRecord
from pipeline_recipes.core.timeouts import COLLECTIVE_TIMEOUT_S
from typing_extensions import override


@dataclass(frozen=True)
class StopRequest:
    """The signal every rank agreed to stop on, the (lowest) rank that received it and the step after
    which training stopped."""

    signum: int
    rank: int
    step: int

    @property
    def name(self) -> str:
        return signal_name(self.signum)

    def describe(self) -> str:
        return f"{self.name} received by rank {self.rank}; stopped after step {self.step}"


class StopRequested(SIGTERMException):
    """Raised at the end of ``fit`` after a stop (library use, :class:`StopOnSignal` with ``raise_at_end``):
    a ``SystemExit`` whose code is 128 + the signal's number, so an uncaught stop exits non-zero."""

    def __init__(self, request: StopRequest) -> None:
        super().__init__(stopped(request.signum))
        self.request = request


class StopOnSignal(Callback):
    """Stop every rank after the same step when any rank receives SIGTERM, SIGINT or SIGUSR1 (see the module
    docstring). ``record``: a :class:`SignalRecord` installed at process start (a signal that came during
    set-up stops training before its first step); None installs one while training runs.
    ``raise_at_end``: raise :class:`StopRequested` after ``on_train_end`` (what a script that calls ``fit``
    gets by default); a caller reading :attr:`request` itself passes False."""

    def __init__(self, record: SignalRecord | None = None, raise_at_end: bool = True,
                 timeout: timedelta = timedelta(seconds=COLLECTIVE_TIMEOUT_S)) -> None:
        self.record, self._own_record = record, record is None
        self.raise_at_end, self.timeout = raise_at_end, timeout
        self.request: StopRequest | None = None
        self._group: dist.ProcessGroup | None = None
        self._rank, self._world = 0, 1
        self._in_flight: tuple[torch.Tensor, dist.Work] | None = None
        self._replaced: dict[int, Any] = {}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.record is None:
            self.record = SignalRecord()
        if self._own_record:
            self.record.install()
        elif threading.current_thread() is threading.main_thread():  # over Lightning's, for the run only
            self._replaced = {s: signal.getsignal(s) for s in STOP_SIGNALS}
            for signum in STOP_SIGNALS:
                signal.signal(signum, self.record.handler)
        loop = trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):  # Lightning's blocking per-step broadcast: agreed here
            loop._broadcast_sigterm_tensor = lambda: None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
            if dist.get_backend() != "gloo":  # a host-side group: the flag never waits on the device
                self._group = dist.new_group(backend="gloo", timeout=self.timeout)
            self._post()  # a signal during set-up: agreed before the first step, which then does not run
            self._agree(trainer, self._take())
        elif self.record.received:
            self._agree(trainer, (self.record.signum, 0))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._world > 1 and self.request is None:
            self._post()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.request is not None:
            return
        if self._world > 1:
            agreed = self._take()
        else:
            agreed = (self.record.signum, 0) if self.record is not None and self.record.received else None
        if agreed is not None:
            self._agree(trainer, agreed)
            save_step_reached(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()
        if self.request is not None and self.raise_at_end:
            trainer._signal_connector.received_sigterm = self.request.signum == signal.SIGTERM
            raise StopRequested(self.request)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish(wait=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._finish(wait=False)

    # -- the agreement ----------------------------------------------------------------------------

    def _encoded(self) -> int:
        """0, or 1 + signal · world + (world − 1 − rank): the max over ranks is the highest signal number,
        received by the lowest rank that received it."""
        signum = self.record.signum if self.record is not None else None
        return 0 if signum is None else 1 + signum * self._world + (self._world - 1 - self._rank)

    def _post(self) -> None:
        flag = torch.tensor([self._encoded()], dtype=torch.int64)
        self._in_flight = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True))

    def _take(self) -> tuple[int, int] | None:
        """Wait for the all-reduce in flight (the group's timeout guards it) and decode it: the agreed
        (signal, rank), or None."""
        posted, self._in_flight = self._in_flight, None
        if posted is None:
            return None
        flag, work = posted
        work.wait()
        value = int(flag.item())
        if value == 0:
            return None
        signum, index = divmod(value - 1, self._world)
        return signum, self._world - 1 - index

    def _agree(self, trainer: pl.Trainer, agreed: tuple[int, int] | None) -> None:
        if agreed is None:
            return
        self.request = StopRequest(*agreed, step=trainer.global_step)
        trainer.should_stop = True
        fit_loop = trainer.fit_loop  # a stop is not an early stop: min_steps / min_epochs do not hold it
        fit_loop.min_epochs = 0
        fit_loop.epoch_loop.min_steps = 0

    def _finish(self, wait: bool = True) -> None:
        posted, self._in_flight = self._in_flight, None
        if posted is not None and wait:
            with contextlib.suppress(Exception):
                posted[1].wait()
        if self._replaced and threading.current_thread() is threading.main_thread():
            for signum, previous in self._replaced.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            self._replaced = {}
        if self._own_record and self.record is not None:
            self.record.restore()


def save_step_reached(trainer: pl.Trainer) -> None:
    """Every ``ModelCheckpoint`` of ``trainer`` saves the step reached unless it just did, as its periodic
    saves do (same name pattern, same ``save_top_k`` and ``save_last`` handling; Lightning's own
    ``save_on_exception`` path), and waits until it is written (also when saves run in the background). A
    collective: every rank calls it."""
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback._last_global_step_saved == trainer.global_step:
            continue
        candidates = callback._monitor_candidates(trainer)
        callback._save_topk_checkpoint(trainer, candidates)
        callback._save_last_checkpoint(trainer, candidates)
    writer = getattr(getattr(trainer, "strategy", None), "writer", None)
    if writer is not None:  # a background save (checkpoint.async_save): the step reached is on disk before the stop
        writer.wait()
