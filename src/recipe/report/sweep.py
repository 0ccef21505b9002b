"""The end of a sweep (``train.py -m …``): every point with its status and reason, and an exit status that
says whether all of them trained.

A Hydra callback (``hydra.callbacks.sweep_summary`` in ``conf/config.yaml``): after the last job it reads the
``results.json`` of every job directory of the sweep (one with Hydra's ``.hydra`` folder; a job that wrote
none is listed as failed; a point whose SLURM job produced no result is recorded by the launcher,
:func:`record_unfinished`) and prints the table of :func:`pipeline_recipes.recipe.report.results.summary_table`,
ok points first, then stopped, diverged, refused (``skipped``) and failed ones with their reasons. When any
point did not train to the end, the last line says how many and the process exits 1: a scheduler or a CI
never reads a sweep with a failed point as success. (A stop signal ends the sweep at once, with the
stopped job's status: :mod:`pipeline_recipes.recipe.launch.main`.) Works the same for jobs run remotely by the
submitit launcher: it reads the files the jobs wrote on the shared file system. A point whose SLURM job ended
without a result (``scancel``) is recorded by :func:`record_unfinished` (the ``hydra/launcher=slurm`` preset's
launcher, :mod:`hydra_plugins.pipeline_recipes_slurm.launcher`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipeline_recipes.core import exits

from pipeline_recipes.recipe.report.results import RESULTS_FILE, RunResult, read_results, summary_table, update_results

HYDRA_DIR = ".hydra"  # Hydra writes its copy of the job's config here, in every job directory


def sweep_results(sweep_dir: Path) -> list[RunResult]:
    """One result per job directory under ``sweep_dir``, in job order; a job without a readable
    ``results.json`` is a failed one that says so."""
    ran = {p.parent for p in sweep_dir.rglob(HYDRA_DIR) if p.is_dir()} - {sweep_dir}
    # a point that never ran (cancelled while pending) has only the results.json its launcher wrote
    recorded = {p.parent for p in sweep_dir.rglob(RESULTS_FILE) if p.is_file() and p.parent != sweep_dir
                and not any(d in p.parents for d in ran)}
    jobs = sorted(ran | recorded,
                  key=lambda d: [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in d.relative_to(sweep_dir).parts])
    results = []
    for job in jobs:
        try:
            results.append(read_results(job / RESULTS_FILE))
        except (OSError, ValueError) as err:
            results.append(RunResult(status="failed", reason=f"no results.json in {job} ({type(err).__name__}): "
                                     "the job ended before it could write one; see its logs", path=job))
    return results


CANCELLED = "CANCELLED"  # SLURM's job state after scancel ("CANCELLED by <uid>")


def _said(held: RunResult | None) -> str:
    """What a point's ``results.json`` said, as a clause."""
    if held is None:
        return "it wrote no results.json (it never started, or ended before writing one)"
    step = f" at step {held.global_step}" if held.global_step is not None else ""
    return f"its results.json said {held.status or '?'}{step}" + (f": {held.reason}" if held.reason else "")


def record_unfinished(job_dir: Path, job_id: str, state: str) -> RunResult:
    """Record a sweep point whose SLURM job ``job_id`` ended in ``state`` without a result (submitit's
    ``UncompletedJobError``) in its ``results.json``, over what it held, and return it: ``stopped`` when SLURM
    cancelled it (``scancel``), else ``failed`` (a ``stopped``, ``diverged`` or ``failed`` record of its own kept),
    the reason naming the job, its state and what the point's ``results.json`` said. A point that said ``ok`` trained
    to the end and stays so."""
    try:
        held: RunResult | None = read_results(job_dir / RESULTS_FILE)
    except (OSError, ValueError):
        held = None
    if held is not None and held.ok:
        return held
    if state.upper().startswith(CANCELLED):
        status, reason = "stopped", f"cancelled by SLURM (scancel): job {job_id}, state {state}; {_said(held)}"
    else:
        own = held.status if held is not None and held.status in ("stopped", "diverged", "failed") else None
        status = own or "failed"
        reason = f"SLURM job {job_id} ended without a result (state {state}); {_said(held)}"
    return read_results(update_results(job_dir / RESULTS_FILE, status=status, reason=reason))


def sweep_verdict(results: list[RunResult]) -> tuple[int, str]:
    """The sweep's exit status and last line."""
    bad = [r for r in results if not r.ok]
    if not results:
        return exits.FAILED, "error: the sweep ran no job"
    if not bad:
        return exits.OK, f"sweep: all {len(results)} points trained"
    counts: dict[str, int] = {}
    for result in bad:
        counts[result.status or "?"] = counts.get(result.status or "?", 0) + 1
    said = ", ".join(f"{n} {status}" for status, n in counts.items())
    return exits.FAILED, f"error: sweep: {len(bad)} of {len(results)} points did not train to the end ({said})"


class SweepSummary(Callback):
    """Prints every point of the sweep and exits 1 when any did not train to the end (module docstring)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        results = sweep_results(sweep_dir) if sweep_dir.is_dir() else []
        code, line = sweep_verdict(results)
        if results:
            print(summary_table(results, note=False), flush=True)
        print(line, file=sys.stderr if code else sys.stdout, flush=True)
        if code:
            sys.exit(code)
