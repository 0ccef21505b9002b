"""``train.py`` under a real SLURM (private clusters on this host, ``tests/support/slurm.py``): the commands of
``docs/slurm.md``, run as a user runs them.

* both ``srun`` modes on two nodes (one task per node: ``train.py`` starts each node's workers; one task per rank)
  meet at the first node's name and train exactly like one machine with the same layout;
* ``scancel --signal=TERM`` (the preemption notice) and ``scancel`` stop every rank after the same step with a
  checkpoint, ``results.json`` says ``stopped``, the job does not end as ``COMPLETED``, nothing is left running
  (``proctrack/linuxproc`` and ``proctrack/pgid``), with the default logger (W&B, whose service SLURM signals too
  under ``proctrack/linuxproc``: one warning, the stop stands) as with ``logger=none``;
* ``scripts/train.sbatch`` (``--requeue``, ``--signal=USR1@…``): the requeue loop with the default logger (stopped
  and requeued held by ``scontrol requeuehold``, the newest save damaged, released: the damaged save is skipped in one
  line) and the USR1 notice (``train.py`` stops, saves and requeues the job itself) both come back with
  ``ckpt_path=auto`` and end with the losses of the uninterrupted job;
* ``salloc`` (job name ``interactive``), task counts inherited from ``sbatch``, a bad setting said once;
* the sweep through Hydra's submitit launcher with the preset as shipped, on a CPU-only partition;
* the cluster tests pass inside a SLURM allocation (``salloc -N1 -n2``: ``tests/conftest.py`` drops its ``SLURM_*``
  variables, the tests set those they read).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline_recipes.recipe.report.results import read_results
from slurm import Cluster

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
LAYOUT = ["trainer=cpu", "model=gpt2-tiny", "strategy=dapple", "strategy.D=2", "logger=none",
          "data.global_batch_size=8", f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1",
          "metrics.progress_interval_s=0", "strategy.timeout_s=60", "checkpoint.every_n_steps=100"]
TWO_NODES = ["trainer.devices=2", "trainer.num_nodes=2"]
TRAIN = [sys.executable, str(ROOT / "train.py")]
pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without an enclosing job's or launcher's variables."""
    drop = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in drop}
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}


def _steps(run_dir: Path) -> int:
    log = run_dir / "logs" / "rank0.log"
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("step ")] \
        if log.exists() else []
    return int(lines[-1].split()[1].split("/")[0]) if lines else 0


def _wait(condition, timeout: float, what: str) -> None:  # noqa: ANN001 - a callable returning bool
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.2)


def _left_running(marker: str) -> list[str]:
    """Processes whose command line names ``marker`` (a job's run directory), this test's own excepted."""
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line and "pytest" not in line]


def _job_processes(job_id: str) -> list[str]:
    """``"PID command"`` of every process whose environment names SLURM job ``job_id``: the batch shell, srun,
    ``train.py``, its workers and what they started (W&B's service among them), whatever their command line."""
    marker = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name} {command[:200]}")
        except OSError:
            continue
    return found


class Batch:
    """One ``sbatch`` of ``scripts/train.sbatch`` on ``cluster``, its run directory and output; ``layout``: the
    settings of :data:`LAYOUT` (``logger=none`` among them) unless told."""

    def __init__(self, cluster: Cluster, run_dir: Path, *sbatch: str, overrides: tuple[str, ...] = (),
                 layout: list[str] = LAYOUT) -> None:
        self.cluster, self.run_dir, self.out = cluster, run_dir, run_dir.with_suffix(".out")
        env = {"RUN_DIR": str(run_dir), "TRAIN_PY": str(ROOT / "train.py"), "HF_HUB_OFFLINE": "1"}
        self.id = cluster.run("sbatch", "--parsable", "--export=ALL", f"--output={self.out}", *sbatch,
                              str(ROOT / "scripts" / "train.sbatch"), *layout, *TWO_NODES, *overrides,
                              env={**_env(), **env}).stdout.strip().split(";")[0]

    def training(self, at_step: int = 3, timeout: float = 240) -> None:
        _wait(lambda: _steps(self.run_dir) >= at_step, timeout, f"job {self.id} to train {at_step} steps")

    def ended(self, timeout: float = 300) -> dict[str, str]:
        return self.cluster.wait_job(self.id, timeout=timeout)

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""


@pytest.fixture(scope="module")
def cluster(slurm_clusters) -> Cluster:  # noqa: ANN001 - tests/support/slurm.py's factory
    """Two nodes with room for several jobs at once, and KillWait 30 s (SLURM's default, the private clusters'
    too): after scancel's SIGTERM the ranks have time to reach a step boundary and save before SIGKILL."""
    return slurm_clusters.get(nodes=2, cpus_per_node=8)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """The same layout (W = 2, D = 2) on this machine without SLURM: the losses every SLURM run must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = subprocess.Popen([*TRAIN, f"hydra.run.dir={run_dir}", *LAYOUT, "trainer.devices=4"], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    proc.run_dir = run_dir  # type: ignore[attr-defined]
    yield proc
    proc.kill()


def _reference_losses(reference: subprocess.Popen) -> list[float]:
    assert reference.wait(timeout=300) == 0
    result = read_results(reference.run_dir)  # type: ignore[attr-defined]
    assert result.status == "ok" and len(result.loss_history) == STEPS
    return list(result.loss_history)


SRUN_PER_NODE = ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=2"]  # docs/slurm.md
SRUN_PER_RANK = ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2"]


def _check_like_one_machine(run: Path, output: str, reference: subprocess.Popen) -> None:
    result = read_results(run)
    assert result.status == "ok" and (result.world_size, result.W, result.D) == (4, 2, 2)
    assert result.loss_history == pytest.approx(_reference_losses(reference), abs=1e-6)
    assert output.count("final train/loss") == 1 and output.count("layout: dapple") == 1
    assert "rendezvous n1:" in output  # the first node of SLURM_NODELIST, by name


def test_srun_one_task_per_node_trains_like_one_machine(cluster: Cluster, reference: subprocess.Popen,
                                                       tmp_path: Path) -> None:
    run = tmp_path / "per_node"
    done = subprocess.run([*SRUN_PER_NODE, *TRAIN, *LAYOUT, *TWO_NODES, f"hydra.run.dir={run}"],
                          env=cluster.environ(_env()), text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _check_like_one_machine(run, done.stdout + done.stderr, reference)
    assert "one SLURM task per node (2 tasks): train.py starts each node's 2 workers" in done.stdout


def test_scancel_stops_every_rank_with_a_checkpoint(slurm_clusters, tmp_path: Path) -> None:  # noqa: ANN001
    """``scancel --signal=TERM`` of a two-node job (``proctrack/linuxproc``) with the logger users run (W&B, offline:
    SLURM signals its service with the ranks) and a plain ``scancel`` of a one-node job under ``proctrack/pgid`` (the
    workers' own sessions are outside the task's process group) with ``logger=none``, at once."""
    jobs, proctracks, loggers = {}, {}, {}
    for how, proctrack, nodes, logger in (("scancel --signal=TERM", "linuxproc", 2, "default"),
                                          ("scancel", "pgid", 1, "none")):
        cluster = slurm_clusters.get(nodes=nodes, proctrack=proctrack, cpus_per_node=8)
        proctracks[how], loggers[how] = proctrack, logger
        layout = [o for o in LAYOUT if not o.startswith("logger=")] + ([] if logger == "default" else ["logger=none"])
        jobs[how] = Batch(cluster, tmp_path / proctrack, f"--nodes={nodes}", "--cpus-per-task=2", layout=layout,
                          overrides=(f"trainer.num_nodes={nodes}", "trainer.max_steps=100000"))
    for how, job in jobs.items():
        job.training()
        job.cluster.run(*how.split(), job.id)
    for how, job in jobs.items():
        state, proctrack, logger = job.ended(), proctracks[how], loggers[how]
        output = job.output()  # train.py's, with rank 0's lines (each rank's own: logs/rank<r>.log)
        logs = "".join(log.read_text(errors="replace") for log in job.run_dir.glob("logs/rank*.log"))
        assert state["JobState"] != "COMPLETED", state  # a stop never reads as success
        if how == "scancel --signal=TERM":
            assert state["JobState"] == "FAILED" and state["ExitCode"] == "143:0", (state, output[-3000:])
        result = read_results(job.run_dir)
        assert result.status == "stopped" and "SIGTERM received by" in result.reason, output[-3000:]
        assert result.last_checkpoint == str(job.run_dir / "checkpoints" / f"step-{result.global_step:06d}.ckpt")
        assert (Path(result.last_checkpoint) / "meta.json").is_file()
        assert len(result.loss_history) == result.global_step >= 3
        assert "Traceback" not in output + logs, (output + logs)[-3000:]
        # linuxproc: SLURM's SIGTERM reached W&B's service with the ranks (pgid: its own session is not signalled)
        signalled_service = logger == "default" and proctrack == "linuxproc"
        assert output.count("its backend is gone") == int(signalled_service), output[-3000:]  # one line, or none
        assert (job.run_dir / "wandb").is_dir() == (logger == "default")

        def left(job: Batch = job) -> list[str]:
            return _left_running(str(job.run_dir)) + _job_processes(job.id)

        try:
            _wait(lambda: not left(), 10, f"{how}: the job's processes to end")
        except AssertionError as error:
            raise AssertionError(f"{error}; still running: {left()}") from None


def _stop_those_training(cluster: Cluster, waiting: dict[str, Batch]) -> dict[str, Batch]:
    """Stop each job of ``waiting`` that has trained 3 steps, as its key says, and drop it from ``waiting``: each is
    stopped as soon as it can be (one waited for is not left to train to its end meanwhile)."""
    for how, job in list(waiting.items()):
        if _steps(job.run_dir) >= 3:
            cluster.run(*(("scontrol", "requeuehold") if how == "requeue loop" else ("scancel", "--signal=USR1")),
                        job.id)
            del waiting[how]
    return waiting


def test_requeued_jobs_resume_by_themselves_and_end_with_the_uninterrupted_losses(
        cluster: Cluster, reference: subprocess.Popen, tmp_path: Path) -> None:
    """Two jobs of ``scripts/train.sbatch`` at once. One goes round the requeue loop with the default logger: stopped
    and requeued as a preemption does, but held (``scontrol requeuehold``: SIGTERM to every task, the step reached
    saved, the job back in the queue), its newest checkpoint damaged meanwhile (a rank's ``.distcp`` part cut in half), then
    released: it skips the damaged save in one line and resumes from the periodic one before it. The other is sent
    what ``--signal=USR1@<s>`` sends before the time limit (``train.py`` stops, saves and requeues the job itself)."""
    loop = [o for o in LAYOUT if not o.startswith(("logger=", "checkpoint."))]
    jobs = {"requeue loop": Batch(cluster, tmp_path / "loop", "--nodes=2", "--cpus-per-task=2", layout=loop,
                                  overrides=("checkpoint.every_n_steps=2", "checkpoint.keep=all")),
            "USR1 notice": Batch(cluster, tmp_path / "USR1_notice", "--nodes=2", "--cpus-per-task=2")}
    waiting = dict(jobs)
    _wait(lambda: not _stop_those_training(cluster, waiting), 240, "both jobs to train 3 steps")
    job = jobs["requeue loop"]
    _wait(lambda: (job.run_dir / "results.json").exists() and read_results(job.run_dir).status == "stopped", 300,
          f"job {job.id}'s first run to stop")
    damaged = Path(read_results(job.run_dir).last_checkpoint)
    before = sorted(p for p in (job.run_dir / "checkpoints").glob("step-*.ckpt") if p != damaged)[-1]
    _wait(lambda: not _left_running(str(job.run_dir)), 60, f"job {job.id}'s first run to end")
    stage = max(damaged.glob("*.distcp"), key=lambda part: part.stat().st_size)  # a rank's part of the DCP state
    stage.write_bytes(stage.read_bytes()[: stage.stat().st_size // 2])
    cluster.run("scontrol", "release", job.id)
    expected = _reference_losses(reference)
    for how, job in jobs.items():
        # the stop, the checkpoint and SLURM's requeue take about a minute alone, up to twice that on a busy 2-core CI
        _wait(lambda job=job: cluster.job(job.id).get("Restarts", "0") == "1", 300, f"job {job.id} to be requeued")
        state = job.ended()
        output = job.output()
        assert state["JobState"] == "COMPLETED", f"{how}: {output[-4000:]}"
        result = read_results(job.run_dir)
        assert result.status == "ok" and list(result.loss_history) == expected, how
        assert f"ckpt_path=auto: resuming from {job.run_dir / 'checkpoints'}" in output, how
        assert "Traceback" not in output, f"{how}: {output[-4000:]}"
        if how == "requeue loop":
            assert (f"ckpt_path=auto: resuming from {before} (step {int(before.name[5:11])}); skipped {damaged.name}: "
                    f"{stage.name} has ") in output and "(cut short)" in output, output[-4000:]
        else:
            assert f"SLURM job {job.id} requeued (scontrol requeue): it resumes with ckpt_path=auto" in output


def test_srun_one_task_per_rank_in_salloc_trains_like_one_machine_and_a_bad_setting_is_said_once(
        cluster: Cluster, reference: subprocess.Popen, tmp_path: Path) -> None:
    """srun's one-task-per-rank line inside salloc (job name ``interactive``: still SLURM tasks); an salloc shell
    of two nodes is no place to start train.py (it names the srun line); four tasks refusing a setting say it once;
    a task count srun inherits from sbatch is explained."""
    env = cluster.environ(_env())
    run = tmp_path / "per_rank"
    inside = subprocess.run(["salloc", "--nodes=2", "--ntasks-per-node=2", *SRUN_PER_RANK, *TRAIN, *LAYOUT,
                             *TWO_NODES, f"hydra.run.dir={run}"], env=env, text=True, capture_output=True, timeout=300)
    assert inside.returncode == 0, inside.stdout[-3000:] + inside.stderr[-3000:]
    _check_like_one_machine(run, inside.stdout + inside.stderr, reference)
    assert "one SLURM task per rank (4 tasks, 2 per node)" in inside.stdout
    assert not (run / "logs").exists()  # every task is a rank: no workers of train.py's own
    shell = subprocess.run(["salloc", "--nodes=2", *TRAIN, *LAYOUT, *TWO_NODES], env=env, text=True,
                           capture_output=True, timeout=120)
    assert shell.returncode == 2
    assert "error: trainer.num_nodes = 2 but this process is not a SLURM task" in shell.stderr
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=2 python train.py" in shell.stderr
    bad = subprocess.run(["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", *TRAIN, *LAYOUT, *TWO_NODES,
                          "strategy.D=3"], env=env, text=True, capture_output=True, timeout=120)
    said = [line for line in bad.stderr.splitlines() if line.startswith("error: ")]
    assert bad.returncode == 2 and len(said) == 1 and "strategy.D = 3" in said[0], bad.stderr  # 4 tasks, 1 message
    inherited = subprocess.run(["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=4", f"--output={tmp_path}/i.out",
                                f"--wrap=srun --ntasks-per-node=1 {' '.join(TRAIN)} {' '.join(LAYOUT)} "
                                "trainer.devices=2"], env=env, text=True, capture_output=True, timeout=120)
    said = (tmp_path / "i.out").read_text()
    assert inherited.returncode != 0 and said.count("error: SLURM started SLURM_NTASKS = 4 tasks") == 1, said
    assert "srun takes the task counts of the allocation" in said


def test_the_submitit_sweep_runs_on_a_cpu_partition_with_the_preset_as_shipped(slurm_clusters,  # noqa: ANN001
                                                                               tmp_path: Path) -> None:
    """Three points through the preset's launcher; the third, cancelled with ``scancel`` once it runs, is recorded as
    stopped and the sweep ends with its summary (submitit's ``UncompletedJobError`` for the job without a result does
    not end it)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cluster = slurm_clusters.get(nodes=1, accounting=True)
    sweep = subprocess.Popen([*TRAIN, "-m", "hydra/launcher=slurm", "hydra.launcher.timeout_min=10",
                              f"hydra.sweep.dir={tmp_path / 'sweep'}", *LAYOUT, "trainer.devices=2",
                              "trainer.max_steps=2", "strategy=gpipe,dapple,gems"], env=cluster.environ(_env()),
                             cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline, cancelled = time.monotonic() + 240, None
    while cancelled is None and time.monotonic() < deadline and sweep.poll() is None:
        queue = cluster.run("squeue", "-h", "-r", "-o", "%i %T", check=False).stdout
        listed = [line.split() for line in queue.splitlines()]
        running = next((job for job, state in listed if job.endswith("_2") and state == "RUNNING"), None)
        cancelled = running if running is not None and (tmp_path / "sweep" / "2").is_dir() else None
        time.sleep(0.2)
    assert cancelled is not None, "the sweep's third point never started"
    cluster.run("scancel", cancelled)
    stdout, stderr = sweep.communicate(timeout=400)
    assert sweep.returncode == 1, stdout[-3000:] + stderr[-3000:]
    results = [read_results(tmp_path / "sweep" / str(n)) for n in (0, 1, 2)]
    assert [r.status for r in results] == ["ok", "ok", "stopped"], [r.reason for r in results]
    assert [r.strategy for r in results[:2]] == ["gpipe", "dapple"]
    assert results[2].reason.startswith(f"cancelled by SLURM (scancel): job {cancelled}, state CANCELLED"), results[2]
    assert results[0].loss_history == pytest.approx(results[1].loss_history, abs=1e-5)
    assert "error: sweep: 1 of 3 points did not train to the end (1 stopped)" in stdout + stderr
    assert "UncompletedJobError" not in stderr and "Bypassing sacct error" not in stderr


def test_a_sweep_point_cancelled_while_pending_is_recorded_as_stopped(slurm_clusters,  # noqa: ANN001
                                                                     tmp_path: Path) -> None:
    """One point at a time (``array_parallelism=1``): the second, cancelled while it waits in the queue, never runs.
    sacct lists no such array task, so submitit alone would wait for it forever; the sweep ends with the first
    point's result, the second recorded as stopped, and its summary."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cluster = slurm_clusters.get(nodes=1, accounting=True)
    sweep = subprocess.Popen([*TRAIN, "-m", "hydra/launcher=slurm", "hydra.launcher.timeout_min=10",
                              "hydra.launcher.array_parallelism=1", f"hydra.sweep.dir={tmp_path / 'sweep'}", *LAYOUT,
                              "trainer.devices=2", "trainer.max_steps=2", "strategy=gpipe,dapple"],
                             env=cluster.environ(_env()), cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    deadline, cancelled = time.monotonic() + 240, None
    while cancelled is None and time.monotonic() < deadline and sweep.poll() is None:
        queue = cluster.run("squeue", "-h", "-r", "-o", "%i %T", check=False).stdout
        cancelled = next((job for job, state in (line.split() for line in queue.splitlines())
                          if job.endswith("_1") and state == "PENDING"), None)
        time.sleep(0.2)
    assert cancelled is not None, "the sweep's second point never waited in the queue"
    cluster.run("scancel", cancelled)
    stdout, stderr = sweep.communicate(timeout=400)
    assert sweep.returncode == 1, stdout[-3000:] + stderr[-3000:]
    results = [read_results(tmp_path / "sweep" / str(n)) for n in (0, 1)]
    assert [r.status for r in results] == ["ok", "stopped"], [r.reason for r in results]
    assert results[1].reason.startswith(f"cancelled by SLURM (scancel): job {cancelled}, state CANCELLED"), results[1]
    assert "it wrote no results.json (it never started" in results[1].reason
    assert "error: sweep: 1 of 2 points did not train to the end (1 stopped)" in stdout + stderr


def test_the_cluster_tests_pass_inside_a_slurm_allocation(cluster: Cluster, tmp_path: Path) -> None:
    """``salloc -N1 -n2 python -m pytest tests/recipe/test_cluster.py``: the allocation's ``SLURM_NTASKS = 2``
    without ``SLURM_NTASKS_PER_NODE`` makes Lightning's ``SLURMEnvironment()`` raise, and its ``SLURM_JOB_ID`` would
    change the port it derives; ``tests/conftest.py`` drops the allocation's variables, so the tests that want a SLURM
    job see only their own. The inner session has a base directory of its own: pytest's default one would remove
    older sessions' directories (this one's, holding the cluster, among them)."""
    inside = subprocess.run(["salloc", "--nodes=1", "--ntasks=2", sys.executable, "-m", "pytest", "-q", "-n", "0",
                             "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'inner'}", "-o", "timeout=120",
                             "-m", "not slow",
                             str(ROOT / "tests" / "recipe" / "test_cluster.py")],
                            env=cluster.environ(_env()), cwd=ROOT, text=True, capture_output=True, timeout=300)
    assert inside.returncode == 0, inside.stdout[-3000:] + inside.stderr[-2000:]
    assert "Granted job allocation" in inside.stderr and " passed" in inside.stdout  # inside the allocation, run
