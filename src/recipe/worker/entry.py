"""Entry point of one training process: ``python -m pipeline_recipes.recipe.worker <job.yaml>``.

:mod:`pipeline_recipes.recipe.launch.main` starts one per rank with Lightning's environment variables (``LOCAL_RANK``,
``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so Lightning joins them instead
of re-launching the script, which is what breaks Hydra multiruns (Lightning #15737, #18175).

The first thing a worker does is record stop signals (:class:`~pipeline_recipes.core.signals.SignalRecord`):
a SIGTERM or SIGINT that arrives while it still imports Lightning or builds its stages stops it cleanly
before the first step instead of killing it. A rank whose run returns records its end for the launcher
(:func:`pipeline_recipes.recipe.report.ending.write_end`: ok, or stopped and why); a rank that raises records its
first exception (:func:`pipeline_recipes.core.failures.record_error`). The exit status says how the job ended
(:mod:`pipeline_recipes.core.exits`): 0 ok, 1 failed, 3 diverged, 128 + n stopped by signal n.
"""

from __future__ import annotations

import os
import sys
import traceback

from pipeline_recipes.core import exits
from pipeline_recipes.core.errors import TrainingDiverged
from pipeline_recipes.core.failures import HEARTBEAT_ENV, error_path, record_error
from pipeline_recipes.core.signals import PARENT_PID_ENV, SignalRecord, die_with_parent

from pipeline_recipes.recipe.report.ending import end_path, write_end
from pipeline_recipes.recipe.worker.heartbeat import start_heartbeat
from pipeline_recipes.recipe.worker.job_spec import JobSpec


def main(argv: list[str]) -> int:
    if os.environ.get(PARENT_PID_ENV):
        die_with_parent(int(os.environ[PARENT_PID_ENV]))
    signals = SignalRecord()
    signals.install()
    heartbeat = os.environ.get(HEARTBEAT_ENV)
    if heartbeat:  # before the slow imports: the launcher watches it from the start
        error_path(heartbeat).unlink(missing_ok=True)
        start_heartbeat(heartbeat)
    if len(argv) != 1:
        print("usage: python -m pipeline_recipes.recipe.worker <job.yaml>", file=sys.stderr)
        return exits.REFUSED
    try:
        from pipeline_recipes.recipe.worker.job import run_job  # local: Lightning ≥6.5 s, after the heartbeat has started

        end = run_job(JobSpec.load(argv[0]), signals)
        if heartbeat:  # the launcher makes the job's end of it (recipe.report.ending)
            write_end(end_path(heartbeat), end)
        return end.exit_code
    except Exception as err:
        if heartbeat:  # the launcher names this exception (its first, not a teardown's) as the job's failure
            record_error(error_path(heartbeat), err)
        traceback.print_exc()
        return exits.DIVERGED if isinstance(err, TrainingDiverged) else exits.FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
