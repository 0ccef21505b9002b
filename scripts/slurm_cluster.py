#!/usr/bin/env python
"""A private SLURM cluster on this host, for tests and CI: one munged, one slurmctld and one or two slurmd.

    python scripts/slurm_cluster.py start --nodes 2 --dir /tmp/slurm   # prints export SLURM_CONF=...
    eval "$(python scripts/slurm_cluster.py start --nodes 2 --dir /tmp/slurm)"; srun -N2 hostname
    python scripts/slurm_cluster.py stop --dir /tmp/slurm

From Python: ``cluster = start(workdir, nodes=2)``, then ``cluster.run("srun", "-N2", "hostname")`` (or any
command with ``env=cluster.environ()``), and ``cluster.stop()``.

Everything lives in ``workdir``: the cluster's own ``slurm.conf`` (clients find it through ``SLURM_CONF``, so the
system's configuration is never read or touched), a munge key and socket of its own (a system munged, if any, is
left alone), state, spool, logs and ``cluster.json`` (every daemon's PID with its start time, which ``stop``
reads). The daemons run in the foreground of their own sessions, so their PIDs are known from the start; ports
are free ones picked at start, so several clusters (two pytest-xdist workers, say) can run side by side. Nodes
are ``n1``, ``n2`` on 127.0.0.1 (``NodeAddr``), each with its own slurmd port and spool directory. SLURM itself
never resolves the names, but a job does: Lightning and ``train.py`` meet at the first node of
``SLURM_NODELIST`` by name, as on a real cluster, so ``start`` adds one ``/etc/hosts`` line for them (marked with
the cluster's directory) and ``stop`` removes exactly that line. Job ids start at a number of the cluster's own
(``FirstJobId``), so the ports Lightning derives from them (15000 + the id's last 4 digits) differ between
clusters running side by side. Needs root (slurmd starts jobs as any user) and the
Debian packages ``slurm-wlm`` and ``munge``; accounting (``sacct``) also needs ``slurmdbd`` and
``mariadb-server``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PARTITION = "cpu"
PROCTRACK = {"linuxproc": "proctrack/linuxproc", "pgid": "proctrack/pgid"}
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("munge", "sinfo", "squeue", "scontrol", "scancel", "srun", "sbatch")
ACCOUNTING_PROGRAMS = ("slurmdbd", "mariadbd", "mariadb-install-db", "mariadb", "sacct", "sacctmgr")
# a throwaway database: small redo log, no fsync (a third of mariadb-install-db's time, a fifth of its 113 MB)
MARIADB_FAST = ("--innodb-log-file-size=8M", "--innodb-buffer-pool-size=32M", "--innodb-flush-log-at-trx-commit=0",
                "--innodb-doublewrite=0", "--innodb-flush-method=nosync", "--skip-log-bin")
MARKER = "SLURM_PRIVATE_CLUSTER"  # set in every daemon's environment (slurmstepd inherits it): the stop sweep's key
CRED_EXPIRE_S = 5  # job credential lifetime: a requeued job starts again after it (Slurm refuses less than 5)
# Slurm's KillWait, the seconds between a cancelled job's SIGTERM and SIGKILL: SLURM's own default, which
# docs/slurm.md asks to keep above a step plus a checkpoint (every rank stops after the step it is in, saves it and
# writes results.json: 4 to 12 s measured for gpt2-tiny on a loaded 2-core host; with less, SIGKILL comes first)
KILL_WAIT_S = 30
MAX_WORKDIR_CHARS = 60  # slurmstepd's sockets are <workdir>/spool/<node>/<node>_<job>.<step>, at most 108 bytes


class SlurmClusterError(RuntimeError):
    """A daemon or command of the private cluster failed; the message names it and its log."""


def missing_programs(accounting: bool = False) -> list[str]:
    """The programs ``start`` needs that are not on PATH (``/usr/sbin`` included, where Debian puts daemons)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    wanted = DAEMONS + CLIENTS + (ACCOUNTING_PROGRAMS if accounting else ())
    return [name for name in wanted if shutil.which(name, path=path) is None]


def _program(name: str) -> str:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = shutil.which(name, path=path)
    if found is None:
        raise SlurmClusterError(f"{name} is not installed (Debian: apt-get install slurm-wlm munge)")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that nothing listens on now (the kernel's choice, so unlikely to be reused
    before the daemons bind them)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None if it is gone or
    a zombie: with the PID, it names one process even after the PID is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return None if fields[0] in ("Z", "X") else int(fields[19])


@dataclass(frozen=True)
class Daemon:
    """One running daemon: its label (``slurmd-n1``), PID and start time, and its log."""

    label: str
    pid: int
    start_time: int
    log: Path

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start_time

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def _wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path} was not written)"
    return "\n".join(text[-lines:])


@dataclass
class Cluster:
    """A started private cluster. ``environ()`` is the environment for its clients (``srun``, ``sbatch``,
    ``scancel``, ``squeue``, ``sinfo``, ``scontrol``, and ``sacct`` with accounting); ``stop()`` ends it."""

    workdir: Path
    nodes: tuple[str, ...]
    cpus_per_node: int
    proctrack: str
    accounting: bool
    kill_wait: int = KILL_WAIT_S
    owner: tuple[int, int] | None = None  # (PID, start time) of the process whose end orphans the cluster
    daemons: list[Daemon] = field(default_factory=list)
    partition: str = PARTITION
    _children: dict[int, subprocess.Popen] = field(default_factory=dict, repr=False)

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The variables that point a client at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment without any ``SLURM_*`` variable of an enclosing job, plus ``env``."""
        base = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        return {**base, **self.env, **(extra or {})}

    def log(self, label: str) -> Path:
        return self.workdir / "log" / f"{label}.log"

    def run(self, *args: str, timeout: float = 60, check: bool = True, input: str | None = None,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a client command against this cluster; a non-zero exit (with ``check``) raises with its output and
        the controller's log."""
        proc = subprocess.run(args, env=self.environ(env), capture_output=True, text=True, timeout=timeout,
                              input=input, stdin=None if input is not None else subprocess.DEVNULL, check=False)
        if check and proc.returncode != 0:
            raise SlurmClusterError(
                f"{shlex.join(args)} exited with {proc.returncode}\nstdout: {proc.stdout.strip()}\n"
                f"stderr: {proc.stderr.strip()}\nslurmctld log: {self.log('slurmctld')}")
        return proc

    def job(self, job_id: int | str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``RestartCnt``, ``ExitCode``, ...): without accounting this
        is how a job's outcome is read, for ``MinJobAge`` (300 s) after it ends."""
        out = self.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_job(self, job_id: int | str, states: Iterable[str] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                     "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"),
                 timeout: float = 30) -> dict[str, str]:
        """Wait until the job's state is one of ``states`` (by default any end state); return its fields."""
        wanted = set(states)
        last: dict[str, str] = {}

        def reached() -> bool:
            nonlocal last
            last = self.job(job_id)
            return last.get("JobState") in wanted

        if not _wait_until(reached, timeout, interval=0.2):
            raise SlurmClusterError(f"job {job_id} still {last.get('JobState')} after {timeout:.0f} s (waited for "
                                    f"{sorted(wanted)}); slurmctld log: {self.log('slurmctld')}")
        return last

    def alive(self) -> list[str]:
        """Labels of the daemons still running."""
        return [daemon.label for daemon in self.daemons if daemon.alive()]

    def stop(self, timeout: float = 10) -> list[str]:
        """Cancel every job, stop every daemon by PID (SIGTERM, then SIGKILL after ``timeout``), then kill any
        process left with this cluster's marker (a slurmstepd, with its children). Returns what had to be killed
        that way (empty when all ended by themselves). Safe to call twice."""
        if "slurmctld" in self.alive():
            try:
                self.run("scancel", f"--partition={self.partition}", check=False, timeout=timeout)
                _wait_until(lambda: not self.run("squeue", "--noheader", check=False, timeout=timeout).stdout.strip(),
                            timeout + self.kill_wait)
            except subprocess.TimeoutExpired:
                pass  # a controller that does not answer is stopped below all the same
        order = ("slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged")  # clients of a daemon stop before it
        for prefix in order:
            group = [d for d in self.daemons if d.label.split("-")[0] == prefix]
            for daemon in group:
                daemon.signal(signal.SIGTERM)
            for daemon in group:
                if not _wait_until(lambda d=daemon: not d.alive(), timeout):
                    daemon.signal(signal.SIGKILL)
                    _wait_until(lambda d=daemon: not d.alive(), timeout)
        killed = _kill_marked(str(self.workdir))
        remove_host_names(self.workdir)
        for child in self._children.values():
            child.wait(timeout)
        self._children.clear()
        still = self.alive()
        if still:
            raise SlurmClusterError(f"could not stop {still} of the cluster in {self.workdir}")
        return killed

    def record(self) -> None:
        """Write ``cluster.json``: what ``load`` (and so the CLI's ``stop``) needs to find the daemons again."""
        data = {"nodes": list(self.nodes), "cpus_per_node": self.cpus_per_node, "proctrack": self.proctrack,
                "accounting": self.accounting, "kill_wait": self.kill_wait, "owner": self.owner,
                "partition": self.partition,
                "daemons": [{"label": d.label, "pid": d.pid, "start_time": d.start_time, "log": str(d.log)}
                            for d in self.daemons]}
        (self.workdir / "cluster.json").write_text(json.dumps(data, indent=1) + "\n")


def load(workdir: str | Path) -> Cluster:
    """The cluster that ``start`` recorded in ``workdir`` (its daemons may have ended since)."""
    workdir = Path(workdir).resolve()
    data = json.loads((workdir / "cluster.json").read_text())
    daemons = [Daemon(d["label"], d["pid"], d["start_time"], Path(d["log"])) for d in data.pop("daemons")]
    owner = data.pop("owner", None)
    owner = tuple(owner) if owner else None
    return Cluster(workdir=workdir, daemons=daemons, nodes=tuple(data.pop("nodes")), owner=owner, **data)


def stop_orphans() -> list[Path]:
    """Stop every cluster on this host whose owner process has ended without stopping it (a test session that was
    killed): found by the marker in its daemons' environment. Clusters started without an owner (the CLI's) are
    left alone. Returns their directories."""
    workdirs = set()
    prefix = f"{MARKER}=".encode()
    for pid in _processes():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        workdirs.update(Path(item[len(prefix):].decode()) for item in environ if item.startswith(prefix))
    stopped = []
    for workdir in sorted(workdirs):
        try:
            cluster = load(workdir)
        except (OSError, ValueError):
            continue
        if cluster.owner and _start_time(cluster.owner[0]) != cluster.owner[1]:
            cluster.stop()
            stopped.append(workdir)
    return stopped


def _processes() -> dict[int, int]:
    """Every process's parent: {pid: ppid}."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parents


def _has_marker(pid: int, value: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{MARKER}={value}".encode() in environ.split(b"\0")


def _kill_marked(value: str) -> list[str]:
    """SIGKILL every process whose environment carries ``MARKER=value`` (the daemons and the slurmstepd they
    start), and every descendant of one; returns ``"PID command"`` for each."""
    parents = _processes()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    victims: list[int] = []
    todo = [pid for pid in parents if pid != os.getpid() and _has_marker(pid, value)]
    while todo:
        pid = todo.pop()
        if pid not in victims:
            victims.append(pid)
            todo.extend(children.get(pid, []))
    killed = []
    for pid in victims:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        killed.append(f"{pid} {command}")
    return killed


def _slurm_conf(cluster: Cluster, ports: dict[str, int], hostname: str, memory_mb: int) -> str:
    w = cluster.workdir
    node_lines = [f"NodeName={node} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={ports[node]} "
                  f"CPUs={cluster.cpus_per_node} RealMemory={memory_mb} State=UNKNOWN" for node in cluster.nodes]
    if cluster.accounting:
        accounting = ["AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=127.0.0.1",
                      f"AccountingStoragePort={ports['slurmdbd']}",
                      # the munge socket for slurmdbd connections (AuthInfo is not read for them)
                      f"AccountingStoragePass={cluster.workdir / 'run' / 'munge.socket'}"]
    else:
        accounting = ["AccountingStorageType=accounting_storage/none"]
    return "\n".join([
        f"# written by scripts/slurm_cluster.py: a private cluster in {w}",
        f"ClusterName=private{ports['slurmctld']}",
        f"FirstJobId={first_job_id(ports['slurmctld'])}",  # Lightning's port is 15000 + the id's last 4 digits
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ports['slurmctld']}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: a requeued job waits this long (default 120 s) before it may start again
        f"AuthInfo=socket={w / 'run' / 'munge.socket'},cred_expire={CRED_EXPIRE_S}",
        f"StateSaveLocation={w / 'state'}",
        f"SlurmdSpoolDir={w / 'spool'}/%n",
        f"SlurmctldPidFile={w / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={w / 'run'}/slurmd-%n.pid",
        f"SlurmctldLogFile={w / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={w / 'log'}/slurmd-%n.log",
        f"ProctrackType={PROCTRACK[cluster.proctrack]}",
        "TaskPlugin=task/none",  # no cgroups: cgroup.conf is left out (CgroupPlugin=disabled is not in 22.05)
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",  # CPUs are the consumable: RealMemory is advertised, not enforced
        "SlurmdParameters=config_overrides",  # the nodes share one host: take CPUs/RealMemory as written
        # the main scheduler every second (default 60 s: a requeued job would wait for it after its BeginTime)
        "SchedulerParameters=sched_interval=1,bf_interval=1",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobRequeue=1",  # batch jobs may be requeued (scontrol requeue, or by slurmctld after a node failure)
        f"KillWait={cluster.kill_wait}",  # seconds between a cancelled or timed-out job's SIGTERM and SIGKILL
        "InactiveLimit=0",
        "MinJobAge=300",  # scontrol show job still knows an ended job for 5 minutes (no sacct without accounting)
        "SlurmdTimeout=60",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",  # no per-task usage sampling (sacct still has states and times)
        *accounting,
        *node_lines,
        f"PartitionName={cluster.partition} Nodes={','.join(cluster.nodes)} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def first_job_id(controller_port: int) -> int:
    """The cluster's first job id, from its (free, so distinct) controller port: side by side, two clusters' jobs
    get ids whose last 4 digits differ, and so do the ports Lightning derives from them."""
    return 1000 * (1 + controller_port % 9) + controller_port % 1000


HOSTS = Path("/etc/hosts")


def _hosts_mark(workdir: Path) -> str:
    return f"# {MARKER} {workdir}"


def add_host_names(cluster: Cluster) -> None:
    """Make the node names resolve to 127.0.0.1 (a line of ``/etc/hosts`` marked with the cluster's directory,
    written in place: in a container the file may be a bind mount)."""
    mark = _hosts_mark(cluster.workdir)
    text = HOSTS.read_text() if HOSTS.exists() else ""
    if mark in text:
        return
    line = f"127.0.0.1 {' '.join(cluster.nodes)}  {mark}\n"
    with HOSTS.open("a") as hosts:
        hosts.write(("" if not text or text.endswith("\n") else "\n") + line)


def remove_host_names(workdir: Path) -> None:
    """Remove the ``/etc/hosts`` line of the cluster in ``workdir`` (and only it)."""
    if not HOSTS.exists():
        return
    mark = _hosts_mark(workdir)
    lines = HOSTS.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.rstrip("\n").endswith(mark)]
    if kept != lines:
        with HOSTS.open("w") as hosts:
            hosts.writelines(kept)


def _spawn(cluster: Cluster, label: str, argv: list[str], log: Path | None = None) -> Daemon:
    """Start a daemon in the foreground of its own session, its output in ``log/<label>.out``; ``log`` is where it
    logs (default ``log/<label>.log``)."""
    out = (cluster.workdir / "log" / f"{label}.out").open("wb")
    env = {**cluster.environ(), MARKER: str(cluster.workdir)}
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, close_fds=True)
    out.close()
    cluster._children[child.pid] = child
    daemon = Daemon(label, child.pid, _start_time(child.pid) or -1, log or cluster.log(label))
    cluster.daemons.append(daemon)
    cluster.record()
    return daemon


def _check_running(cluster: Cluster, daemon: Daemon, what: str) -> None:
    if not daemon.alive():
        out = cluster.workdir / "log" / f"{daemon.label}.out"
        tail = _tail(daemon.log) if daemon.log == out else f"{_tail(daemon.log)}\n{out}:\n{_tail(out, 5)}"
        raise SlurmClusterError(f"{daemon.label} exited while {what}; its log: {daemon.log}:\n{tail}")


def _node_states(cluster: Cluster) -> dict[str, str]:
    proc = cluster.run("sinfo", "--Node", "--noheader", "--format=%N %t", check=False, timeout=10)
    return dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)


def start(workdir: str | Path, nodes: int = 1, cpus_per_node: int | None = None, proctrack: str = "linuxproc",
          accounting: bool = False, kill_wait: int = KILL_WAIT_S, owned: bool = False, timeout: float = 30) -> Cluster:
    """Start a private cluster in ``workdir`` (created; must not hold a running cluster) and wait until ``sinfo``
    shows every node idle. ``cpus_per_node`` defaults to this machine's CPU count (each node advertises them all);
    ``proctrack`` is ``linuxproc`` or ``pgid``; ``accounting`` adds slurmdbd on a private MariaDB (``sacct``);
    ``kill_wait`` is Slurm's KillWait, the seconds a cancelled job's processes get between SIGTERM and SIGKILL
    (default :data:`KILL_WAIT_S`, SLURM's own: above a step plus a checkpoint, as ``docs/slurm.md`` asks);
    ``owned`` makes this process its owner: once it ends, ``stop_orphans`` may stop the cluster. On failure every
    daemon started is stopped and the error names the daemon and its log."""
    if os.geteuid() != 0:
        raise SlurmClusterError("a private SLURM cluster needs root (slurmd starts job steps as their user)")
    if proctrack not in PROCTRACK:
        raise SlurmClusterError(f"proctrack must be one of {sorted(PROCTRACK)}, not {proctrack!r}")
    if nodes not in (1, 2):
        raise SlurmClusterError(f"nodes must be 1 or 2, not {nodes}")
    missing = missing_programs(accounting)
    if missing:
        raise SlurmClusterError(f"not installed: {', '.join(missing)} (Debian: apt-get install slurm-wlm munge"
                                + (" slurmdbd mariadb-server)" if accounting else ")"))
    workdir = Path(workdir).resolve()
    if len(str(workdir)) > MAX_WORKDIR_CHARS:
        raise SlurmClusterError(f"{workdir} is longer than {MAX_WORKDIR_CHARS} characters: slurmstepd's sockets "
                                "under it would pass the 108-byte limit of a socket path")
    if (workdir / "cluster.json").exists() and load(workdir).alive():
        raise SlurmClusterError(f"{workdir} already holds a running cluster ({load(workdir).alive()}): stop it first")
    names = tuple(f"n{i + 1}" for i in range(nodes))
    me = (os.getpid(), _start_time(os.getpid()) or 0)
    cluster = Cluster(workdir=workdir, nodes=names, cpus_per_node=cpus_per_node or os.cpu_count() or 1,
                      proctrack=proctrack, accounting=accounting, kill_wait=kill_wait, owner=me if owned else None)
    for sub in ("etc", "run", "state", "log", *(f"spool/{n}" for n in names)):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    (workdir / "etc").chmod(0o700)
    key = workdir / "etc" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    ports = dict(zip(("slurmctld", "slurmdbd", "mariadb", *names), free_ports(3 + nodes)))
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    cluster.conf.write_text(_slurm_conf(cluster, ports, socket.gethostname(), memory_mb))
    try:
        add_host_names(cluster)
        _start_daemons(cluster, ports, timeout)
    except BaseException:
        with contextlib.suppress(SlurmClusterError):  # the start's error is the one to see
            cluster.stop(timeout=5)
        raise
    return cluster


def _start_daemons(cluster: Cluster, ports: dict[str, int], timeout: float) -> None:
    w = cluster.workdir
    munged = _spawn(cluster, "munged", [
        _program("munged"), "--foreground", "--force",  # --force: the socket's parent may be private (root only)
        f"--socket={w / 'run' / 'munge.socket'}", f"--key-file={w / 'etc' / 'munge.key'}",
        f"--pid-file={w / 'run' / 'munged.pid'}", f"--seed-file={w / 'etc' / 'munged.seed'}"],
        log=w / "log" / "munged.out")  # in the foreground munged logs to stderr
    if not _wait_until(lambda: (w / "run" / "munge.socket").exists() or not munged.alive(), timeout):
        raise SlurmClusterError(f"munged made no socket in {timeout:.0f} s; its log: {munged.log}")
    _check_running(cluster, munged, "starting")
    if cluster.accounting:
        _start_accounting(cluster, ports, timeout)
    ctld = _spawn(cluster, "slurmctld", [_program("slurmctld"), "-D"])
    if not _wait_until(lambda: cluster.run("scontrol", "ping", check=False, timeout=10).returncode == 0
                       or not ctld.alive(), timeout):
        raise SlurmClusterError(f"slurmctld did not answer scontrol ping in {timeout:.0f} s; its log: {ctld.log}")
    _check_running(cluster, ctld, "starting")
    slurmds = [_spawn(cluster, f"slurmd-{node}", [_program("slurmd"), "-D", "-N", node]) for node in cluster.nodes]
    states: dict[str, str] = {}

    def idle() -> bool:
        nonlocal states
        for daemon in [ctld, *slurmds]:
            _check_running(cluster, daemon, "waiting for the nodes")
        states = _node_states(cluster)
        return all(states.get(node) == "idle" for node in cluster.nodes)

    if not _wait_until(idle, timeout, interval=0.1):
        logs = ", ".join(str(d.log) for d in slurmds)
        raise SlurmClusterError(f"nodes not idle after {timeout:.0f} s (sinfo: {states or 'no answer'}); "
                                f"slurmd logs: {logs}; slurmctld log: {ctld.log}")


def _start_accounting(cluster: Cluster, ports: dict[str, int], timeout: float) -> None:
    """A private MariaDB (its own data directory, socket and 127.0.0.1 port) and slurmdbd on it, with this cluster
    registered: what ``sacct`` reads. The database user ``slurm`` gets a random password."""
    w = cluster.workdir
    sock = w / "run" / "mysql.sock"
    install_log = w / "log" / "mariadb-install.log"
    with install_log.open("wb") as log:
        installed = subprocess.run([_program("mariadb-install-db"), "--no-defaults", f"--datadir={w / 'mysql'}",
                                    "--user=root", "--auth-root-authentication-method=socket", "--skip-test-db",
                                    *MARIADB_FAST],
                                   stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if installed.returncode != 0:
        raise SlurmClusterError(f"mariadb-install-db failed ({installed.returncode}); its log: {install_log}")
    mariadbd = _spawn(cluster, "mariadbd", [
        _program("mariadbd"), "--no-defaults", f"--datadir={w / 'mysql'}", "--user=root", f"--socket={sock}",
        "--bind-address=127.0.0.1", f"--port={ports['mariadb']}", f"--pid-file={w / 'run' / 'mariadbd.pid'}",
        f"--log-error={cluster.log('mariadbd')}", "--skip-name-resolve", *MARIADB_FAST])

    def sql(statement: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([_program("mariadb"), "--no-defaults", f"--socket={sock}", "--user=root",
                               f"--execute={statement}"], capture_output=True, text=True, timeout=timeout,
                              check=False)

    if not _wait_until(lambda: not mariadbd.alive() or sql("SELECT 1").returncode == 0, timeout):
        raise SlurmClusterError(f"mariadbd did not answer on {sock} in {timeout:.0f} s; its log: {mariadbd.log}")
    _check_running(cluster, mariadbd, "starting")
    password = os.urandom(12).hex()
    created = sql(f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
                  "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")
    if created.returncode != 0:
        raise SlurmClusterError(f"could not create the database user: {created.stderr.strip()}")
    dbd_conf = w / "slurmdbd.conf"  # slurmdbd reads it from SLURM_CONF's directory; it must be private
    dbd_conf.touch(mode=0o600)
    dbd_conf.write_text("\n".join([
        "AuthType=auth/munge", f"AuthInfo=socket={w / 'run' / 'munge.socket'}",
        # slurmdbd serves only where DbdHost is this host's short name ("localhost" leaves it a silent backup)
        f"DbdHost={socket.gethostname().split('.')[0]}", "DbdAddr=127.0.0.1", f"DbdPort={ports['slurmdbd']}",
        "SlurmUser=root",
        f"PidFile={w / 'run' / 'slurmdbd.pid'}", f"LogFile={cluster.log('slurmdbd')}",
        "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1", f"StoragePort={ports['mariadb']}",
        "StorageUser=slurm", f"StoragePass={password}", "StorageLoc=slurm_acct_db", ""]))
    dbd = _spawn(cluster, "slurmdbd", [_program("slurmdbd"), "-D"])
    if not _wait_until(lambda: not dbd.alive() or cluster.run(
            "sacctmgr", "--noheader", "list", "cluster", check=False, timeout=10).returncode == 0, timeout):
        raise SlurmClusterError(f"slurmdbd did not answer sacctmgr in {timeout:.0f} s; its log: {dbd.log}")
    _check_running(cluster, dbd, "starting")
    cluster.run("sacctmgr", "--immediate", "add", "cluster", f"private{ports['slurmctld']}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slurm_cluster.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("start", help="start a cluster; prints the environment its clients need")
    up.add_argument("--dir", required=True, type=Path, help="private directory (config, state, logs, PIDs)")
    up.add_argument("--nodes", type=int, choices=(1, 2), default=1)
    up.add_argument("--cpus-per-node", type=int, default=None, help="default: this machine's CPU count")
    up.add_argument("--proctrack", choices=sorted(PROCTRACK), default="linuxproc")
    up.add_argument("--accounting", action="store_true", help="slurmdbd on a private MariaDB, for sacct")
    up.add_argument("--kill-wait", type=int, default=KILL_WAIT_S,
                    help="seconds between a cancelled job's SIGTERM and SIGKILL (default: %(default)s, SLURM's own)")
    up.add_argument("--timeout", type=float, default=30, help="seconds to wait for each daemon")
    down = sub.add_parser("stop", help="stop the cluster recorded in --dir (every daemon, by PID)")
    down.add_argument("--dir", required=True, type=Path)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "start":
            cluster = start(args.dir, nodes=args.nodes, cpus_per_node=args.cpus_per_node, proctrack=args.proctrack,
                            accounting=args.accounting, kill_wait=args.kill_wait, timeout=args.timeout)
            for key, value in cluster.env.items():
                print(f"export {key}={shlex.quote(value)}")
        else:
            if not (args.dir / "cluster.json").exists():
                raise SlurmClusterError(f"no cluster recorded in {args.dir} (no cluster.json)")
            killed = load(args.dir).stop()
            if killed:
                print("killed after the daemons stopped: " + "; ".join(killed), file=sys.stderr)
    except SlurmClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
