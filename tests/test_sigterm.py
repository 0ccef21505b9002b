"""SIGTERM under a pipeline strategy: every rank stops at the same step, the step after any rank was
signalled (rank 0 or another), with Lightning's trainer marked as signalled; nothing is left in flight."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

from distributed import run_world


def _steps_until_stop(rank: int, signalled_rank: int, signalled_at: int) -> tuple[int | None, bool, bool]:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from pipeline_recipes.strategies.sigterm import LateSigtermAgreement

    connector = SimpleNamespace(received_sigterm=False)
    trainer = SimpleNamespace(_signal_connector=connector, strategy=SimpleNamespace(launcher=None))
    agreement = LateSigtermAgreement(trainer)
    agreement.install_handler()
    try:
        for step in range(6):
            if rank == signalled_rank and step == signalled_at:
                os.kill(os.getpid(), signal.SIGTERM)  # handled: the process goes on
            try:
                agreement()
            except SIGTERMException:
                return step, agreement.finish(), connector.received_sigterm
        return None, agreement.finish(), connector.received_sigterm
    finally:
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the replaced handler is back


def _cases(rank: int, world: int) -> list[tuple[int | None, bool, bool]]:
    return [_steps_until_stop(rank, 0, 2), _steps_until_stop(rank, world - 1, 3), _steps_until_stop(rank, 1, 5)]


def test_every_rank_stops_one_step_after_a_signal() -> None:
    # rank 0 signalled before step 2: all stop before step 3; the last rank before step 3: all before step 4;
    # a signal before the last step: only finish() sees it
    assert run_world(3, _cases) == [[(3, False, True), (4, False, True), (None, True, False)]] * 3
