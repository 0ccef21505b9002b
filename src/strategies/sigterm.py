"""SIGTERM under a pipeline: every rank stops at the same step, and no step waits for the agreement.

Lightning (2.6) agrees on a SIGTERM with two collectives: before every training step it broadcasts
rank 0's "received SIGTERM" flag over the world and reads it on the host
(``_TrainingEpochLoop._broadcast_sigterm_tensor``), and its signal handler answers that broadcast
from inside the handler, wherever the signalled rank happens to be. Under a pipeline schedule the
first is one more blocking world collective per step, paid in full by the rank that ends every
step (the first stage, GPipe §2 and 1F1B in Chimera §2); the second can fire in the middle of a
step, where the other ranks wait for the signalled rank's activations instead (a hang until the
timeout), and the signalled rank also leaves alone at the end of its step.

:class:`LateSigtermAgreement` replaces both while training runs. Its handler only records the
signal (no collective in a signal handler; Lightning's forwarding of the signal to the processes
its launcher started is kept). Before each step the ranks start an all-reduce (max) of their flags
without waiting, and read the one started before the previous step, long completed by then: when
any rank was signalled, every rank marks the trainer as signalled and raises Lightning's
``SIGTERMException`` before the same step, one step after the signal.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException


class LateSigtermAgreement:
    """The per-step agreement (call it before each step) and the signal handler (:meth:`install_handler`)."""

    def __init__(self, trainer: Any, group: dist.ProcessGroup | None = None) -> None:
        """``group``: a gloo group over the world (``None``: the default group, which must be gloo)."""
        self.trainer, self.group = trainer, group
        self.signalled = False  # this process received SIGTERM
        self._in_flight: tuple[torch.Tensor, dist.Work] | None = None
        self._replaced: tuple[Any] | None = None  # the SIGTERM handler in place before install_handler

    def install_handler(self) -> None:
        """Record SIGTERM instead of Lightning's handler (kept: every other handler it composed)."""
        previous = signal.getsignal(signal.SIGTERM)
        others = [h for h in getattr(previous, "signal_handlers", [previous]) if not self._is_lightnings(h)]

        def on_sigterm(signum: int, frame: Any) -> None:
            if not self.signalled:
                launcher = getattr(self.trainer.strategy, "launcher", None)
                if launcher is not None:  # as Lightning: the processes its launcher started get it too
                    launcher.kill(signum)
            self.signalled = True
            for handler in others:
                if callable(handler):
                    handler(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._replaced = (previous,)

    def _is_lightnings(self, handler: Any) -> bool:
        connector = getattr(self.trainer, "_signal_connector", None)
        return connector is not None and handler == getattr(connector, "_sigterm_notifier_fn", None)

    def __call__(self) -> None:
        flag = torch.tensor([1 if self.signalled else 0])
        posted = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        previous, self._in_flight = self._in_flight, posted
        if previous is not None and self._read(previous):
            self.finish()
            connector = getattr(self.trainer, "_signal_connector", None)
            if connector is not None:
                connector.received_sigterm = True  # what Lightning's own handler would have set
            with contextlib.suppress(Exception):
                dist.barrier(group=self.group)  # as Lightning: every rank leaves together
            raise SIGTERMException()

    def finish(self) -> bool:
        """Wait for the all-reduce in flight (at the end of training: no collective is left behind) and put
        the replaced SIGTERM handler back; whether any rank had been signalled."""
        posted, self._in_flight = self._in_flight, None
        if self._replaced is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._replaced[0])
            self._replaced = None
        return posted is not None and self._read(posted)

    @staticmethod
    def _read(posted: tuple[torch.Tensor, dist.Work]) -> bool:
        flag, work = posted
        work.wait()  # the group's timeout guards it
        return bool(flag.item())


def install_late_sigterm(trainer: Any, timeout: timedelta) -> LateSigtermAgreement | None:
    """Put :class:`LateSigtermAgreement` in place of ``trainer``'s per-step SIGTERM broadcast and
    handler; ``None`` (Lightning's own in place) for one process, off the main thread (no signal
    handler can be set there), or for a Lightning without that method. Every rank calls it."""
    loop = trainer.fit_loop.epoch_loop
    if not (dist.is_initialized() and dist.get_world_size() > 1 and hasattr(loop, "_broadcast_sigterm_tensor")
            and threading.current_thread() is threading.main_thread()):
        return None
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    agreement = LateSigtermAgreement(trainer, group)
    agreement.install_handler()
    loop._broadcast_sigterm_tensor = agreement
    return agreement
