"""How a job ended, said once: its status, the one last line a user (or a scheduler's log) reads, and the
exit status (:mod:`pipeline_recipes.core.exits`).

The last line of every job that ran is one of::

    final train/loss = 6.6970 after 10 steps (<job dir>)
    done: nothing left to do: <checkpoint> is at step 40, trainer.max_steps = 40; raise trainer.max_steps ...
    stopped: SIGTERM received by rank 1; stopped after step 17; checkpoint <path> (resume: ckpt_path=auto)
    error: training diverged: rank 0 raised TrainingDiverged: training loss is nan at step 5 ...
    error: job failed: rank 1 (host) killed by SIGKILL (signal 9: kill -9, the out-of-memory killer, or a scheduler)
    error: job failed: rank 0 (host) raised PeerTimeoutError: rank 1 stopped answering: rank 0 waited 60s for the
        gradient all-reduce of stage 0, the limit of 60s (strategy.timeout_s); ...

and ``results.json`` says the same (``status``, ``reason``). A peer lost in a p2p wait or in a collective is said one
way, by the rank that lost it (:mod:`pipeline_recipes.core.transport`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline_recipes.core import exits

from pipeline_recipes.recipe.report.results import RunResult


@dataclass(frozen=True)
class JobEnd:
    """How a job, or one rank of it, ended: the one record from which ``results.json``'s ``status`` and
    ``reason``, the job's last line (:func:`last_line`) and the exit status (:attr:`exit_code`) are derived.

    A rank's own end (:func:`pipeline_recipes.recipe.worker.job.run_job`: ok, or stopped by the signal the ranks
    agreed on) reaches the launcher as its return value, or from a worker process as the file beside the rank's
    heartbeat (:func:`write_end`); the launcher's supervisor (:func:`pipeline_recipes.recipe.launch.supervise.diagnose`)
    makes the job's end of the ranks' ends, exit statuses, exceptions and heartbeats."""

    status: str  # ok | stopped | failed | diverged
    reason: str = ""
    detail: str = ""  # lines to show above the last line: a log's tail, a schedule grid
    signum: int | None = None  # the stop signal
    forwarded: bool = False  # the launcher received the stop signal and forwarded it to the ranks
    cut_short: int | None = None  # a later signal with which the launcher killed the stopping ranks
    rank_said: str | None = None  # the reason the node's first rank gave for its own end; None: it left no record

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def exit_code(self) -> int:
        if self.status == "stopped" and self.signum is not None:
            return exits.stopped(self.signum)
        return {"ok": exits.OK, "diverged": exits.DIVERGED}.get(self.status, exits.FAILED)

    @classmethod
    def stopped(cls, signum: int, reason: str, **fields: Any) -> JobEnd:
        return cls("stopped", reason, signum=signum, **fields)

    @classmethod
    def failed(cls, reason: str, detail: str = "") -> JobEnd:
        return cls("failed", reason, detail)

    @classmethod
    def diverged(cls, reason: str, detail: str = "") -> JobEnd:
        return cls("diverged", reason, detail)


END_SUFFIX = ".end"  # beside rank<r>.heartbeat: the rank's own end, written when its run returns


def end_path(heartbeat: str | os.PathLike[str]) -> Path:
    """Where the rank whose heartbeat file is ``heartbeat`` writes its end."""
    return Path(heartbeat).with_suffix(END_SUFFIX)


def write_end(path: str | os.PathLike[str], end: JobEnd) -> None:
    """A rank's end for the launcher (a failed write is left to the launcher: the rank then said nothing)."""
    try:
        Path(path).write_text(json.dumps({"status": end.status, "reason": end.reason, "signum": end.signum}))
    except OSError:
        pass


def read_end(path: str | os.PathLike[str]) -> JobEnd | None:
    """A rank's end as it wrote it, or None where it wrote none."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return JobEnd(str(record["status"]), str(record.get("reason") or ""), signum=record.get("signum"))


def resume_hint(checkpoint: str | None) -> str:
    if not checkpoint:
        return "no checkpoint (checkpoint.every_n_steps is null): a new run starts from step 0"
    return f"checkpoint {checkpoint} (resume: ckpt_path=auto with the same hydra.run.dir, or ckpt_path={checkpoint})"


def last_line(result: RunResult, out_dir: str) -> str:
    """The job's last line, from its ``results.json``."""
    if result.status == "ok":
        if result.reason:  # ended without training: nothing was left to do
            return f"done: {result.reason} ({out_dir})"
        if result.final_loss is None:
            return f"done ({out_dir})"
        return f"final train/loss = {result.final_loss:.4f} after {len(result.loss_history)} steps ({out_dir})"
    if result.status == "stopped":
        return f"stopped: {result.reason}; {resume_hint(result.last_checkpoint)}"
    if result.status == "diverged":
        return f"error: training diverged: {result.reason}"
    return f"error: job failed: {result.reason}"
