"""Run one Hydra job: check the layout, start fresh worker processes, collect the results.

Every job of a ``-m`` sweep gets its own fresh processes (``python -m recipe.worker``, one per
local rank, with the environment Lightning's own launcher would set), so nothing leaks from one
job to the next and no child re-runs the sweep (the failure of Lightning's script re-launcher
under Hydra, Lightning #15737 and #18175). The parent never imports Lightning.

* A job whose settings break a layout rule stops before any process starts: a single run exits
  with status 2 and the message; in a sweep the job is recorded as ``skipped`` and the sweep goes on.
  So does data that cannot be had; the rest is downloaded and prepared here, once per node, and the
  ranks read the cache (:mod:`pipeline_recipes.datamodules.prepare`).
* A rank that dies ends the job: the others are stopped, the job is recorded as ``failed`` with
  the first exception a rank raised (``rank <r> raised <Type>: <message>``, the job's last line; not a
  teardown's or a waiting peer's), or else the rank, its exit code and the tail of its log
  (``logs/rank<r>.log``).
* A rank that hangs ends it too: its heartbeat (:mod:`pipeline_recipes.recipe.heartbeat`) older than
  ``strategy.timeout_s`` names it, also when a peer's timed-out wait ended first.
* Under an external launcher (torchrun, SLURM) the processes already exist: the job runs in-process
  (:mod:`pipeline_recipes.recipe.cluster` tells which, and refuses a multi-node job whose nodes could not meet).
* ``trainer=auto`` becomes the node's GPUs or CPU processes first (:mod:`pipeline_recipes.recipe.accelerator`).
* Only global rank 0 prints the layout and the summary and writes ``results.json``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .checks import Checked, check_command, hydra_command
from .cluster import Launch, is_global_zero, worker_env
from .heartbeat import HEARTBEAT_ENV, SILENT_S, describe_exception, error_path, heartbeat_age, read_error
from .job_spec import JobSpec
from .layout import DataError, Layout, num_layers  # noqa: F401 (num_layers: read from here by callers)
from .results import read_results, summary_table, write_results

GRACE_S = 10.0  # how long the other ranks get to exit on their own after one died


@dataclass(frozen=True)
class Outcome:
    ok: bool
    reason: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream: IO[str], log_path: Path, echo: bool) -> None:
    with open(log_path, "w") as log:
        for line in stream:
            log.write(line)
            log.flush()
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def launch_workers(job_file: Path, layout: Layout, devices: int, log_dir: Path, module: str = "pipeline_recipes.recipe.worker",
                   grace_s: float = GRACE_S, hang_s: float | None = None, launch: Launch | None = None) -> Outcome:
    """Start ``devices`` workers (``python -m module job_file``) of this node (``launch``: which node
    and where the ranks meet; default one node), stream rank 0's output, stop them all if one dies
    or, with ``hang_s``, stops answering for that long."""
    log_dir.mkdir(parents=True, exist_ok=True)
    launch = launch or Launch("self", 0, None)
    node_rank = launch.node_rank
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the hub is offline only where the user says so
    port = launch.master_port or str(_free_port())
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    logs, beats = [], []
    try:
        for local_rank in range(devices):
            rank = node_rank * devices + local_rank
            beats.append(log_dir / f"rank{rank}.heartbeat")
            beats[-1].unlink(missing_ok=True)
            error_path(beats[-1]).unlink(missing_ok=True)
            env = {**worker_env(base_env, launch, layout.world_size, devices, local_rank, port),
                   HEARTBEAT_ENV: str(beats[-1])}
            proc = subprocess.Popen([sys.executable, "-m", module, str(job_file)], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            logs.append(log_dir / f"rank{rank}.log")
            pump = threading.Thread(target=_pump, args=(proc.stdout, logs[-1], rank == 0), daemon=True)
            pump.start()
            procs.append(proc)
            pumps.append(pump)
        return _watch(procs, logs, beats, node_rank * devices, grace_s, hang_s)
    finally:
        for proc in procs:
            _stop(proc)
        for pump in pumps:
            pump.join(timeout=5)


def _silent(codes: list[int | None], beats: list[Path]) -> dict[int, float]:
    """Ranks alive whose heartbeat is older than ``SILENT_S`` and that recorded no exception (one that
    raised may fall silent while it exits): index -> seconds of silence."""
    return {i: age for i, (code, beat) in enumerate(zip(codes, beats))
            if code is None and (age := heartbeat_age(beat)) is not None and age > SILENT_S
            and read_error(error_path(beat)) is None}


def _failure(codes: list[int | None], logs: list[Path], beats: list[Path], first_rank: int,
             silent: dict[int, float]) -> str:
    """Why the job failed: a rank silent without an exception (hung or stopped; a peer's timed-out wait
    is its consequence), else the first exception a rank recorded (one line: not a teardown's, nor a
    waiting peer's), else the first rank that died, how, and its log's last lines."""
    errors = {i: error for i, beat in enumerate(beats) if (error := read_error(error_path(beat))) is not None}
    if errors and not silent:
        i = min(errors, key=lambda j: errors[j][0])
        return f"rank {first_rank + i} raised {errors[i][1]}"
    died = [i for i, code in enumerate(codes) if code not in (None, 0)]
    failure = "".join(f"rank {first_rank + i} stopped answering: no heartbeat for {age:.0f}s (hung, stopped or stuck "
                      f"in one operation){', then' if died else ''}; last lines of {logs[i]}:\n{_tail(logs[i], 8)}"
                      for i, age in silent.items())
    if died:
        i, code = died[0], codes[died[0]]
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        failure += f"rank {first_rank + i} ended with {how}; last lines of {logs[i]}:\n" + _tail(logs[i])
    return failure


def _watch(procs: list[subprocess.Popen], logs: list[Path], beats: list[Path], first_rank: int, grace_s: float,
           hang_s: float | None) -> Outcome:
    """Wait for the workers; once one dies or hangs, give the others ``grace_s`` to end, then say why."""
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return Outcome(True)
        if failed_at is None:
            died = any(code not in (None, 0) for code in codes)
            hung = hang_s is not None and any(age > hang_s for age in _silent(codes, beats).values())
            if died or hung:
                failed_at = time.monotonic()
        if failed_at is not None and (all(c is not None for c in codes) or time.monotonic() - failed_at > grace_s):
            return Outcome(False, _failure(codes, logs, beats, first_rank, _silent(codes, beats)))
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _group(cfg: DictConfig, multirun: bool, sweep_dir: str) -> str:
    if cfg.get("experiment"):
        return str(cfg.experiment)
    return "sweep-" + "_".join(Path(sweep_dir).parts[-2:]) if multirun else "runs"


def _skipped_fields(cfg: DictConfig, reason: str) -> dict[str, Any]:
    strategy = cfg.strategy
    return {"status": "skipped", "reason": reason, "strategy": strategy.get("name"), "D": strategy.get("D"),
            "W": strategy.get("W"), "B": strategy.get("micro_batch_size"),
            "global_batch_size": cfg.data.get("global_batch_size")}


def run(cfg: DictConfig) -> float | None:
    """The body of ``train.py``: one Hydra job from config to ``results.json``."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    out_dir = Path(hydra_cfg.runtime.output_dir)
    checked = Checked()
    try:  # every check before launch, in-process (recipe.checks; the tests run the same), its fixes checked too
        layout = check_command(cfg, checked, command=hydra_command())
    except ValueError as err:  # ConfigError, or the planner's PreflightError (does not fit in memory)
        choice, launch = checked.choice, checked.launch
        # a DataError's cause and fixes end the message: nothing after it (no import here: a layout error stays light)
        chosen = f"\n({choice.describe()})" if choice is not None and not isinstance(err, DataError) else ""
        if not multirun:
            print(f"error: {err}{chosen}", file=sys.stderr)
            sys.exit(2)
        if launch.is_global_zero if launch is not None else is_global_zero():
            write_results(out_dir, **_skipped_fields(cfg, str(err)))
        print(f"skipped {out_dir}: {err}{chosen}", flush=True)
        return None
    choice, launch, mode, report = checked.choice, checked.launch, checked.mode, checked.report
    trainer_cfg = choice.trainer
    if mode == "report":
        if launch.is_global_zero:
            print(json.dumps(report), flush=True)
        return None
    if launch.is_global_zero:
        several = launch.external or int(trainer_cfg.get("num_nodes", 1)) > 1
        print(f"{layout.describe()}; {choice.describe()}" + (f"\n{launch.describe()}" if several else ""), flush=True)
    spec = JobSpec(OmegaConf.to_container(cfg, resolve=True), layout, str(out_dir),
                   _group(cfg, multirun, hydra_cfg.sweep.dir))
    job_file = spec.save()
    if launch.external:
        from .job import run_job  # local: Lightning ≥6.5 s (python -X importtime); the parent never needs it

        try:
            run_job(spec)
        except Exception as err:  # record it (global rank 0, once), then let the launcher see the failure
            if launch.is_global_zero:
                reason = f"rank {launch.rank} raised {describe_exception(err)}"
                write_results(out_dir, status="failed", reason=reason, **layout.result_fields())
            raise
        outcome = Outcome(True)
    else:
        outcome = launch_workers(job_file, layout, int(trainer_cfg["devices"]), out_dir / "logs",
                                 hang_s=float(cfg.strategy.get("timeout_s", 120)), launch=launch)
    if not outcome.ok:
        if launch.is_global_zero:
            write_results(out_dir, status="failed", reason=outcome.reason, **layout.result_fields())
        print(f"error: job failed: {outcome.reason}", file=sys.stderr, flush=True)
        if not multirun:
            sys.exit(1)
        return None
    if not launch.is_global_zero:
        return None
    result = read_results(out_dir / "results.json")
    print(summary_table([result]), flush=True)
    if result.final_loss is not None:
        print(f"final train/loss = {result.final_loss:.4f} after {len(result.loss_history)} steps ({out_dir})",
              flush=True)
    return result.final_loss
