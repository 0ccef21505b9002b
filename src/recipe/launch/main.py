"""Run one Hydra job: check the layout, start fresh worker processes, collect the results.

Every job of a ``-m`` sweep gets its own fresh processes (``python -m pipeline_recipes.recipe.worker``, one per
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
* A rank that hangs ends it too: its heartbeat (:mod:`pipeline_recipes.recipe.worker.heartbeat`) older than
  ``strategy.timeout_s`` names it, also when a peer's timed-out wait ended first.
* Under an external launcher (torchrun, SLURM) the processes already exist: the job runs in-process
  (:mod:`pipeline_recipes.recipe.check.launch_mode` tells which, and refuses a multi-node job whose nodes could not meet).
* ``trainer=auto`` becomes the node's GPUs or CPU processes first (:mod:`pipeline_recipes.recipe.check.accelerator`).
* Only global rank 0 prints the layout and the summary and writes ``results.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline_recipes.core import exits
from pipeline_recipes.core.disk import no_space, no_space_message
from pipeline_recipes.core.errors import TrainingDiverged
from pipeline_recipes.core.failures import describe_exception
from pipeline_recipes.core.signals import SignalRecord, early_signal
from pipeline_recipes.core.timeouts import COLLECTIVE_TIMEOUT_S, STOP_TIMEOUT_S

from pipeline_recipes.recipe.check.command import Checked, JobDirFull, check_command, hydra_command
from pipeline_recipes.recipe.check.launch_mode import Launch, is_global_zero, rank_env
from pipeline_recipes.recipe.report.ending import JobEnd, last_line
from pipeline_recipes.recipe.worker.job_spec import JobSpec
from pipeline_recipes.core.errors import DataError
from pipeline_recipes.core.layout import Layout

from pipeline_recipes.recipe.check.settings import num_layers  # noqa: F401 (read from here by callers)
from pipeline_recipes.recipe.report.results import RunResult, read_results, summary_table, update_results, write_results
from pipeline_recipes.recipe.check.resume import CHECKPOINT_DIR, Resume, step_checkpoints
from pipeline_recipes.recipe.launch.run_lock import RunDirBusy, RunLock
from pipeline_recipes.recipe.launch.supervise import GRACE_S, launch_workers

LOCK_MARGIN_S = 30.0  # a requeued job's wait for its previous run: beyond that run's stop and its ranks' end


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
    signals = SignalRecord()  # a stop signal from here on: no launch, or a clean stop (supervise, strategies.stop)
    signals.install()
    signals.signum = early_signal() or signals.signum  # one that came while train.py started (install_early)
    lock = RunLock(out_dir)
    try:  # the record stays in place to the process's exit: a stop signal after the end cannot turn it into a death
        return _run(cfg, hydra_cfg, multirun, out_dir, signals, lock)
    finally:
        lock.release()


def _run(cfg: DictConfig, hydra_cfg: Any, multirun: bool, out_dir: Path, signals: SignalRecord,
         lock: RunLock) -> float | None:
    checked = Checked()
    try:  # every check before launch, in-process (recipe.check.command; the tests run the same), its fixes checked too
        layout = check_command(cfg, checked, command=hydra_command(), job_dir=out_dir,
                               hold=lambda: _lock(lock, cfg, multirun, signals))
        resume = checked.resume
    except JobDirFull as err:
        _unwritable(err, out_dir)
    except ValueError as err:  # ConfigError, or the planner's PreflightError (does not fit in memory)
        choice, launch = checked.choice, checked.launch
        # a DataError's cause and fixes end the message: nothing after it (no import here: a layout error stays light)
        chosen = f"\n({choice.describe()})" if choice is not None and not isinstance(err, (DataError, RunDirBusy)) else ""
        global_zero = launch.is_global_zero if launch is not None else is_global_zero()
        if not multirun:
            if global_zero:  # under srun or torchrun every rank refuses it: one says so
                print(f"error: {err}{chosen}", file=sys.stderr)
            sys.exit(exits.REFUSED)
        if global_zero:
            write_results(out_dir, **_skipped_fields(cfg, str(err)))
            print(f"skipped {out_dir}: {err}{chosen}", flush=True)
        return None
    choice, launch, mode, report = checked.choice, checked.launch, checked.mode, checked.report
    trainer_cfg = choice.trainer
    if mode == "report":
        if launch.is_global_zero:
            print(json.dumps(report), flush=True)
        return None
    if signals.received:  # a stop signal during the checks: nothing runs
        _stopped_before_launch(out_dir, layout, launch, signals.signum, lock)
    if resume.finished(trainer_cfg.get("max_steps")):  # a requeue after the last save: the job stays finished
        return _finished(out_dir, layout, launch, resume, int(trainer_cfg["max_steps"]))
    if launch.is_global_zero:
        several = launch.external or int(trainer_cfg.get("num_nodes", 1)) > 1
        print(f"{layout.describe()}; {choice.describe()}" + (f"\n{launch.describe()}" if several else "")
              + (f"\n{resume.note}" if resume.note else ""), flush=True)
    try:
        spec = JobSpec(OmegaConf.to_container(cfg, resolve=True), layout, str(out_dir),
                       _group(cfg, multirun, hydra_cfg.sweep.dir))
        job_file = spec.save()
    except OSError as err:
        _unwritable(err, out_dir / "job.yaml")
    if launch.external:
        if launch.launcher == "slurm":  # Lightning joins the tasks whatever the job's name (salloc's "interactive")
            os.environ.update(rank_env(os.environ, launch, int(trainer_cfg["devices"]), layout.world_size))
        end = _run_here(spec, launch, signals)
    else:
        end = launch_workers(job_file, layout.world_size, int(trainer_cfg["devices"]), out_dir / "logs",
                                 hang_s=float(cfg.strategy.get("timeout_s", COLLECTIVE_TIMEOUT_S)), launch=launch,
                                 stop_timeout_s=float(cfg.get("stop_timeout_s", STOP_TIMEOUT_S)), signals=signals)
    return _conclude(out_dir, layout, end, launch, multirun)


def _lock(lock: RunLock, cfg: DictConfig, multirun: bool, signals: SignalRecord) -> None:
    """Hold the job directory for this job. A requeued SLURM job whose previous run still holds it waits as long
    as that run may take to stop (``stop_timeout_s``, then its ranks' end) and a margin, or until a stop signal."""
    wait_s = float(cfg.get("stop_timeout_s", STOP_TIMEOUT_S)) + GRACE_S + LOCK_MARGIN_S
    warning = lock.acquire(os.environ, wait_s, key="hydra.sweep.dir" if multirun else "hydra.run.dir",
                           say=lambda line: print(line, flush=True), interrupted=lambda: signals.received)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def _stopped_before_launch(out_dir: Path, layout: Layout, launch: Launch, signum: int, lock: RunLock) -> None:
    """A stop signal came before any rank started: ``results.json`` says so (a previous run's history kept; not while
    waiting for a previous run that still holds the directory), exit 128 + the signal."""
    reason = f"{exits.signal_name(signum)} received by train.py (pid {os.getpid()}) before launch; nothing ran"
    if lock.gave_up:
        reason += f" ({out_dir} left as it was: another run of the job still holds it)"
    elif launch.is_global_zero:
        try:
            update_results(out_dir / "results.json", status="stopped", reason=reason, **layout.result_fields())
        except OSError as err:
            _unwritable(err, out_dir / "results.json")
    if launch.is_global_zero:
        print(f"stopped: {reason}", file=sys.stderr, flush=True)
    sys.exit(exits.stopped(signum))


def _finished(out_dir: Path, layout: Layout, launch: Launch, resume: Resume, max_steps: int) -> float | None:
    """The checkpoint to resume is at ``trainer.max_steps`` already (a job stopped or killed after its last save, a
    requeue of a finished job): nothing runs, ``results.json`` says ``ok`` with the history it held, exit 0."""
    if not launch.is_global_zero:
        return None
    reason = (f"nothing left to do: {resume.path} is at step {resume.step}, trainer.max_steps = {max_steps}; "
              "raise trainer.max_steps to train on")
    path = out_dir / "results.json"
    held = _held_results(path)  # none left (a write that failed): the checkpoint alone says the job is done
    final_loss = held.final_loss if held.final_loss is not None or not held.loss_history else held.loss_history[-1]
    try:
        update_results(path, status="ok", reason=reason, global_step=resume.step, last_checkpoint=resume.path,
                       final_loss=final_loss, **layout.result_fields())
    except OSError as err:
        _unwritable(err, path)
    result = read_results(path)
    print(last_line(result, str(out_dir)), flush=True)
    return result.final_loss


def _run_here(spec: JobSpec, launch: Launch, signals: SignalRecord) -> JobEnd:
    """Run the job in this process (one rank of torchrun or SLURM); how it ended."""
    from pipeline_recipes.recipe.worker.job import run_job  # local: Lightning ≥6.5 s (python -X importtime); the parent never needs it

    try:
        end = run_job(spec, signals)
    except Exception as err:
        traceback.print_exc()
        status = "diverged" if isinstance(err, TrainingDiverged) else "failed"
        return JobEnd(status, f"rank {launch.rank} raised {describe_exception(err)}")
    return replace(end, rank_said=end.reason)


def _unwritable(err: OSError, path: Path) -> None:
    """A file of the job cannot be written: one line (no space left on device, or why), exit status 1."""
    if no_space(err, path):
        print(f"error: {no_space_message(path, 'cannot write')}", file=sys.stderr, flush=True)
    else:
        print(f"error: cannot write {path}: {err}", file=sys.stderr, flush=True)
    sys.exit(exits.FAILED)


def _held_results(path: Path) -> RunResult:
    """What ``results.json`` holds so far (rank 0's histories, a previous run's), or an empty result."""
    try:
        return read_results(path)
    except (OSError, ValueError):
        return RunResult()


def _record_end(out_dir: Path, layout: Layout, end: JobEnd) -> RunResult:
    """The final ``results.json``, derived from the job's end over the histories and figures rank 0 wrote while it
    ran (global rank 0 only: the one writer of a job's final results)."""
    path = out_dir / "results.json"
    held = _held_results(path)
    reason, extra = end.reason, {}
    if end.status == "stopped":
        step = f"; stopped after step {held.global_step}" if held.global_step is not None else ""
        if end.forwarded:
            said = f"{exits.signal_name(end.signum)} received by train.py (pid {os.getpid()}), forwarded to every rank"
        elif end.rank_said:
            said, step = end.rank_said, ""  # the rank's own words name the step
        else:
            said = f"{exits.signal_name(end.signum)} received by a rank"
        reason = said + step + (f"; {end.reason}" if end.reason else "")
        if end.cut_short is not None:
            clause, extra = _cut_short(out_dir, end)
            reason += f"; {clause}"
    try:
        update_results(path, status=end.status, reason=reason, **layout.result_fields(), **extra)
    except OSError as err:
        _unwritable(err, path)
    return read_results(path)


def _cut_short(out_dir: Path, end: JobEnd) -> tuple[str, dict[str, Any]]:
    """What a second signal that killed the stopping ranks skipped, and the newest checkpoint on disk when the
    step reached was not saved (rank 0 records its end only after the stop's save)."""
    cut = f"{exits.signal_name(end.cut_short)} again cut the stop short"
    if end.rank_said is not None:
        return f"{cut} after the step reached was saved (skipped: the ranks' teardown)", {}
    finished = [path for _, path, done in step_checkpoints(out_dir / CHECKPOINT_DIR) if done]
    newest = str(finished[0]) if finished else None
    return (f"{cut} before the step reached was saved (newest checkpoint: {newest or 'none'})",
            {"last_checkpoint": newest})


REQUEUE_SIGNAL = signal.SIGUSR1  # SLURM's time-limit notice by convention (sbatch --signal=USR1@<seconds>)


def requeue_slurm_job(env: Mapping[str, str]) -> str:
    """After a stop on SIGUSR1 inside a SLURM job: ``scontrol requeue`` it, so that it runs again and resumes
    (``ckpt_path=auto``) from the checkpoint just written; what happened, as a clause of the last line."""
    job = env.get("SLURM_ARRAY_JOB_ID") and f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}"
    job = job or env.get("SLURM_JOB_ID")
    if not job:
        return "not requeued (not a SLURM job)"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"SLURM job {job} not requeued: scontrol requeue failed ({err})"
    if done.returncode != 0:
        return f"SLURM job {job} not requeued: {done.stderr.strip() or done.stdout.strip()} (submit it with --requeue)"
    return f"SLURM job {job} requeued (scontrol requeue): it resumes with ckpt_path=auto"


def _conclude(out_dir: Path, layout: Layout, end: JobEnd, launch: Launch, multirun: bool) -> float | None:
    """Record and say how the job ended (global rank 0: ``results.json``, the summary, the last line), then exit
    with its status unless it trained to the end; a sweep goes on after a failed point (its end says so) but
    not after a stop signal."""
    final_loss = None
    if launch.is_global_zero:
        result = _record_end(out_dir, layout, end)
        final_loss = result.final_loss
        if end.detail.strip():
            print(end.detail.rstrip(), file=sys.stderr, flush=True)
        if result.status in ("ok", "stopped"):
            print(summary_table([result]), flush=True)
        line = last_line(result, str(out_dir))
        if result.status == "stopped" and end.signum == REQUEUE_SIGNAL:
            line += f"; {requeue_slurm_job(os.environ)}"
        print(line, file=sys.stdout if result.ok else sys.stderr, flush=True)
    elif not end.ok and end.status != "stopped":
        print(f"error: job failed on node {launch.node_rank}: {end.reason}", file=sys.stderr, flush=True)
    if end.ok:
        return final_loss
    if multirun and end.status in ("failed", "diverged"):
        return None
    sys.exit(end.exit_code)
