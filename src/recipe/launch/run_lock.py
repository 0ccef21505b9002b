"""One job per job directory: the launcher holds a lock on ``<job dir>/.job.lock`` from its first check to its exit.

Two jobs writing one directory overwrite each other's checkpoints and ``results.json`` (a copy-pasted
``hydra.run.dir``, or a requeued SLURM job racing its previous instance). The lock is ``flock(2)`` on an open file:
the kernel drops it when the process that holds it ends, however it ends (``kill -9`` included), so a killed job
never leaves a stale lock behind; the file itself only says who holds it (host, pid, start time, SLURM job). On a
network file system ``flock`` is forwarded to the server (NFSv4, Lustre with ``flock``); where the file system
refuses locks the job runs unlocked and says so in one line.

A second job is refused before launch (:class:`RunDirBusy`, exit status 2) naming the holder. A requeued SLURM job
(the holder has the same SLURM job id) that finds its previous instance still stopping waits for it, at most
``wait_s``, then says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import IO

from pipeline_recipes.core.fixes import ConfigError

LOCK_FILE = ".job.lock"
POLL_S = 0.5


class RunDirBusy(ConfigError):
    """Another live job holds the job directory."""


@dataclass(frozen=True)
class Holder:
    """Who holds a job directory."""

    host: str
    pid: int
    started: str  # ISO time
    slurm_job: str | None = None

    @classmethod
    def this_process(cls, env: Mapping[str, str]) -> Holder:
        return cls(socket.gethostname(), os.getpid(), datetime.now().isoformat(timespec="seconds"), slurm_job_id(env))

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job}" if self.slurm_job else ""
        return f"host {self.host}, pid {self.pid}, started {self.started}{job}"


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The SLURM job (``<array job>_<task>`` for an array task), which a requeue keeps; None outside SLURM."""
    if env.get("SLURM_ARRAY_JOB_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}"
    return env.get("SLURM_JOB_ID") or None


class RunLock:
    """The lock of one job directory, held by this process once :meth:`acquire` returns until :meth:`release` (or
    the process ends)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / LOCK_FILE
        self._file: IO[str] | None = None
        self.gave_up = False  # a stop signal ended the wait for another run holding the directory

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, env: Mapping[str, str], wait_s: float, key: str = "hydra.run.dir",
                say: Callable[[str], None] = print, interrupted: Callable[[], bool] = lambda: False) -> str | None:
        """Take the lock, or raise :class:`RunDirBusy` naming its holder. A holder of this SLURM job (this job's
        previous instance, requeued) is waited for, at most ``wait_s``, and until ``interrupted()`` (a stop signal:
        then it returns without the lock). Returns a line to print where the file system refuses locks (the job
        then runs unlocked), else None."""
        me = Holder.this_process(env)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")  # noqa: SIM115 - held open for the life of the job
        deadline: float | None = None
        while True:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    file.close()
                    return (f"warning: {self.path.parent} cannot be locked ({os.strerror(err.errno)}): nothing stops "
                            "a second job from using the same directory")
            holder = read_holder(self.path)
            requeued = holder is not None and me.slurm_job is not None and holder.slurm_job == me.slurm_job
            if not requeued:
                file.close()
                raise RunDirBusy(f"{key}={self.path.parent} is in use by another job ({_who(holder)}): one job per "
                                 f"directory; wait for it to end, or give this job another {key}")
            if deadline is None:
                deadline = time.monotonic() + wait_s
                say(f"waiting up to {wait_s:g} s for the previous run of SLURM job {me.slurm_job} ({_who(holder)}) "
                    f"to end: it holds {self.path.parent}")
            elif interrupted():
                file.close()
                self.gave_up = True
                return None
            elif time.monotonic() > deadline:
                file.close()
                raise RunDirBusy(f"{key}={self.path.parent} is still held by the previous run of SLURM job "
                                 f"{me.slurm_job} ({_who(holder)}) after waiting {wait_s:g} s; it did not end after "
                                 "its stop: end it (scancel or kill its pid), then requeue this job")
            time.sleep(POLL_S)
        file.seek(0)
        file.truncate()
        file.write(json.dumps(asdict(me)) + "\n")
        file.flush()
        self._file = file
        return None

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None


def read_holder(path: Path) -> Holder | None:
    """What the lock file says of its holder (None while it is being written or unreadable)."""
    try:
        raw = json.loads(path.read_text() or "null")
        return Holder(**raw) if isinstance(raw, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def _who(holder: Holder | None) -> str:
    return holder.describe() if holder is not None else "a process that has not written its name yet"
