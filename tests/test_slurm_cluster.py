"""The private SLURM cluster (``scripts/slurm_cluster.py``, fixtures in ``tests/slurm.py``) runs real jobs: task
placement over two nodes, ``sbatch --wait``, ``scancel`` leaving no process behind under both process trackers,
``scancel --signal``, requeue, and ``--signal=USR1@<s>`` before the time limit. Trivial jobs only (shell and a few
lines of Python); the training script's own SLURM tests build on these fixtures."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
from slurm import Cluster, ClusterFactory

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

# A Python task that writes "ready" once its handlers are set, then the name of each signal it gets, and exits 0
# on the first one (SIGTERM, SIGUSR1).
SIGNAL_TASK = textwrap.dedent("""
    import signal, sys, time
    out = open(sys.argv[1], "a", buffering=1)
    def record(signum, frame):
        out.write(f"{signal.Signals(signum).name} {time.time()}\\n")
        sys.exit(0)
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, record)
    out.write("ready\\n")
    time.sleep(300)
    out.write("no signal\\n")
""")


def _wait_for(path: Path, predicate, timeout: float = 30) -> str:
    """The text of ``path`` once ``predicate(text)`` holds (polled; fails the test after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if predicate(text):
            return text
        time.sleep(0.1)
    pytest.fail(f"{path} after {timeout} s: {text!r}")


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _sbatch(cluster: Cluster, script: Path, *options: str) -> str:
    return cluster.run("sbatch", "--parsable", *options, str(script)).stdout.strip().split(";")[0]


def test_srun_places_four_tasks_on_two_nodes(slurm_two_nodes: Cluster) -> None:
    out = slurm_two_nodes.run(
        "srun", "--nodes=2", "--ntasks-per-node=2", "--label", "bash", "-c",
        'echo "$SLURMD_NODENAME $SLURM_PROCID $SLURM_NODEID $SLURM_LOCALID $SLURM_NTASKS $SLURM_NNODES"').stdout
    tasks = sorted(tuple(line.split(": ", 1)[1].split()) for line in out.splitlines())
    assert tasks == [("n1", "0", "0", "0", "4", "2"), ("n1", "1", "0", "1", "4", "2"),
                     ("n2", "2", "1", "0", "4", "2"), ("n2", "3", "1", "1", "4", "2")]


def test_sbatch_wait_runs_a_script_and_returns_its_exit_status(slurm_two_nodes: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=2 --ntasks-per-node=1 --output={tmp_path}/job-%j.out
        echo "batch $SLURM_JOB_ID on $SLURMD_NODENAME"
        srun bash -c 'echo "step $SLURM_PROCID on $SLURMD_NODENAME"'
        exit ${{EXIT_STATUS:-0}}
        """))
    proc = slurm_two_nodes.run("sbatch", "--wait", "--parsable", str(script))
    job_id = proc.stdout.strip()
    lines = sorted((tmp_path / f"job-{job_id}.out").read_text().splitlines())
    assert lines == [f"batch {job_id} on n1", "step 0 on n1", "step 1 on n2"]
    assert slurm_two_nodes.job(job_id)["JobState"] == "COMPLETED"

    failed = slurm_two_nodes.run("sbatch", "--wait", "--parsable", str(script), env={"EXIT_STATUS": "3"}, check=False)
    assert failed.returncode == 3
    assert slurm_two_nodes.job(failed.stdout.strip())["ExitCode"] == "3:0"


@pytest.mark.parametrize("proctrack", ["linuxproc", "pgid"])
def test_scancel_ends_every_process_of_the_job(proctrack: str, slurm_clusters: ClusterFactory,
                                               tmp_path: Path) -> None:
    """The batch shell, a step's task and their background children (same process group) are all gone after
    ``scancel``, each checked by PID (and start time, so a reused PID does not count)."""
    cluster = slurm_clusters.get(nodes=1, proctrack=proctrack)
    pids = tmp_path / "pids"
    script = tmp_path / "sleep.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --output={tmp_path}/sleep.out
        sleep 300 & echo $! >> {pids}
        echo $$ >> {pids}
        srun bash -c 'sleep 300 & echo $! >> {pids}; echo $$ >> {pids}; wait'
        """))
    job_id = _sbatch(cluster, script)
    recorded = [int(pid) for pid in _wait_for(pids, lambda text: len(text.split()) == 4).split()]
    started = {pid: _start_time(pid) for pid in recorded}
    assert all(started.values()), f"a job process ended before scancel: {started}"
    cluster.run("scancel", job_id)
    assert cluster.wait_job(job_id)["JobState"] == "CANCELLED"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_start_time(pid) == started[pid] for pid in recorded):
        time.sleep(0.1)
    left = [pid for pid in recorded if _start_time(pid) == started[pid]]
    assert not left, f"still running after scancel under proctrack/{proctrack}: {left}"


def test_pgid_tracking_misses_a_process_that_leaves_the_group(slurm_clusters: ClusterFactory,
                                                              tmp_path: Path) -> None:
    """``proctrack/pgid`` knows a step's processes by process group: a child that starts its own session (``setsid``)
    survives ``scancel``, which ``proctrack/linuxproc`` (by parent PID) would have caught. A job whose processes
    must all end stays in its group. (Its output goes elsewhere: an open stdout would keep the step completing.)"""
    cluster = slurm_clusters.get(nodes=1, proctrack="pgid")
    pid_file = tmp_path / "pid"
    script = tmp_path / "escape.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/escape.out\n"
                      f"srun bash -c 'setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $! > {pid_file}; wait'\n")
    job_id = _sbatch(cluster, script)
    pid = int(_wait_for(pid_file, lambda text: text.strip().isdigit()))
    started = _start_time(pid)
    try:
        cluster.run("scancel", job_id)
        cluster.wait_job(job_id)
        time.sleep(1)
        assert _start_time(pid) == started, "proctrack/pgid ended a process outside the step's process group"
    finally:
        if _start_time(pid) == started:
            os.kill(pid, signal.SIGKILL)


def test_scancel_signal_term_reaches_a_python_task(slurm_two_nodes: Cluster, tmp_path: Path) -> None:
    """``scancel --signal=TERM`` signals the job's steps (not the batch shell): the task records SIGTERM and exits 0,
    so the job completes."""
    (tmp_path / "task.py").write_text(SIGNAL_TASK)
    record = tmp_path / "signals"
    script = tmp_path / "term.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/term.out\n"
                      f"srun {sys.executable} {tmp_path / 'task.py'} {record}\n")
    job_id = _sbatch(slurm_two_nodes, script)
    _wait_for(record, lambda text: "ready" in text)
    slurm_two_nodes.run("scancel", "--signal=TERM", job_id)
    state = slurm_two_nodes.wait_job(job_id)
    assert [line.split()[0] for line in record.read_text().splitlines()] == ["ready", "SIGTERM"]
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0")


def test_requeued_job_runs_again_with_restart_count_one(slurm_two_nodes: Cluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    script = tmp_path / "requeue.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --requeue --output={tmp_path}/requeue.out --open-mode=append\n"
                      f'echo "run ${{SLURM_RESTART_COUNT:-0}}" >> {runs}\nsleep 300\n')
    job_id = _sbatch(slurm_two_nodes, script)
    _wait_for(runs, lambda text: text == "run 0\n")
    slurm_two_nodes.run("scontrol", "requeue", job_id)
    _wait_for(runs, lambda text: text == "run 0\nrun 1\n")  # after CRED_EXPIRE_S + a scheduler pass
    fields = slurm_two_nodes.job(job_id)
    assert (fields["JobState"], fields["Restarts"]) == ("RUNNING", "1")
    slurm_two_nodes.run("scancel", job_id)
    slurm_two_nodes.wait_job(job_id)


def test_signal_usr1_comes_before_the_time_limit(slurm_one_node: Cluster, tmp_path: Path) -> None:
    """``--signal=USR1@60`` with a one-minute limit: slurmctld checks time limits every 30 s (fixed in Slurm), so
    the signal comes at its first check after the start, 0 to 31 s in; the task records it and ends the job
    before the limit."""
    (tmp_path / "task.py").write_text(SIGNAL_TASK)
    record = tmp_path / "signals"
    script = tmp_path / "usr1.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --time=1 --signal=USR1@60 --output={tmp_path}/usr1.out\n"
                      f"srun {sys.executable} {tmp_path / 'task.py'} {record}\n")
    job_id = _sbatch(slurm_one_node, script)
    text = _wait_for(record, lambda text: "SIGUSR1" in text or "no signal" in text, timeout=45)
    state = slurm_one_node.wait_job(job_id)
    assert [line.split()[0] for line in text.splitlines()] == ["ready", "SIGUSR1"]
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0")
    received = float(text.splitlines()[1].split()[1])
    start = time.mktime(time.strptime(state["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    assert received < start + 60, "USR1 came after the time limit"
