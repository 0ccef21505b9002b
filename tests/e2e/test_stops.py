"""How a ``train.py`` job ends when it does not end well: every stop is a clean stop.

Real jobs (2 gloo ranks, DAPPLE on a tiny GPT-2), started side by side, each hit by one fault while it trains:

* SIGTERM to rank 1 (SLURM's notice) and SIGINT to ``train.py`` (Ctrl-C): every rank stops after the same
  step, a checkpoint of that step is written, ``results.json`` says ``stopped`` with the losses so far, the
  last line says what stopped the job and where the checkpoint is, the exit status is 128 + the signal;
* kill -9 of rank 1 and of rank 0: the last line names the killed rank (and host) and the signal, not the
  peer that lost its connection; the schedule grid of the peer's failed action is in the log above it;
  ``results.json`` keeps the losses reached;
* a full disk (a small tmpfs) where the checkpoints go: "no space left on device" and where, no partial
  files, the previous checkpoint intact and loadable;
* with a save every step, written in the background (``checkpoint.async_save``, the default), SIGTERM and kill -9
  of rank 1 find a save being written: the stop waits for it and keeps the step reached; after the kill, every
  checkpoint not marked ``.partial`` is complete.

Then a job resumed from the stopped job's checkpoint (``ckpt_path=auto`` in its job directory, started as soon as
the stop has ended) reproduces the uninterrupted job's losses exactly. No worker is left running after any of them.
The full disk and a sweep with a failing and a refused point run beside the others (one batch of jobs, not one
after another).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from pipeline_recipes.recipe.report.results import read_results
from pipeline_recipes.strategies.checkpoint import verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
STEPS = 20  # the stops come after step 3; the reference and the resumed job train to the end
COMMON = ["trainer=cpu", "model=gpt2-tiny", "strategy=dapple", "strategy.D=2", "logger=none",
          f"trainer.max_steps={STEPS}", "data.global_batch_size=8", "trainer.log_every_n_steps=1",
          "metrics.progress_interval_s=0", "strategy.timeout_s=60"]
SIGNAL_AFTER_STEP = 3
HOST = socket.gethostname()

pytestmark = pytest.mark.slow


class Job:
    """One ``train.py`` job in ``root / name``, and the fault to inflict once it has trained a few steps."""

    def __init__(self, root: Path, name: str, fault: tuple[str, int] | None, *args: str,
                 run_dir: Path | None = None) -> None:
        self.dir = run_dir or root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fault, self.done_fault = fault, fault is None
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={self.dir}", *COMMON,
                                      *args], cwd=root, env=ENV, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.workers: dict[int, psutil.Process] = {}

    def trained_steps(self) -> int:
        log = self.dir / "logs" / "rank0.log"
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("step ")] \
            if log.exists() else []
        return int(lines[-1].split()[1].split("/")[0]) if lines else 0

    def find_workers(self) -> None:
        for child in psutil.Process(self.proc.pid).children():
            try:
                if "pipeline_recipes.recipe.worker" in " ".join(child.cmdline()):
                    self.workers[int(child.environ()["RANK"])] = child
            except psutil.Error:
                pass

    def poke(self) -> None:
        """Inflict the fault once rank 0 has printed step ``SIGNAL_AFTER_STEP``."""
        if self.done_fault or self.proc.poll() is not None or self.trained_steps() < SIGNAL_AFTER_STEP:
            return
        self.find_workers()
        target, signum = self.fault
        if target == "train.py":
            os.kill(self.proc.pid, signum)
        else:
            self.workers[int(target)].send_signal(signum)
        self.done_fault = True

    def finish(self, timeout: float) -> str:
        output = self.proc.communicate(timeout=timeout)[0]
        self.output, self.last_line = output, output.strip().splitlines()[-1] if output.strip() else ""
        return output

    def left_running(self) -> list[int]:
        return [p.pid for p in self.workers.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def run_jobs(jobs: list[Job], timeout: float = 300, then: dict[Job, Callable[[], Job]] | None = None) -> None:
    """Run ``jobs`` to their end, each hit by its fault; ``then[job]`` starts a job once ``job`` has ended (it is
    added to ``jobs``), while the others go on."""
    deadline, then = time.monotonic() + timeout, dict(then or {})
    try:
        while then or any(j.proc.poll() is None for j in jobs):
            assert time.monotonic() < deadline, "jobs did not end in time"
            for job in list(jobs):
                if job.proc.poll() is None and not job.workers:
                    job.find_workers()
                job.poke()
                if job in then and job.proc.poll() is not None:
                    jobs.append(then.pop(job)())
            time.sleep(0.1)
        for job in jobs:
            job.finish(timeout=30)
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                job.proc.kill()


def _mount_tmpfs(disk: Path, size: str) -> str | None:
    """A tmpfs of ``size`` at ``disk`` (a full disk made small); why it cannot be mounted here, or None."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "mounting a small tmpfs (the full disk) needs root"
    disk.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True)
    return f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}" if mounted.returncode != 0 else None


@pytest.fixture(scope="module")
def beside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The jobs that need no fault, started before :func:`ended`'s and run beside them: the job whose checkpoints
    fill a small disk, and a sweep with a failing and a refused point. Each test waits for its own."""
    root = tmp_path_factory.mktemp("beside")
    disk = root / "disk"
    runs: dict[str, Any] = {"disk": disk, "sweep": root / "sweep", "no_disk": _mount_tmpfs(disk, "7m")}
    try:
        if runs["no_disk"] is None:  # a checkpoint of this model takes 4 MiB: the first fits, the second does not
            runs["full"] = Job(root, "full", None, "checkpoint.every_n_steps=5", run_dir=disk / "run")
        with open(root / "sweep.out", "w") as out, open(root / "sweep.err", "w") as err:
            runs["sweep_proc"] = subprocess.Popen(
                [sys.executable, str(ROOT / "train.py"), "-m", f"hydra.sweep.dir={runs['sweep']}", *COMMON,
                 "trainer.max_steps=2", "optim.lr=1e30", "trainer.gradient_clip_val=null", "strategy.D=2,3"],
                cwd=root, env=ENV, text=True, stdout=out, stderr=err)
        runs["sweep_out"], runs["sweep_err"] = root / "sweep.out", root / "sweep.err"
        yield runs
    finally:
        for proc in (runs.get("sweep_proc"), getattr(runs.get("full"), "proc", None)):
            if proc is not None and proc.poll() is None:
                proc.kill()
        if runs["no_disk"] is None:
            subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory, beside: dict[str, Any]) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("stops")
    jobs = {
        "reference": Job(root, "reference", None),
        "term_rank1": Job(root, "term_rank1", ("1", signal.SIGTERM), "checkpoint.every_n_steps=100"),
        "int_launcher": Job(root, "int_launcher", ("train.py", signal.SIGINT), "checkpoint.every_n_steps=100"),
        "kill_rank1": Job(root, "kill_rank1", ("1", signal.SIGKILL)),
        "kill_rank0": Job(root, "kill_rank0", ("0", signal.SIGKILL)),
        # a save every step, written in the background (checkpoint.async_save, the default): the fault finds one
        # being written
        "term_saving": Job(root, "term_saving", ("1", signal.SIGTERM), "checkpoint.every_n_steps=1"),
        "kill_saving": Job(root, "kill_saving", ("1", signal.SIGKILL), "checkpoint.every_n_steps=1"),
    }

    def requeued() -> Job:  # the stopped job run again: the same job directory, the same command
        run_dir = root / "requeued"
        shutil.copytree(jobs["term_rank1"].dir, run_dir)
        jobs["requeued"] = Job(root, "requeued", None, "checkpoint.every_n_steps=100", "ckpt_path=auto",
                               run_dir=run_dir)
        return jobs["requeued"]

    run_jobs(list(jobs.values()), timeout=420, then={jobs["term_rank1"]: requeued})
    return jobs


def _stopped(job: Job, signum: int, said: str) -> None:
    assert job.proc.returncode == 128 + signum, job.output[-3000:]
    res = read_results(job.dir)
    step = res.global_step
    assert res.status == "stopped" and res.reason == f"{said}; stopped after step {step}", res.reason
    assert SIGNAL_AFTER_STEP <= step < STEPS and len(res.loss_history) == step and len(res.lr_history) == step
    checkpoint = job.dir / "checkpoints" / f"step-{step:06d}.ckpt"
    assert res.last_checkpoint == str(checkpoint) and (checkpoint / "meta.json").is_file()
    assert not list((job.dir / "checkpoints").glob("*.partial"))
    assert job.last_line == (f"stopped: {res.reason}; checkpoint {checkpoint} (resume: ckpt_path=auto with the "
                             f"same hydra.run.dir, or ckpt_path={checkpoint})")
    assert not job.left_running()


def test_sigterm_to_a_rank_stops_every_rank_with_a_checkpoint_of_the_step_reached(ended: dict[str, Job]) -> None:
    _stopped(ended["term_rank1"], signal.SIGTERM, "SIGTERM received by rank 1")


def test_ctrl_c_to_train_py_stops_every_rank_and_exits_130(ended: dict[str, Job]) -> None:
    job = ended["int_launcher"]
    _stopped(job, signal.SIGINT, f"SIGINT received by train.py (pid {job.proc.pid}), forwarded to every rank")


def test_a_stopped_job_resumed_with_ckpt_path_auto_ends_with_the_uninterrupted_losses(ended: dict[str, Job]) -> None:
    reference = read_results(ended["reference"].dir)
    assert ended["reference"].proc.returncode == 0 and reference.status == "ok"
    resumed = ended["requeued"]  # started on a copy of the SIGTERM-stopped job's directory once it had ended
    run_dir = resumed.dir
    assert resumed.proc.returncode == 0, resumed.output[-3000:]
    result = read_results(run_dir)
    assert f"ckpt_path=auto: resuming from {run_dir / 'checkpoints'}" in resumed.output
    assert result.status == "ok" and len(result.loss_history) == STEPS
    assert list(result.loss_history) == list(reference.loss_history)  # bit for bit, the stopped steps included


def test_a_stop_while_a_save_is_written_waits_for_it_and_keeps_the_step_reached(ended: dict[str, Job]) -> None:
    job = ended["term_saving"]
    _stopped(job, signal.SIGTERM, "SIGTERM received by rank 1")
    saves = read_results(job.dir).checkpoint_saves
    assert [s["step"] for s in saves] == list(range(1, len(saves) + 1)), saves  # every step saved, none lost
    assert all(s["write_s"] is not None and s["bytes"] > 0 for s in saves), saves  # each complete before the end
    assert any(s["write_s"] > s["blocking_s"] for s in saves), saves  # written while training went on
    [kept] = (job.dir / "checkpoints").iterdir()  # checkpoint.keep=latest: the older ones removed once it verified
    verify_checkpoint(kept)


def test_a_rank_killed_while_a_save_is_written_leaves_no_checkpoint_marked_complete_that_is_not(
        ended: dict[str, Job]) -> None:
    job = ended["kill_saving"]
    assert job.proc.returncode == 1, job.output[-3000:]
    complete = [p for p in (job.dir / "checkpoints").iterdir() if not p.name.endswith(".partial")]
    for checkpoint in complete:
        verify_checkpoint(checkpoint)
    last = read_results(job.dir).last_checkpoint
    assert last is None or Path(last) in complete, (last, complete)
    assert not job.left_running()


@pytest.mark.parametrize("killed, peer", [("kill_rank1", 0), ("kill_rank0", 1)])
def test_a_killed_rank_is_named_with_its_signal(ended: dict[str, Job], killed: str, peer: int) -> None:
    job = ended[killed]
    rank = 1 - peer
    assert job.proc.returncode == 1, job.output[-3000:]
    said = f"rank {rank} ({HOST}) was killed by SIGKILL (signal 9: kill -9, the out-of-memory killer, or a scheduler)"
    assert job.last_line == f"error: job failed: {said}", job.output[-3000:]
    res = read_results(job.dir)
    assert res.status == "failed" and res.reason == said
    assert len(res.loss_history) >= 1  # the losses reached (rank 0 writes them as it goes)
    peer_log = (job.dir / "logs" / f"rank{peer}.log").read_text()
    said_how = f"the connection to rank {rank} closed after" in peer_log  # a p2p wait or a collective says how, and when
    in_action = said_how and " failed in action " in peer_log  # a p2p wait inside an action (not a collective)
    assert said_how or "Connection reset by peer" in peer_log or "Connection closed by peer" in peer_log  # the loss's
    if in_action and peer == 0:  # rank 0's output is the job's: its failed action's grid is above the last line
        assert f">{0}" in job.output[:job.output.rindex(job.last_line)]
    assert not job.left_running()


def test_a_full_disk_is_said_and_leaves_the_previous_checkpoint_intact(beside: dict[str, Any]) -> None:
    if beside["no_disk"]:
        pytest.skip(beside["no_disk"])
    disk, job = beside["disk"], beside["full"]
    run_jobs([job])
    assert job.proc.returncode == 1, job.output[-3000:]
    assert job.last_line.startswith(f"error: job failed: rank ") and "no space left on device: rank " in \
        job.last_line and str(disk / "run" / "checkpoints" / "step-000010.ckpt.partial") in job.last_line
    res = read_results(disk / "run")
    assert res.status == "failed" and "no space left on device" in res.reason and len(res.loss_history) >= 10
    checkpoints = sorted(p.name for p in (disk / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step-000005.ckpt"] and res.last_checkpoint.endswith("step-000005.ckpt")
    from pipeline_recipes.strategies.checkpoint import read_checkpoint

    full = read_checkpoint(disk / "run" / "checkpoints" / "step-000005.ckpt")
    assert full.meta["global_step"] == 5 and full.model
    assert not job.left_running()


def test_a_sweep_with_a_failing_and_a_refused_point_lists_both_and_exits_1(beside: dict[str, Any]) -> None:
    """Point 0 diverges while it trains, point 1 is refused before launch: the sweep goes on after each, its end
    lists both with their status and reason, and it exits 1."""
    sweep, proc = beside["sweep"], beside["sweep_proc"]
    proc.wait(timeout=300)
    stdout, stderr = beside["sweep_out"].read_text(), beside["sweep_err"].read_text()
    assert proc.returncode == 1, stdout[-3000:] + stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "error: sweep: 2 of 2 points did not train to the end (1 diverged, 1 skipped)")
    table = stdout[stdout.rindex("strategy  W"):].splitlines()
    assert any("diverged: rank " in row and "training loss is nan" in row for row in table)
    assert any("skipped: strategy.D = 3 does not divide the 2 processes" in row for row in table)
    assert [read_results(sweep / str(n)).status for n in (0, 1)] == ["diverged", "skipped"]


def test_a_full_disk_under_the_job_directory_is_said_in_one_line(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    no_disk = _mount_tmpfs(disk, "64k")
    if no_disk:
        pytest.skip(no_disk)
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'fill'}", "bs=4k", "count=64"], capture_output=True)
        done = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={disk / 'run'}", *COMMON],
                              cwd=tmp_path, env=ENV, text=True, capture_output=True, timeout=120)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"error: no space left on device: cannot write the job directory (hydra.run.dir) {disk / 'run'} (0 B free")
