"""One job per job directory (``recipe/launch/run_lock.py``), with real processes holding the lock: a second job is refused
naming the holder, a killed holder leaves no stale lock, and a requeued SLURM job waits for its previous run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_recipes.core.fixes import ConfigError
from pipeline_recipes.recipe.launch.run_lock import LOCK_FILE, RunDirBusy, RunLock, read_holder

HOLD = """
import os, sys, time
from pipeline_recipes.recipe.launch.run_lock import RunLock
lock = RunLock(sys.argv[1])
lock.acquire(os.environ, 0)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holder(directory: Path, seconds: float, slurm_job: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    if slurm_job:
        env["SLURM_JOB_ID"] = slurm_job
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), str(seconds)], env=env, text=True,
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_job_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = _holder(tmp_path, 30)
    try:
        with pytest.raises(RunDirBusy) as refused:
            RunLock(tmp_path).acquire({}, wait_s=10)
        message = str(refused.value)
        assert message.startswith(f"hydra.run.dir={tmp_path} is in use by another job (host {socket.gethostname()}, "
                                  f"pid {holder.pid}, started ")
        assert message.endswith("one job per directory; wait for it to end, or give this job another hydra.run.dir")
        assert isinstance(refused.value, ConfigError)  # the launcher's refusal: exit status 2, or a skipped sweep point
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    holder = _holder(tmp_path, 30)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert read_holder(tmp_path / LOCK_FILE).pid == holder.pid  # its name stays in the file, its lock does not
    lock = RunLock(tmp_path)
    assert lock.acquire({}, wait_s=0) is None and lock.held
    assert read_holder(tmp_path / LOCK_FILE).pid == os.getpid()
    lock.release()


@pytest.mark.slow
def test_a_requeued_job_waits_for_its_previous_run(tmp_path: Path) -> None:
    previous = _holder(tmp_path, 1.5, slurm_job="77")
    said: list[str] = []
    start = time.monotonic()
    lock = RunLock(tmp_path)
    lock.acquire({"SLURM_JOB_ID": "77"}, wait_s=30, say=said.append)
    assert 1.0 < time.monotonic() - start < 30 and previous.wait(timeout=5) == 0
    assert len(said) == 1 and said[0].startswith(f"waiting up to 30 s for the previous run of SLURM job 77 (host ")
    assert f"pid {previous.pid}" in said[0] and read_holder(tmp_path / LOCK_FILE).slurm_job == "77"
    lock.release()


@pytest.mark.slow
def test_a_requeued_job_says_when_its_previous_run_does_not_end(tmp_path: Path) -> None:
    previous = _holder(tmp_path, 30, slurm_job="78")
    try:
        with pytest.raises(RunDirBusy, match=r"still held by the previous run of SLURM job 78 .* after waiting 1 s"):
            RunLock(tmp_path).acquire({"SLURM_JOB_ID": "78"}, wait_s=1, say=lambda _: None)
        with pytest.raises(RunDirBusy, match="is in use by another job"):  # another SLURM job is refused at once
            RunLock(tmp_path).acquire({"SLURM_JOB_ID": "79"}, wait_s=30)
    finally:
        previous.kill()
        previous.wait()


@pytest.mark.slow
def test_a_stop_signal_ends_the_wait_without_the_lock(tmp_path: Path) -> None:
    previous = _holder(tmp_path, 30, slurm_job="80")
    try:
        lock = RunLock(tmp_path)
        calls = iter([False, False, True])
        assert lock.acquire({"SLURM_JOB_ID": "80"}, wait_s=30, say=lambda _: None, interrupted=lambda: next(calls)) \
            is None
        assert not lock.held and lock.gave_up and read_holder(tmp_path / LOCK_FILE).pid == previous.pid
    finally:
        previous.kill()
        previous.wait()
