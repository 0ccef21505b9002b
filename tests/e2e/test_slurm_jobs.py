"""``train.py`` under a real SLURM (private clusters on this host, ``tests/support/slurm.py``): the commands of
``docs/slurm.md``, run as a user runs them.

* both ``srun`` modes on two nodes (one task per node: ``train.py`` starts each node's workers; one task per rank)
  meet at the first node's name and train exactly like one machine with the same layout;
* ``scancel --signal=TERM`` (the preemption notice) and ``scancel`` stop every rank after the same step with a
  checkpoint, ``results.json`` says ``stopped``, the job does not end as ``COMPLETED``, nothing is left running
  (``proctrack/linuxproc`` and ``proctrack/pgid``);
* ``scripts/train.sbatch`` (``--requeue``, ``--signal=USR1@…``): ``scontrol requeue`` (SIGTERM, then SLURM requeues
  it) and the USR1 notice (``train.py`` stops, saves and requeues the job itself) both come back with
  ``ckpt_path=auto`` and end with the losses of the uninterrupted job;
* ``salloc`` (job name ``interactive``), task counts inherited from ``sbatch``, a bad setting said once;
* the sweep through Hydra's submitit launcher with the preset as shipped, on a CPU-only partition;
* the cluster tests pass inside a SLURM allocation (they set the ``SLURM_*`` variables they read).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline_recipes.recipe.results import read_results
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


class Batch:
    """One ``sbatch`` of ``scripts/train.sbatch`` on ``cluster``, its run directory and output."""

    def __init__(self, cluster: Cluster, run_dir: Path, *sbatch: str, overrides: tuple[str, ...] = ()) -> None:
        self.cluster, self.run_dir, self.out = cluster, run_dir, run_dir.with_suffix(".out")
        env = {"RUN_DIR": str(run_dir), "TRAIN_PY": str(ROOT / "train.py"), "HF_HUB_OFFLINE": "1"}
        self.id = cluster.run("sbatch", "--parsable", "--export=ALL", f"--output={self.out}", *sbatch,
                              str(ROOT / "scripts" / "train.sbatch"), *LAYOUT, *TWO_NODES, *overrides,
                              env={**_env(), **env}).stdout.strip().split(";")[0]

    def training(self, at_step: int = 3, timeout: float = 240) -> None:
        _wait(lambda: _steps(self.run_dir) >= at_step, timeout, f"job {self.id} to train {at_step} steps")

    def ended(self, timeout: float = 300) -> dict[str, str]:
        return self.cluster.wait_job(self.id, timeout=timeout)

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""


@pytest.fixture(scope="module")
def cluster(slurm_clusters) -> Cluster:  # noqa: ANN001 - tests/support/slurm.py's factory
    """Two nodes with room for several jobs at once, and KillWait 30 s (SLURM's default): after scancel's
    SIGTERM the ranks have time to reach a step boundary and save before SIGKILL."""
    return slurm_clusters.get(nodes=2, cpus_per_node=8, kill_wait=30)


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
    """``scancel --signal=TERM`` of a two-node job (``proctrack/linuxproc``) and a plain ``scancel`` of a one-node
    job under ``proctrack/pgid`` (the workers' own sessions are outside the task's process group), at once."""
    jobs = {}
    for how, proctrack, nodes in (("scancel --signal=TERM", "linuxproc", 2), ("scancel", "pgid", 1)):
        cluster = slurm_clusters.get(nodes=nodes, proctrack=proctrack, kill_wait=30, cpus_per_node=8)
        jobs[how] = Batch(cluster, tmp_path / proctrack, f"--nodes={nodes}", "--cpus-per-task=2",
                          overrides=(f"trainer.num_nodes={nodes}", "trainer.max_steps=100000"))
    for how, job in jobs.items():
        job.training()
        job.cluster.run(*how.split(), job.id)
    for how, job in jobs.items():
        state = job.ended()
        assert state["JobState"] != "COMPLETED", state  # a stop never reads as success
        if how == "scancel --signal=TERM":
            assert state["JobState"] == "FAILED" and state["ExitCode"] == "143:0", state
        result = read_results(job.run_dir)
        assert result.status == "stopped" and "SIGTERM received by" in result.reason, job.output()[-3000:]
        assert result.last_checkpoint == str(job.run_dir / "checkpoints" / f"step-{result.global_step:06d}.ckpt")
        assert (Path(result.last_checkpoint) / "meta.json").is_file()
        assert len(result.loss_history) == result.global_step >= 3
        _wait(lambda job=job: not _left_running(str(job.run_dir)), 10, f"{how}: the job's processes to end")


def test_requeued_jobs_resume_by_themselves_and_end_with_the_uninterrupted_losses(
        cluster: Cluster, reference: subprocess.Popen, tmp_path: Path) -> None:
    """Two jobs of ``scripts/train.sbatch`` at once: one requeued as a preemption does (``scontrol requeue``:
    SIGTERM to every task, then SLURM requeues it), one sent what ``--signal=USR1@<s>`` sends before the time
    limit (``train.py`` stops, saves and requeues the job itself)."""
    jobs = {how: Batch(cluster, tmp_path / how.replace(" ", "_"), "--nodes=2", "--cpus-per-task=2")
            for how in ("scontrol requeue", "USR1 notice")}
    for how, job in jobs.items():
        job.training()
        if how == "scontrol requeue":
            cluster.run("scontrol", "requeue", job.id)
        else:
            cluster.run("scancel", "--signal=USR1", job.id)
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
        if how == "USR1 notice":
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
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cluster = slurm_clusters.get(nodes=1, accounting=True)
    sweep = subprocess.run([*TRAIN, "-m", "hydra/launcher=slurm", "hydra.launcher.timeout_min=10",
                            f"hydra.sweep.dir={tmp_path / 'sweep'}", *LAYOUT, "trainer.devices=2",
                            "trainer.max_steps=2", "strategy=gpipe,dapple"], env=cluster.environ(_env()),
                           cwd=tmp_path, text=True, capture_output=True, timeout=400)
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    results = [read_results(tmp_path / "sweep" / str(n)) for n in (0, 1)]
    assert [r.status for r in results] == ["ok", "ok"] and [r.strategy for r in results] == ["gpipe", "dapple"]
    assert results[0].loss_history == pytest.approx(results[1].loss_history, abs=1e-5)
    assert "sweep: all 2 points trained" in sweep.stdout
    assert "Bypassing sacct error" not in sweep.stderr


def test_the_cluster_tests_pass_inside_a_slurm_allocation(cluster: Cluster) -> None:
    inside = subprocess.run(["srun", "--nodes=1", "--ntasks=1", sys.executable, "-m", "pytest", "-q", "-n", "0",
                             "-p", "no:cacheprovider", "-m", "not slow", str(ROOT / "tests" / "recipe" / "test_cluster.py")],
                            env=cluster.environ(_env()), cwd=ROOT, text=True, capture_output=True, timeout=300)
    assert inside.returncode == 0, inside.stdout[-3000:] + inside.stderr[-2000:]
