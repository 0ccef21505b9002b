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

from dataclasses import dataclass

from pipeline_recipes.core import exits

from pipeline_recipes.recipe.report.results import RunResult


@dataclass(frozen=True)
class JobEnd:
    """A job's status (``results.json``), why, and the exit status its processes end with."""

    status: str
    reason: str = ""
    exit_code: int = exits.OK

    def as_status(self) -> tuple[str, str]:
        return self.status, self.reason

    @classmethod
    def stopped(cls, signum: int, reason: str) -> JobEnd:
        return cls("stopped", reason, exits.stopped(signum))

    @classmethod
    def failed(cls, reason: str) -> JobEnd:
        return cls("failed", reason, exits.FAILED)

    @classmethod
    def diverged(cls, reason: str) -> JobEnd:
        return cls("diverged", reason, exits.DIVERGED)


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
