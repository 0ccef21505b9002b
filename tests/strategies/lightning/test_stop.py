"""A stop signal to any rank stops every rank after the same step, with the signal and the rank that received
it agreed, the step reached handed to the checkpoint callbacks, and no collective left in flight
(:mod:`pipeline_recipes.strategies.lightning.stop`). The ranks here are real gloo processes; the trainer is a stand-in
holding what the callback reads and sets."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from distributed import run_world

STEPS = 6


def _trainer() -> SimpleNamespace:
    epoch_loop = SimpleNamespace(_broadcast_sigterm_tensor=lambda: None, min_steps=5)
    return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=epoch_loop, min_epochs=2), global_step=0,
                           should_stop=False, checkpoint_callbacks=[], _signal_connector=SimpleNamespace())


def _stop_run(rank: int, signalled_rank: int, signum: int, signalled_at: int | None
              ) -> tuple[int | None, tuple[int, int, int] | None, bool]:
    """Steps as Lightning runs them (start hook, step, end hook) until the callback sets ``should_stop``; the
    signalled rank signals itself during step ``signalled_at``. Returns the steps done, the agreed request and
    whether the process's handler is back."""
    from pipeline_recipes.core.signals import SignalRecord
    from pipeline_recipes.strategies.lightning.stop import StopOnSignal

    record = SignalRecord()
    record.install()
    before = signal.getsignal(signal.SIGTERM)
    stop = StopOnSignal(record, raise_at_end=False)
    trainer = _trainer()
    stop.on_train_start(trainer, None)
    while trainer.global_step < STEPS and not trainer.should_stop:
        stop.on_train_batch_start(trainer, None, None, 0)
        if rank == signalled_rank and trainer.global_step == signalled_at:
            os.kill(os.getpid(), signum)  # handled: recorded, the step goes on
        trainer.global_step += 1
        stop.on_train_batch_end(trainer, None, None, None, 0)
    stop.on_train_end(trainer, None)
    request = stop.request
    agreed = None if request is None else (request.signum, request.rank, request.step)
    handler_kept = signal.getsignal(signal.SIGTERM) == before
    record.restore()
    assert trainer.fit_loop.min_epochs == (0 if request else 2)  # a stop is not held by min_epochs
    return trainer.global_step, agreed, handler_kept




def _set_up_signal(rank: int, world: int) -> tuple[int, tuple[int, int, int] | None]:
    """Rank 1 received SIGTERM while its stages were built: training stops before its first step."""
    from pipeline_recipes.core.signals import SignalRecord
    from pipeline_recipes.strategies.lightning.stop import StopOnSignal

    record = SignalRecord()
    record.install()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    stop = StopOnSignal(record, raise_at_end=False)
    trainer = _trainer()
    stop.on_train_start(trainer, None)
    record.restore()
    request = stop.request
    return int(trainer.should_stop), None if request is None else (request.signum, request.rank, request.step)


def _cases(rank: int, world: int) -> list:
    return [_stop_run(rank, 0, signal.SIGTERM, 1), _stop_run(rank, world - 1, signal.SIGUSR1, 3),
            _stop_run(rank, 1, signal.SIGINT, None), _set_up_signal(rank, world)]


@pytest.mark.slow
def test_every_rank_stops_after_the_same_step_one_step_after_the_signal() -> None:
    """Rank 0 signalled during step 2 (global_step 1 → 2): the flag posted before step 3 carries it, read after
    step 3, so all stop after step 3; the last rank during step 4: all stop after step 5; no signal: all 6
    steps; rank 1 signalled while its stages were built: all stop before the first step."""
    results = run_world(2, _cases)
    expected = [(3, (signal.SIGTERM, 0, 3), True), (5, (signal.SIGUSR1, 1, 5), True), (STEPS, None, True),
                (1, (signal.SIGTERM, 1, 0))]
    assert results == [expected] * 2


def test_one_process_stops_after_the_step_it_was_signalled_in() -> None:
    from pipeline_recipes.core.signals import SignalRecord
    from pipeline_recipes.strategies.lightning.stop import StopOnSignal

    record = SignalRecord()
    record.install()
    try:
        stop, trainer = StopOnSignal(record, raise_at_end=False), _trainer()
        stop.on_train_start(trainer, None)
        for step in range(STEPS):
            stop.on_train_batch_start(trainer, None, None, step)
            if step == 2:
                os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: recorded
            trainer.global_step += 1
            stop.on_train_batch_end(trainer, None, None, None, step)
            if trainer.should_stop:
                break
    finally:
        record.restore()
    assert (trainer.global_step, stop.request.signum, stop.request.rank) == (3, signal.SIGINT, 0)


def test_the_record_keeps_the_first_signal_and_calls_the_handlers_it_replaced() -> None:
    from pipeline_recipes.core.signals import SignalRecord

    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    record = SignalRecord()
    try:
        record.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        record.restore()
        restored = signal.getsignal(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, previous)
    assert record.signum == signal.SIGUSR1 and seen == [signal.SIGUSR1]
    assert callable(restored) and restored is not record.handler
