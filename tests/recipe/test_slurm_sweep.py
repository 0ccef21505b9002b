"""A sweep point whose SLURM job ended without a result (``scancel``) is recorded as stopped and the sweep goes on to
its summary, instead of ending with submitit's ``UncompletedJobError``.

The launcher is handed stand-in jobs that raise submitit's own exceptions, as ``Job.results()`` does for a job that
wrote no result (``tests/e2e/test_slurm_jobs.py`` runs a real sweep on a private SLURM cluster)."""

from __future__ import annotations

import time

from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus

from pipeline_recipes.core import exits
from pipeline_recipes.recipe.report.results import read_results, write_results
from pipeline_recipes.recipe.report.sweep import record_unfinished, sweep_results, sweep_verdict

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
from submitit.core.utils import FailedJobError, UncompletedJobError  # noqa: E402

from hydra_plugins.pipeline_recipes_slurm.launcher import SlurmLauncher  # noqa: E402


def _point(sweep: Path, num: int, **values: object) -> Path:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    if values:
        write_results(job, **values)
    return job


def test_a_cancelled_point_is_stopped_and_keeps_what_its_results_said(tmp_path: Path) -> None:
    job = _point(tmp_path, 1, status="running", strategy="dapple", loss_history=[6.9, 6.5, 6.1], global_step=3)
    result = record_unfinished(job, "42_1", "CANCELLED by 0")
    assert result.status == "stopped"
    assert result.reason == "cancelled by SLURM (scancel): job 42_1, state CANCELLED by 0; its results.json said running at step 3"
    assert read_results(job) == result and result.loss_history == (6.9, 6.5, 6.1) and result.strategy == "dapple"


def test_a_point_stopped_by_its_own_signal_handler_is_stopped_with_its_reason(tmp_path: Path) -> None:
    own = "SIGTERM received by rank 0; stopped after step 5"
    job = _point(tmp_path, 0, status="stopped", reason=own, global_step=5)
    assert record_unfinished(job, "42_0", "CANCELLED by 0").reason == (
        f"cancelled by SLURM (scancel): job 42_0, state CANCELLED by 0; its results.json said stopped at step 5: {own}")


def test_a_point_cancelled_while_pending_is_recorded_and_found_by_the_summary(tmp_path: Path) -> None:
    _point(tmp_path, 0, status="ok", final_loss=6.0)
    record_unfinished(tmp_path / "1", "42_1", "CANCELLED by 0")  # it never ran: no directory of its own
    results = sweep_results(tmp_path)
    assert [(r.status, r.path.parent.name) for r in results] == [("ok", "0"), ("stopped", "1")]
    assert results[1].reason.endswith("it wrote no results.json (it never started, or ended before writing one)")
    assert sweep_verdict(results) == (
        exits.FAILED, "error: sweep: 1 of 2 points did not train to the end (1 stopped)")


def test_a_lost_job_is_failed_and_an_ok_point_stays_ok(tmp_path: Path) -> None:
    lost = record_unfinished(_point(tmp_path, 0, status="running"), "7", "NODE_FAIL")
    assert (lost.status, lost.reason) == ("failed", "SLURM job 7 ended without a result (state NODE_FAIL); its "
                                                    "results.json said running")
    done = _point(tmp_path, 1, status="ok", final_loss=5.5)
    assert record_unfinished(done, "8", "CANCELLED by 0").status == "ok"


@dataclass
class _Job:
    """What the launcher reads of a submitit job."""

    job_id: str
    state: str
    error: Exception | None = None
    finished: bool = True  # submitit knows how it ended (its result, or sacct's state)

    def done(self) -> bool:
        return self.finished

    def results(self) -> list[JobReturn]:
        if self.error is not None:
            raise self.error
        return [JobReturn(overrides=["strategy=gpipe"], status=JobStatus.COMPLETED, _return_value=6.0)]


def _launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SlurmLauncher:
    launcher = SlurmLauncher()
    monkeypatch.setattr(launcher, "job_dir", lambda overrides, num: tmp_path / str(num))
    return launcher


def test_the_launcher_records_a_cancelled_point_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    launcher = _launcher(tmp_path, monkeypatch)
    _point(tmp_path, 1, status="running", global_step=2)
    cancelled = _Job("42_1", "CANCELLED by 0", UncompletedJobError(
        "Job 42_1 (task: 0) with path x has not produced any output (state: CANCELLED by 0)"))
    ret = launcher.fetch(cancelled, ["strategy=dapple"], 1)
    assert ret.status == JobStatus.COMPLETED and ret.return_value is None  # Hydra's sweeper goes on
    assert ret.working_dir == str(tmp_path / "1")
    assert read_results(tmp_path / "1").status == "stopped"
    said = capsys.readouterr().err
    assert "sweep point #1 (strategy=dapple): stopped: cancelled by SLURM (scancel): job 42_1" in said
    assert launcher.fetch(_Job("42_0", "COMPLETED"), ["strategy=gpipe"], 0).return_value == 6.0


def test_a_point_whose_function_raised_still_ends_the_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _launcher(tmp_path, monkeypatch)
    with pytest.raises(FailedJobError):
        launcher.fetch(_Job("9", "FAILED", FailedJobError("Job (task=0) failed during processing")), [], 0)
    assert not (tmp_path / "0").exists()



def test_a_job_slurm_no_longer_lists_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit never learns how a job cancelled while pending ended (sacct lists no such array task): the wait ends
    once SLURM's queue no longer lists it, at once for a job that never started, after the grace for its result to
    appear for one that ran; a job still listed is waited for."""
    from hydra_plugins.pipeline_recipes_slurm import launcher as module

    answers = iter([(True, False, "PENDING"), (False, False, "CANCELLED by 0")])
    monkeypatch.setattr(module, "slurm_job", lambda job_id: next(answers))
    pending = _Job("42_2", "UNKNOWN", finished=False)
    assert module.wait_listed(pending, poll_s=0.0) == "CANCELLED by 0"
    ran = iter([(False, True, "CANCELLED by 0")] * 1000)
    monkeypatch.setattr(module, "slurm_job", lambda job_id: next(ran))
    start = time.monotonic()
    assert module.wait_listed(_Job("42_1", "UNKNOWN", finished=False), poll_s=0.01, grace_s=0.2) == "CANCELLED by 0"
    assert time.monotonic() - start >= 0.2
    assert module.wait_listed(_Job("42_0", "COMPLETED"), poll_s=0.0) is None  # submitit has its result
