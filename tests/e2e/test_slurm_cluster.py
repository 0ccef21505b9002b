"""The private SLURM cluster (``scripts/slurm_cluster.py``, fixtures in ``tests/support/slurm.py``) runs real jobs: task
placement over two nodes, ``sbatch --wait``, ``scancel`` leaving no process behind under both process trackers,
``scancel --signal``, requeue, and ``--signal=USR1@<s>`` before the time limit. Trivial jobs only (shell and a few
lines of Python); the training script's own SLURM tests build on these fixtures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import slurm
from slurm import Cluster, ClusterFactory, skip_reason
from slurm_cluster import load, stop_orphans

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slurm  # and each test that starts a cluster is slow

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


@pytest.mark.slow
def test_srun_places_four_tasks_on_two_nodes(slurm_two_nodes: Cluster) -> None:
    out = slurm_two_nodes.run(
        "srun", "--nodes=2", "--ntasks-per-node=2", "--label", "bash", "-c",
        'echo "$SLURMD_NODENAME $SLURM_PROCID $SLURM_NODEID $SLURM_LOCALID $SLURM_NTASKS $SLURM_NNODES"').stdout
    tasks = sorted(tuple(line.split(": ", 1)[1].split()) for line in out.splitlines())
    assert tasks == [("n1", "0", "0", "0", "4", "2"), ("n1", "1", "0", "1", "4", "2"),
                     ("n2", "2", "1", "0", "4", "2"), ("n2", "3", "1", "1", "4", "2")]


@pytest.mark.slow
def test_sbatch_wait_runs_a_script_and_returns_its_exit_status(slurm_two_nodes: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=2 --ntasks-per-node=1 --output={tmp_path}/job-%j.out
        echo "batch $SLURM_JOB_ID on $SLURMD_NODENAME"
        srun bash -c 'echo "step $SLURM_PROCID on $SLURMD_NODENAME"'
        exit ${{EXIT_STATUS:-0}}
        """))
    # both at once (each takes one CPU of each node): sbatch --wait polls every 2 s
    sbatches = [subprocess.Popen(["sbatch", "--wait", "--parsable", str(script)], stdout=subprocess.PIPE, text=True,
                                 env=slurm_two_nodes.environ({"EXIT_STATUS": status})) for status in ("0", "3")]
    (ok, ok_rc), (failed, failed_rc) = [(p.communicate(timeout=60)[0].strip(), p.returncode) for p in sbatches]
    assert (ok_rc, failed_rc) == (0, 3)
    lines = sorted((tmp_path / f"job-{ok}.out").read_text().splitlines())
    assert lines == [f"batch {ok} on n1", "step 0 on n1", "step 1 on n2"]
    assert [slurm_two_nodes.job(job)["ExitCode"] for job in (ok, failed)] == ["0:0", "3:0"]


def _kill_left(pids: dict[int, int | None]) -> None:
    """SIGKILL those of ``pids`` ({pid: start time}) still running: a failed test leaves nothing behind."""
    for pid, started in pids.items():
        if started is not None and _start_time(pid) == started:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("proctrack", ["linuxproc", "pgid"])
def test_scancel_ends_every_process_of_the_job(proctrack: str, slurm_clusters: ClusterFactory,
                                               tmp_path: Path) -> None:
    """The batch shell, a step's task and their background children are all gone after ``scancel``, each checked by
    PID (and start time, so a reused PID does not count). Each shell waits for its children, as a job whose
    processes must all be tracked does (the next test shows what escapes when one does not)."""
    cluster = slurm_clusters.get(nodes=1, proctrack=proctrack)
    pids = tmp_path / "pids"
    script = tmp_path / "sleep.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --output={tmp_path}/sleep.out
        sleep 300 & echo $! >> {pids}
        echo $$ >> {pids}
        srun bash -c 'sleep 300 & echo $! >> {pids}; echo $$ >> {pids}; wait'
        wait
        """))
    job_id = _sbatch(cluster, script)
    recorded = [int(pid) for pid in _wait_for(pids, lambda text: len(text.split()) == 4).split()]
    started = {pid: _start_time(pid) for pid in recorded}
    try:
        assert all(started.values()), f"a job process ended before scancel: {started}"
        cluster.run("scancel", job_id)
        assert cluster.wait_job(job_id)["JobState"] == "CANCELLED"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_start_time(pid) == started[pid] for pid in recorded):
            time.sleep(0.1)
        left = [pid for pid in recorded if _start_time(pid) == started[pid]]
        assert not left, f"still running after scancel under proctrack/{proctrack}: {left}"
    finally:
        _kill_left(started)


# Two ways out of a job's tracking. A batch shell that exits leaves its background child to init: linuxproc, which
# follows parent PIDs down from slurmstepd, loses it; it keeps the shell's process group, so pgid ends it. A child
# that starts its own session leaves the process group (pgid loses it) but stays a descendant while its parent
# waits (linuxproc ends it). Output goes to /dev/null: an open step stdout would keep the step completing.
ESCAPES = {
    "orphan": "sleep 300 </dev/null >/dev/null 2>&1 & echo $! > {pid}\n",  # the job then ends by itself
    "setsid": "srun bash -c 'setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $! > {pid}; wait'\n",
}


@pytest.mark.slow
@pytest.mark.parametrize(("proctrack", "escape", "ended"), [
    ("linuxproc", "orphan", False), ("pgid", "orphan", True), ("linuxproc", "setsid", True), ("pgid", "setsid", False)])
def test_what_each_process_tracker_misses(proctrack: str, escape: str, ended: bool, slurm_clusters: ClusterFactory,
                                          tmp_path: Path) -> None:
    """``proctrack/linuxproc`` misses a process whose parent exited first; ``proctrack/pgid`` misses one that left
    the process group. A job whose processes must all end keeps them as waited-for children in its group."""
    cluster = slurm_clusters.get(nodes=1, proctrack=proctrack)
    pid_file = tmp_path / "pid"
    script = tmp_path / "escape.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/escape.out\n" + ESCAPES[escape].format(pid=pid_file))
    job_id = _sbatch(cluster, script)
    pid = int(_wait_for(pid_file, lambda text: text.strip().isdigit()))
    started = {pid: _start_time(pid)}  # None already: pgid ends the orphan as soon as the batch shell exits

    def alive() -> bool:
        return started[pid] is not None and _start_time(pid) == started[pid]

    try:
        if escape == "setsid":
            cluster.run("scancel", job_id)
        cluster.wait_job(job_id)
        deadline = time.monotonic() + (5 if ended else 1)
        while time.monotonic() < deadline and alive():
            time.sleep(0.1)
        assert alive() != ended
    finally:
        _kill_left(started)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_sacct_reports_completed_and_cancelled_jobs_with_accounting(slurm_clusters: ClusterFactory,
                                                                    tmp_path: Path) -> None:
    cluster = slurm_clusters.get(nodes=1, accounting=True)
    done = cluster.run("sbatch", "--wait", "--parsable", f"--output={tmp_path}/done.out", "--wrap=true").stdout.strip()
    cancelled = cluster.run("sbatch", "--parsable", f"--output={tmp_path}/cancelled.out", "--wrap=sleep 300"
                            ).stdout.strip()
    cluster.wait_job(cancelled, states=("RUNNING",))
    cluster.run("scancel", cancelled)
    states: dict[str, str] = {}
    deadline = time.monotonic() + 20  # slurmctld sends job records to slurmdbd within seconds
    while time.monotonic() < deadline and states != {done: "COMPLETED", cancelled: "CANCELLED"}:
        out = cluster.run("sacct", "--allocations", "--noheader", "--parsable2", "--format=JobID,State",
                          "--jobs", f"{done},{cancelled}").stdout
        states = {job: state.split()[0] for job, state in (line.split("|") for line in out.splitlines())}
        time.sleep(0.5)
    assert states == {done: "COMPLETED", cancelled: "CANCELLED"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "slurm_cluster.py"), *args], capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.slow
def test_cli_stop_ends_every_daemon_and_job_by_pid(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``start`` in one process, ``stop`` in another: the daemons (from ``cluster.json``) and a running job's
    processes are all gone."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("cli")
    started = _cli("start", "--nodes", "2", "--dir", str(workdir))
    assert started.returncode == 0, started.stderr
    assert started.stdout == f"export SLURM_CONF={workdir / 'slurm.conf'}\n"
    cluster = load(workdir)
    daemons = {d.label: d for d in cluster.daemons}
    try:
        assert sorted(daemons) == ["munged", "slurmctld", "slurmd-n1", "slurmd-n2"]
        assert all(d.alive() for d in daemons.values())
        pid_file = workdir / "job.pid"
        cluster.run("sbatch", f"--output={workdir}/job.out", f"--wrap=srun bash -c 'echo $$ > {pid_file}; sleep 300'")
        pid = int(_wait_for(pid_file, lambda text: text.strip().isdigit()))
        job_process = _start_time(pid)
    finally:
        stopped = _cli("stop", "--dir", str(workdir))
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stderr == ""  # nothing had to be killed after the daemons stopped
    assert [label for label, d in daemons.items() if d.alive()] == []
    assert _start_time(pid) != job_process


@pytest.mark.slow
def test_a_cluster_whose_owner_died_is_stopped_by_stop_orphans(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A test session killed before its teardown leaves its cluster running; the next session's first cluster
    start stops it (``stop_orphans``), by PID."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("orphan")
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import slurm_cluster; " \
           f"slurm_cluster.start({str(workdir)!r}, owned=True)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    orphan = load(workdir)
    assert orphan.owner is not None and orphan.alive() == ["munged", "slurmctld", "slurmd-n1"]
    try:
        assert workdir in stop_orphans()
        assert orphan.alive() == []
    finally:
        orphan.stop()


def test_skip_reason_names_what_is_missing_and_the_failed_install(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """Where .ci/run could not install SLURM, the tests skip with what is missing and the install's last line."""
    log = tmp_path / "slurm-install.log"
    log.write_text("Reading package lists...\nE: Unable to locate package slurm-wlm\n")
    monkeypatch.setenv("SLURM_INSTALL_LOG", str(log))
    monkeypatch.setattr(slurm, "missing_programs", lambda accounting=False: ["slurmctld", "munged"])
    monkeypatch.setattr(slurm.os, "geteuid", lambda: 0)
    assert slurm.skip_reason() == (
        "SLURM not installed: slurmctld, munged missing (apt-get install slurm-wlm munge); .ci/run's install "
        f"failed, see {log}: E: Unable to locate package slurm-wlm")
