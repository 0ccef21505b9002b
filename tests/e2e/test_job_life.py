"""A job through a cluster's life: stops at any moment, two jobs for one directory, a requeue after the end.

Real ``train.py`` jobs (2 gloo ranks, DAPPLE on a tiny GPT-2, the default logger where it matters), side by side:

* SIGTERM then SIGINT one second later (a scheduler's notice, then an impatient user): still a stop (143), with the
  checkpoint of the step reached; a stop signal while the ranks start, or during the checks before launch: a stop,
  never a rank's failure, with ``results.json`` saying so;
* a second job for a directory a live job holds is refused before launch (exit 2) naming the holder; a requeued
  instance of the same SLURM job waits for its previous run, then resumes from that run's stop checkpoint;
* a job whose newest checkpoint is at ``trainer.max_steps`` ends at once with ``ok`` and exit 0, its history kept.

No process is left behind by any of them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from pipeline_recipes.recipe.report.results import read_results

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"HF_HUB_OFFLINE": "1",
                                                                            "PYTHONUNBUFFERED": "1"}
STEPS = 40
COMMON = ["trainer=cpu", "model=gpt2-tiny", "strategy=dapple", "strategy.D=2", f"trainer.max_steps={STEPS}",
          "data.global_batch_size=8", "trainer.log_every_n_steps=1", "metrics.progress_interval_s=0",
          "strategy.timeout_s=60", "checkpoint.every_n_steps=100"]
ENDLESS = "trainer.max_steps=100000"  # a job that trains until it is stopped
HOST = socket.gethostname()

pytestmark = pytest.mark.slow


class Job:
    """One ``train.py`` job in ``run_dir``; ``env``: variables over :data:`ENV` (a SLURM job id, say)."""

    def __init__(self, run_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.dir = run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        keys = {a.split("=", 1)[0] for a in args}
        common = [a for a in COMMON if a.split("=", 1)[0] not in keys]  # an argument replaces the common one
        self.log = run_dir.parent / f"{run_dir.name}-{len(list(run_dir.parent.glob(run_dir.name + '-*.out')))}.out"
        with open(self.log, "w") as out:  # a file, not a pipe: a job that prints for long never blocks on it
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *common,
                                          *args], cwd=run_dir.parent, env={**ENV, **(env or {})}, text=True,
                                         stdout=out, stderr=subprocess.STDOUT)
        self.output, self.last_line = "", ""
        self.seen: set[int] = set()  # every worker process seen

    def workers(self) -> list[psutil.Process]:
        try:
            found = [c for c in psutil.Process(self.proc.pid).children()
                     if "pipeline_recipes.recipe.worker" in " ".join(c.cmdline())]
        except psutil.Error:
            return []
        self.seen.update(p.pid for p in found)
        return found

    def trained_steps(self) -> int:
        log = self.dir / "logs" / "rank0.log"
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("step ")] \
            if log.exists() else []
        return int(lines[-1].split()[1].split("/")[0]) if lines else 0

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def finish(self, timeout: float = 60) -> None:
        self.proc.wait(timeout=timeout)
        self.output = self.log.read_text(errors="replace")
        self.last_line = self.output.strip().splitlines()[-1] if self.output.strip() else ""

    def left_running(self) -> list[int]:
        return [pid for pid in self.seen if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (``SigCgt`` of ``/proc/<pid>/status``)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught >> (signum - 1) & 1)


def wait_until(condition: Callable[[], bool], jobs: list[Job], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for job in jobs:
            job.workers()
        if time.monotonic() > deadline:
            raise AssertionError("the jobs did not reach the expected state in time: "
                                 + "; ".join(f"{j.dir.name}: rc {j.proc.poll()}, step {j.trained_steps()}" for j in jobs))
        time.sleep(0.05)


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("life")
    jobs: dict[str, Job] = {}
    try:
        jobs["twice"] = Job(root / "twice", ENDLESS)  # the default logger (W&B, offline)
        jobs["starting"] = Job(root / "starting", "logger=none")
        jobs["holder"] = Job(root / "holder", "logger=none", ENDLESS, env={"SLURM_JOB_ID": "4242"})
        jobs["ctrl_c_twice"] = Job(root / "ctrl_c_twice", "logger=none", ENDLESS)
        every = list(jobs.values())
        wait_until(lambda: bool(jobs["starting"].workers()), every)
        jobs["starting"].signal(signal.SIGTERM)  # as the ranks start: before their handlers are in place
        jobs["prelaunch"] = Job(root / "prelaunch", "logger=none")
        wait_until(lambda: catches(jobs["prelaunch"].proc.pid, signal.SIGTERM), every)  # its first line has run
        jobs["prelaunch"].signal(signal.SIGTERM)  # train.py is importing and checking: seconds before any rank
        wait_until(lambda: all(jobs[n].trained_steps() >= 3 for n in ("twice", "holder", "ctrl_c_twice")), every)
        jobs["twice"].signal(signal.SIGTERM)
        jobs["ctrl_c_twice"].signal(signal.SIGINT)
        time.sleep(0.05)
        jobs["ctrl_c_twice"].signal(signal.SIGINT)
        time.sleep(1.0)
        jobs["twice"].signal(signal.SIGINT)
        jobs["racer"] = Job(root / "holder", "logger=none")  # a copy-pasted hydra.run.dir
        jobs["requeued"] = Job(root / "holder", "logger=none", ENDLESS, "ckpt_path=auto", env={"SLURM_JOB_ID": "4242"})
        every = list(jobs.values())
        # the racer imports and checks beside four training jobs on two cores: minutes on a loaded machine
        wait_until(lambda: jobs["racer"].proc.poll() is not None, every)
        jobs["racer"].finish()
        wait_until(lambda: "waiting up to" in jobs["requeued"].log.read_text(errors="replace"),
                   every)  # the requeued run has passed its checks and waits for the lock
        jobs["holder"].signal(signal.SIGTERM)  # the previous run stops; the requeued one takes over
        wait_until(lambda: jobs["holder"].proc.poll() is not None, every, timeout=200)
        jobs["holder"].finish()
        stopped_at = read_results(jobs["holder"].dir).global_step
        wait_until(lambda: jobs["requeued"].trained_steps() >= stopped_at + 2, every, timeout=200)
        jobs["requeued"].signal(signal.SIGTERM)
        wait_until(lambda: all(j.proc.poll() is not None for j in jobs.values()), every, timeout=200)
        for job in jobs.values():
            if not job.output:
                job.finish()
    finally:
        for job in jobs.values():
            if job.proc.poll() is None:
                job.proc.kill()
    return jobs


def _stop_checkpoint(job: Job) -> Path:
    res = read_results(job.dir)
    checkpoint = job.dir / "checkpoints" / f"step-{res.global_step:06d}.ckpt"
    assert res.last_checkpoint == str(checkpoint) and (checkpoint / "meta.json").is_file(), res
    return checkpoint


def test_a_second_signal_during_a_stop_keeps_it_a_stop(ended: dict[str, Job]) -> None:
    job = ended["twice"]
    assert job.proc.returncode == 143, job.output[-3000:]
    res = read_results(job.dir)
    assert res.status == "stopped" and res.reason.startswith(
        f"SIGTERM received by train.py (pid {job.proc.pid}), forwarded to every rank; stopped after step "), res.reason
    assert res.global_step >= 3 and len(res.loss_history) == res.global_step
    checkpoint = _stop_checkpoint(job)
    assert "train.py: SIGINT during the stop of SIGTERM: the ranks go on saving the step reached" in job.output
    assert job.last_line.startswith("stopped: SIGTERM received by train.py") and str(checkpoint) in job.last_line
    assert "killed by SIGKILL" not in job.output and "error:" not in job.last_line
    assert not job.left_running()


def test_a_second_ctrl_c_cuts_the_stop_short_and_says_what_it_skipped(ended: dict[str, Job]) -> None:
    job = ended["ctrl_c_twice"]
    assert job.proc.returncode == 130, job.output[-3000:]
    res = read_results(job.dir)
    assert res.status == "stopped" and "SIGINT again cut the stop short " in res.reason, res.reason
    saved = "after the step reached was saved" in res.reason
    if saved:
        _stop_checkpoint(job)
    else:  # cut before the stop's save: the newest periodic checkpoint on disk (every 100 steps), if any, is named
        periodic = sorted((job.dir / "checkpoints").glob("step-*.ckpt"))
        named = str(periodic[-1]) if periodic else "none"
        assert f"before the step reached was saved (newest checkpoint: {named})" in res.reason, res.reason
        assert res.last_checkpoint == (None if named == "none" else named)
    assert job.last_line.startswith("stopped: SIGINT received by train.py") and "killed by" not in job.output
    assert not job.left_running()


def test_a_signal_while_the_ranks_start_is_a_stop_not_a_rank_failure(ended: dict[str, Job]) -> None:
    job = ended["starting"]
    assert job.proc.returncode == 143, job.output[-3000:]
    res = read_results(job.dir)
    assert res.status == "stopped" and "killed by" not in job.output, job.output[-3000:]
    assert job.last_line.startswith("stopped: SIGTERM received by train.py"), job.last_line
    assert len(job.seen) == 2 and not job.left_running()


def test_a_signal_before_launch_writes_results_and_exits_143(ended: dict[str, Job]) -> None:
    job = ended["prelaunch"]
    assert job.proc.returncode == 143, job.output[-3000:]
    res = read_results(job.dir)
    assert res.status == "stopped" and res.reason == (
        f"SIGTERM received by train.py (pid {job.proc.pid}) before launch; nothing ran"), res.reason
    assert job.last_line == f"stopped: {res.reason}" and "Traceback" not in job.output
    assert not (job.dir / "logs").exists() and not job.seen


def test_a_second_job_for_a_held_directory_is_refused_naming_the_holder(ended: dict[str, Job]) -> None:
    racer, holder = ended["racer"], ended["holder"]
    assert racer.proc.returncode == 2, racer.output[-3000:]
    assert racer.last_line.startswith(f"error: hydra.run.dir={holder.dir} is in use by another job (host {HOST}, "
                                      f"pid {holder.proc.pid}, started "), racer.last_line
    assert "SLURM job 4242" in racer.last_line and not racer.seen


def test_a_requeued_job_waits_for_its_previous_run_and_resumes_from_its_stop(ended: dict[str, Job]) -> None:
    holder, requeued = ended["holder"], ended["requeued"]
    assert holder.proc.returncode == 143, holder.output[-3000:]
    assert f"waiting up to 160 s for the previous run of SLURM job 4242 (host {HOST}, pid {holder.proc.pid}" \
        in requeued.output
    assert requeued.proc.returncode == 143, requeued.output[-3000:]
    stopped_at = int(holder.output.split("stopped after step ")[-1].split(";")[0])
    assert f"ckpt_path=auto: resuming from {holder.dir / 'checkpoints' / f'step-{stopped_at:06d}.ckpt'}" \
        in requeued.output
    res = read_results(requeued.dir)  # the requeued run's stop: its history continues the previous run's
    assert res.status == "stopped" and res.global_step >= stopped_at + 2 and len(res.loss_history) == res.global_step
    assert not holder.left_running() and not requeued.left_running()


def test_a_damaged_save_is_skipped_and_a_finished_job_stays_finished(tmp_path: Path) -> None:
    """Saves after steps 2 and 4, then step 4's largest ``.distcp`` part cut to half its size (a copy or a write that stopped
    half-way): given explicitly it is refused before any rank starts (exit 2, the file named); ``ckpt_path=auto``
    skips it in one line, resumes from step 2 and ends with the first run's losses; run again, the job finds its
    newest checkpoint at ``trainer.max_steps`` and ends at once with ``ok``. The sizes come from ``os.stat``."""
    run_dir, settings = tmp_path / "job", ("logger=none", "trainer.max_steps=4", "checkpoint.every_n_steps=2",
                                           "checkpoint.keep=all")
    first = Job(run_dir, *settings)
    first.finish(timeout=300)
    assert first.proc.returncode == 0, first.output[-3000:]
    history = read_results(run_dir).loss_history
    checkpoints = run_dir / "checkpoints"
    intact, damaged = checkpoints / "step-000002.ckpt", checkpoints / "step-000004.ckpt"
    part = max(damaged.glob("*.distcp"), key=lambda f: f.stat().st_size)  # a rank's part of the DCP state
    full = os.stat(part).st_size
    part.write_bytes(part.read_bytes()[:full // 2])
    reason = f"{part.name} has {full // 2} bytes, its meta.json lists {full} (cut short)"

    copies = tmp_path / "copy" / "checkpoints"  # given explicitly by another job while ``auto`` resumes beside it
    shutil.copytree(checkpoints, copies)
    given = Job(tmp_path / "other", *settings, f"ckpt_path={copies / damaged.name}")
    auto = Job(run_dir, *settings, "ckpt_path=auto")
    given.finish(timeout=120)
    assert given.proc.returncode == 2, given.output[-3000:]
    assert (f"error: ckpt_path={copies / damaged.name}: {reason}; the newest complete checkpoint in {copies} is "
            f"{intact.name}") in given.output.splitlines() and "Traceback" not in given.output
    assert not (tmp_path / "other" / "logs").exists() and not given.seen  # no rank started

    auto.finish(timeout=300)
    assert auto.proc.returncode == 0, auto.output[-3000:]
    assert f"ckpt_path=auto: resuming from {intact} (step 2); skipped {damaged.name}: {reason}" in \
        auto.output.splitlines()
    assert read_results(run_dir).loss_history == history  # resumed exactly: the same steps 3 and 4

    again = Job(run_dir, *settings, "ckpt_path=auto")
    again.finish(timeout=120)
    assert again.proc.returncode == 0, again.output[-3000:]
    res = read_results(run_dir)
    assert res.status == "ok" and res.reason == (f"nothing left to do: {damaged} is at step 4, trainer.max_steps "
                                                 "= 4; raise trainer.max_steps to train on")
    assert res.loss_history == history and res.global_step == 4 and res.final_loss == history[-1]
    assert again.last_line == f"done: {res.reason} ({run_dir})" and not again.seen
