"""Start a node's worker processes, watch them, and say how they ended: the launcher's side of every stop.

* **A stop signal** (SIGTERM, SIGINT, SIGUSR1) to ``train.py`` is forwarded to every worker: they agree on it
  and stop after the same step with the step reached saved (:mod:`pipeline_recipes.strategies.lightning.stop`). The
  launcher waits at most ``stop_timeout_s`` for that, then kills the rest. A stop stays a stop: a later signal
  (a scheduler's kill notice after its warning, a Ctrl-C after a SIGTERM) does not interrupt the save; only a second
  Ctrl-C (SIGINT after SIGINT) cuts the wait short, and the job still ends stopped, saying what the cut skipped. A worker starts with the stop signals
  held back (:func:`pipeline_recipes.core.signals.held_back`) and takes them once its handler is in place, so a
  signal while the ranks start is never a rank's death.
* **A rank that dies** (a signal, an exit status, an exception) or **hangs** (its heartbeat older than
  ``hang_s``, :mod:`pipeline_recipes.recipe.worker.heartbeat`) ends the job: the others get ``grace_s`` to end,
  then are killed, and :func:`diagnose` names the rank that failed *first* and how (not a peer that only lost
  its connection to it).
* **No worker outlives the launcher**: each runs in its own session (a terminal's Ctrl-C reaches the
  launcher, which forwards it) and is killed by the kernel if the launcher dies
  (:func:`pipeline_recipes.core.signals.die_with_parent`, called first thing by the worker).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import IO

from pipeline_recipes.core import exits
from pipeline_recipes.core.failures import HEARTBEAT_ENV, error_path, read_error
from pipeline_recipes.core.signals import PARENT_PID_ENV, STOP_SIGNALS, SignalRecord, held_back
from pipeline_recipes.core.timeouts import STOP_TIMEOUT_S

from pipeline_recipes.recipe.check.launch_mode import Launch, worker_env
from pipeline_recipes.recipe.report.ending import JobEnd, end_path, read_end
from pipeline_recipes.recipe.worker.heartbeat import SILENT_S, heartbeat_age

GRACE_S = 10.0  # how long the other ranks get to exit on their own after one died
STOP_CODES = {exits.stopped(s) for s in STOP_SIGNALS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _LogPump(threading.Thread):
    """Copies a worker's output to its log (and, for rank 0, to the console). A log that cannot be written (a
    full disk) stops being written, not read: the worker never blocks on a full pipe."""

    def __init__(self, stream: IO[str], path: Path, echo: bool) -> None:
        super().__init__(daemon=True)
        self.stream, self.path, self.echo = stream, path, echo
        self.write_error: OSError | None = None

    def run(self) -> None:
        log: IO[str] | None = None
        try:
            log = open(self.path, "w")  # noqa: SIM115 - closed below, after the stream ends
        except OSError as err:
            self.write_error = err
        for line in self.stream:
            if log is not None:
                try:
                    log.write(line)
                    log.flush()
                except OSError as err:
                    self.write_error, log = err, None
            if self.echo:
                sys.stdout.write(line)
                sys.stdout.flush()
        if log is not None:
            try:
                log.close()
            except OSError as err:
                self.write_error = err


@dataclass
class Workers:
    """The node's worker processes, their logs and heartbeats, and when (and how) each ended."""

    first_rank: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    beats: list[Path] = field(default_factory=list)
    pumps: list[_LogPump] = field(default_factory=list)
    ended_at: dict[int, float] = field(default_factory=dict)
    killed: set[int] = field(default_factory=set)  # by the launcher

    def poll(self) -> list[int | None]:
        codes = [p.poll() for p in self.procs]
        now = time.monotonic()
        for i, code in enumerate(codes):
            if code is not None:
                self.ended_at.setdefault(i, now)
        return codes

    def send(self, signum: int) -> None:
        """``signum`` to every worker still running (each leads its own process group)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass

    def kill_now(self) -> None:
        """SIGKILL to every worker still running, marked killed by the launcher (no wait: a signal handler's)."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.killed.add(i)
        self.send(signal.SIGKILL)

    def kill(self) -> None:
        self.kill_now()
        for proc in self.procs:
            proc.wait()
        self.poll()


class StopForwarder:
    """The launcher's handler of ``STOP_SIGNALS`` while its workers run: the first signal is forwarded to every
    worker (they stop at a step boundary); a second Ctrl-C (SIGINT after SIGINT) kills them (:attr:`cut_short`), any
    other later signal is noted and the stop goes on. ``record``: the launcher's signals so far (one that came before is the first)."""

    def __init__(self, workers: Workers, record: SignalRecord | None = None) -> None:
        self.workers, self.record = workers, record
        self.signum: int | None = None
        self.at: float | None = None
        self.cut_short: int | None = None  # the signal that cut the stop short
        self.notes: list[str] = []  # said by the watch loop (printing in a handler can re-enter a stream)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopForwarder:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._handle)
        if self.signum is None and self.record is not None and self.record.signum is not None:
            self.signum, self.at = self.record.signum, time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = exits.signal_name(signum)
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
            self.workers.send(signum)
        elif signum == self.signum == signal.SIGINT and self.cut_short is None:  # Ctrl-C twice
            self.cut_short = signum
            self.notes.append(f"train.py: {name} again: cutting the stop short, every rank is killed now")
            self.workers.kill_now()
        elif self.cut_short is None:
            self.notes.append(f"train.py: {name} during the stop of {exits.signal_name(self.signum)}: the ranks go on "
                              "saving the step reached (a second Ctrl-C cuts the wait short)")

    def say_notes(self) -> None:
        while self.notes:
            print(self.notes.pop(0), file=sys.stderr, flush=True)


def launch_workers(job_file: Path, world_size: int, devices: int, log_dir: Path,
                   module: str = "pipeline_recipes.recipe.worker", grace_s: float = GRACE_S,
                   hang_s: float | None = None, launch: Launch | None = None,
                   stop_timeout_s: float = STOP_TIMEOUT_S, signals: SignalRecord | None = None) -> JobEnd:
    """Start ``devices`` workers (``python -m module job_file``) of this node (``launch``: which node
    and where the ranks meet; default one node) of a job of ``world_size`` ranks, stream rank 0's output,
    and watch them until they end (see the module docstring). ``signals``: the launcher's stop signals so far
    (one received already reaches the workers as they start)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    launch = launch or Launch("self", 0, None)
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the hub is offline only where the user says so
    port = launch.master_port or str(_free_port())
    workers = Workers(first_rank=launch.node_rank * devices)
    with StopForwarder(workers, signals) as stop:
        try:
            with held_back():  # the workers start with the stop signals held back, and so does this thread meanwhile
                for local_rank in range(devices):
                    _start(workers, module, job_file, log_dir, local_rank,
                           worker_env(base_env, launch, world_size, devices, local_rank, port))
            if stop.signum is not None:  # a signal before or while they started: each takes it once it can
                workers.send(stop.signum)
            return _watch(workers, stop, grace_s, hang_s, stop_timeout_s)
        finally:
            if any(p.poll() is None for p in workers.procs):
                workers.kill()
            for pump in workers.pumps:
                pump.join(timeout=5)


def _start(workers: Workers, module: str, job_file: Path, log_dir: Path, local_rank: int, env: dict[str, str]) -> None:
    """Start one worker in its own session, its heartbeat, error and end files cleared, its output pumped to its log."""
    rank = workers.first_rank + local_rank
    beat = log_dir / f"rank{rank}.heartbeat"
    beat.unlink(missing_ok=True)
    error_path(beat).unlink(missing_ok=True)
    end_path(beat).unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", module, str(job_file)],
                            env={**env, HEARTBEAT_ENV: str(beat), PARENT_PID_ENV: str(os.getpid())}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    workers.procs.append(proc)
    workers.beats.append(beat)
    workers.logs.append(log_dir / f"rank{rank}.log")
    pump = _LogPump(proc.stdout, workers.logs[-1], echo=rank == 0)
    pump.start()
    workers.pumps.append(pump)


def _watch(workers: Workers, stop: StopForwarder, grace_s: float, hang_s: float | None,
           stop_timeout_s: float) -> JobEnd:
    """Wait for the workers; once one fails (or hangs) give the others ``grace_s`` to end, once a stop signal
    came ``stop_timeout_s``; then kill the rest and say how the job ended."""
    failed_at: float | None = None
    timed_out_stop = False
    while True:
        stop.say_notes()
        codes = workers.poll()
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if stop.signum is not None and stop.at is not None and now - stop.at > stop_timeout_s:
            timed_out_stop = True
            break
        if failed_at is None:
            died = any(c is not None and c != 0 and c not in STOP_CODES for c in codes)
            hung = hang_s is not None and any(age > hang_s for age in _silent(workers, codes).values())
            if died or hung:
                failed_at = now
        elif now - failed_at > grace_s and stop.signum is None:
            break
        time.sleep(0.1)
    silent = _silent(workers, codes)
    if any(c is None for c in codes):
        workers.kill()
    stop.say_notes()
    codes = [p.returncode for p in workers.procs]
    end = diagnose(workers, codes, silent, stop.signum, timed_out_stop, stop_timeout_s)
    if stop.cut_short is not None and end.status == "stopped":
        return replace(end, cut_short=stop.cut_short)
    return end


def _silent(workers: Workers, codes: list[int | None]) -> dict[int, float]:
    """Ranks alive whose heartbeat is older than ``SILENT_S`` and that recorded no exception (one that
    raised may fall silent while it exits): index -> seconds of silence."""
    return {i: age for i, (code, beat) in enumerate(zip(codes, workers.beats))
            if code is None and (age := heartbeat_age(beat)) is not None and age > SILENT_S
            and read_error(error_path(beat)) is None}


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def diagnose(workers: Workers, codes: list[int | None], silent: dict[int, float], forwarded: int | None,
             timed_out_stop: bool = False, stop_timeout_s: float = 0.0) -> JobEnd:
    """How the job ended, from every rank's end record, exit status, recorded exception and heartbeat.

    A stop: every rank ended with 0 or a stop status (or the launcher forwarded a signal and killed the
    ranks that did not stop in time). A failure names the rank that failed first: a silent (hung) rank;
    else the earliest of the ranks that died without an exception of their own (a signal, an exit status)
    and the exceptions that are not a consequence of another rank's failure (a closed connection, a timed-out
    wait); else the first exception recorded. A peer's consequence is never named when a cause is known.
    """
    host = socket.gethostname()
    first = workers.first_rank

    def who(i: int) -> str:
        return f"rank {first + i} ({host})"

    errors = {i: e for i, beat in enumerate(workers.beats) if (e := read_error(error_path(beat))) is not None}
    first_end = read_end(end_path(workers.beats[0])) if workers.beats else None
    stop_codes = {c - exits.SIGNAL_BASE for c in codes if c in STOP_CODES}
    if all(c == 0 for c in codes) and forwarded is None:
        if first_end is None:
            return JobEnd.failed(f"every rank exited 0 but {who(0)} left no end record (its run did not return)")
        return JobEnd("ok", rank_said=first_end.reason)
    if (forwarded is not None or stop_codes) and all(c == 0 or c in STOP_CODES or i in workers.killed
                                                     for i, c in enumerate(codes)) and not silent:
        signum = forwarded if forwarded is not None else max(stop_codes)
        late = [who(i) for i in sorted(workers.killed)]
        reason = ""
        if timed_out_stop and late:
            reason = (f"{', '.join(late)} did not reach a step boundary within stop_timeout_s = {stop_timeout_s:g} s "
                      f"and {'were' if len(late) > 1 else 'was'} killed")
        return JobEnd.stopped(signum, reason, forwarded=forwarded is not None,
                              rank_said=first_end.reason if first_end is not None else None)
    if silent:
        i, age = min(silent.items(), key=lambda item: item[0])
        died = [j for j, c in enumerate(codes) if c not in (None, 0) and j not in workers.killed and j != i]
        then = f"; then {who(died[0])} {exits.describe_returncode(codes[died[0]])}" if died else ""
        return JobEnd.failed(f"{who(i)} stopped answering: no heartbeat for {age:.0f}s (hung, stopped or stuck "
                                 f"in one operation){then}", f"last lines of {workers.logs[i]}:\n{_tail(workers.logs[i], 8)}")
    causes: list[tuple[float, int, str, str]] = []  # (when, index, reason, detail)
    for i, code in enumerate(codes):
        if i in workers.killed or code in (None, 0) or code in STOP_CODES:
            continue
        if i not in errors:
            causes.append((workers.ended_at.get(i, time.monotonic()) - _monotonic_offset(), i,
                           f"{who(i)} {exits.describe_returncode(code)}",
                           f"last lines of {workers.logs[i]}:\n{_tail(workers.logs[i])}"))
    for i, error in errors.items():
        if not error.consequence:
            causes.append((error.at, i, f"{who(i)} raised {error.summary}", error.detail))
    if not causes:
        causes = [(e.at, i, f"{who(i)} raised {e.summary}", e.detail) for i, e in errors.items()]
    if not causes:
        return JobEnd.failed("every rank ended without an error, but not all with exit status 0: "
                                 + ", ".join(f"{who(i)} {exits.describe_returncode(c)}" for i, c in enumerate(codes)
                                             if c is not None))
    _, i, reason, detail = min(causes)
    diverged = codes[i] == exits.DIVERGED and i in errors
    return JobEnd("diverged" if diverged else "failed", reason, detail)


def _monotonic_offset() -> float:
    """``time.monotonic() - time.time()``: death times (monotonic) compared with error files' times (wall)."""
    return time.monotonic() - time.time()
