"""Lightning's SIGTERM agreement read one step late: every rank stops at the same step, the step after
rank 0 was signalled, and no broadcast is left in flight."""

from __future__ import annotations

from types import SimpleNamespace

from distributed import run_world


def _steps_until_stop(rank: int, signalled_at: int) -> tuple[int | None, bool]:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from pipeline_recipes.strategies.sigterm import LateSigtermAgreement

    trainer = SimpleNamespace(received_sigterm=False)
    agreement = LateSigtermAgreement(trainer)
    for step in range(8):
        if rank == 0 and step == signalled_at:
            trainer.received_sigterm = True  # what Lightning's signal handler sets, on rank 0 only here
        try:
            agreement()
        except SIGTERMException:
            return step, agreement.finish()
    return None, agreement.finish()


def _cases(rank: int, world: int) -> list[tuple[int | None, bool]]:
    return [_steps_until_stop(rank, 3), _steps_until_stop(rank, 7)]


def test_every_rank_stops_one_step_after_the_signal() -> None:
    # signalled before step 3: all stop at step 4; before the last step: only finish() sees it
    assert run_world(3, _cases) == [[(4, False), (None, True)]] * 3
