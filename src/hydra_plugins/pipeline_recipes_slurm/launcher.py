"""Hydra's submitit SLURM launcher (``hydra/launcher=slurm``, ``conf/hydra/launcher/slurm.yaml``), except that a sweep
point whose SLURM job ended without a result does not end the sweep.

The plugin's launcher submits every point as one job of a SLURM array and then fetches the results in order; a job
that produced none (cancelled with ``scancel``, preempted, killed at its time limit, its node lost, or a stop that
ended the point's process with a stop status) makes submitit raise ``UncompletedJobError`` there, and the whole sweep
ends with it: the points after it are never read and the sweep's summary (:mod:`pipeline_recipes.recipe.report.sweep`) is
never printed. Here such a point is recorded in its ``results.json``
(:func:`pipeline_recipes.recipe.report.sweep.record_unfinished`: ``stopped`` when SLURM cancelled it, with the job id and what its ``results.json`` said) and the sweep goes on, to
end with its summary and exit status. A point whose function raised (submitit's ``FailedJobError``) still ends the
sweep, as Hydra's own launchers do.

Only the fetching differs from the plugin's ``BaseSubmititLauncher.launch`` (hydra-submitit-launcher 1.2), whose
submission :meth:`SlurmLauncher.submit` repeats. It lives here because Hydra instantiates a launcher only from the
``hydra_plugins`` namespace package, which Hydra imports on every run: without the submitit plugin (``pip install -e
".[slurm]"``) this module defines nothing, so that Hydra has nothing to warn about (``train.py`` says what to install
when ``hydra/launcher=slurm`` is asked for).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import OmegaConf, open_dict
from typing_extensions import override

from pipeline_recipes.recipe.report.sweep import CANCELLED, record_unfinished

try:  # the optional plugin (pip install -e ".[slurm]"); Hydra scans this module on every run
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as PluginSlurmLauncher
    from submitit.core.utils import FailedJobError, UncompletedJobError
except ImportError:
    PluginSlurmLauncher = None

log = logging.getLogger(__name__)
POLL_S = 2.0  # how often a point's job is looked up while the sweep waits for it
RESULT_GRACE_S = 60.0  # a job that ran and left SLURM's queue may still be writing its result (a shared file system)


def wait_listed(job: Any, poll_s: float = POLL_S, grace_s: float = RESULT_GRACE_S) -> str | None:
    """Wait until submitit has the point's result, or until SLURM no longer lists the job and no result will come;
    the job's last state then (``CANCELLED by 0``), else None. submitit alone reads a job's end from ``sacct``,
    which lists no array task cancelled while it was pending (and there is no ``sacct`` without accounting): it
    would wait for that job forever. A job that never started has no result to wait for; one that ran gets
    ``grace_s`` for its result to appear."""
    gone_at: float | None = None
    while not job.done():
        listed, started, state = slurm_job(str(job.job_id))
        if listed:
            gone_at = None
        elif not started:
            return state
        else:
            gone_at = gone_at if gone_at is not None else time.monotonic()
            if time.monotonic() - gone_at > grace_s:
                return state
        time.sleep(poll_s)
    return None


def slurm_job(job_id: str) -> tuple[bool, bool, str]:
    """Whether SLURM's queue lists the job, whether it started, and its state (``scontrol show job``, which knows an
    ended job for ``MinJobAge``, 300 s by default). An array task cancelled while pending is removed from its array
    at once: SLURM knows it no more. A job SLURM cannot be asked about counts as listed."""
    try:
        queue = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                               timeout=60)
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True, True, "UNKNOWN"
    if queue.returncode != 0 or queue.stdout.strip():
        return True, True, queue.stdout.strip() or "UNKNOWN"
    if shown.returncode != 0:  # "Job 42_2 not found"
        if "_" in job_id:
            return False, False, f"{CANCELLED} (an array task SLURM no longer knows: removed while pending)"
        return False, True, "UNKNOWN (SLURM no longer knows the job)"
    fields = dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)
    state = fields.get("JobState", "UNKNOWN")
    if fields.get("Reason") not in (None, "None"):
        state += f" ({fields['Reason']})"
    started = fields.get("StartTime") not in (None, "Unknown", "None") and fields.get("RunTime") != "00:00:00"
    return state.startswith(("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")), started, state


if PluginSlurmLauncher is not None:

    class SlurmLauncher(PluginSlurmLauncher):
        """The plugin's SLURM launcher; a point whose job ended without a result is recorded and the sweep goes on
        (module docstring)."""

        @override
        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            jobs = self.submit(job_overrides, initial_job_idx)
            return [self.fetch(job, list(overrides), initial_job_idx + i)
                    for i, (job, overrides) in enumerate(zip(jobs, job_overrides))]

        def fetch(self, job: Any, overrides: list[str], job_num: int) -> JobReturn:
            """The point's result (its task 0's), or, for a job that produced none, a completed return whose
            ``results.json`` says how it ended. Waits while SLURM lists the job (:func:`wait_listed`)."""
            ended = wait_listed(job)
            if ended is not None:
                return self.unfinished(job, overrides, job_num, ended)
            try:
                return job.results()[0]
            except FailedJobError:
                raise
            except UncompletedJobError:
                return self.unfinished(job, overrides, job_num, str(job.state))

        def unfinished(self, job: Any, overrides: list[str], job_num: int, state: str) -> JobReturn:
            """A point whose job ended without a result: recorded in its ``results.json`` and said on one line."""
            job_dir = self.job_dir(overrides, job_num)
            result = record_unfinished(job_dir, str(job.job_id), state)
            point = " ".join(filter_overrides(overrides))
            print(f"sweep point #{job_num} ({point}): {result.status}: {result.reason}", file=sys.stderr, flush=True)
            return JobReturn(overrides=overrides, working_dir=str(job_dir), status=JobStatus.COMPLETED)

        def job_dir(self, overrides: list[str], job_num: int) -> Path:
            """The point's output directory, as the point composes it (``hydra.sweep.dir``/``hydra.sweep.subdir``)."""
            if self.hydra_context is None or self.config is None:
                raise RuntimeError("the launcher was not set up by Hydra")
            config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            with open_dict(config.hydra.job):
                config.hydra.job.num = job_num
            return Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)

        def submit(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
            """Submit every point as one job of a SLURM array: the plugin's ``launch`` up to its fetching."""
            if self.config is None:
                raise RuntimeError("the launcher was not set up by Hydra")
            params = self.params
            init_keys = {"max_num_timeout", "submitit_folder"}
            executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params["submitit_folder"],
                                             **{f"{self._EXECUTOR}_max_num_timeout": params["max_num_timeout"]}
                                             if "max_num_timeout" in params else {})
            base = set(OmegaConf.structured(BaseQueueConf).keys())
            executor.update_parameters(**{key if key in base else f"{self._EXECUTOR}_{key}": value
                                          for key, value in params.items() if key not in init_keys})
            log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {self.config.hydra.sweep.dir}")
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            sweep_dir.mkdir(parents=True, exist_ok=True)
            if "mode" in self.config.hydra.sweep:
                os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
            job_params = []
            for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
                job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
            return executor.map_array(self, *zip(*job_params))
