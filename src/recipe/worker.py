"""Entry point of one training process: ``python -m recipe.worker <job.yaml>``.

:mod:`pipeline_recipes.recipe.launch` starts one per rank with Lightning's environment variables (``LOCAL_RANK``,
``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so Lightning joins them instead
of re-launching the script, which is what breaks Hydra multiruns (Lightning #15737, #18175). A rank
that raises records its first exception for the launcher (:func:`pipeline_recipes.recipe.heartbeat.record_error`).
"""

from __future__ import annotations

import os
import sys

from .heartbeat import HEARTBEAT_ENV, error_path, record_error, start_heartbeat
from .job_spec import JobSpec


def main(argv: list[str]) -> int:
    heartbeat = os.environ.get(HEARTBEAT_ENV)
    if heartbeat:  # before the slow imports: the launcher watches it from the start
        error_path(heartbeat).unlink(missing_ok=True)
        start_heartbeat(heartbeat)
    try:
        from .job import run_job  # local: Lightning ≥6.5 s, after the heartbeat has started

        if len(argv) != 1:
            print("usage: python -m pipeline_recipes.recipe.worker <job.yaml>", file=sys.stderr)
            return 2
        run_job(JobSpec.load(argv[0]))
    except Exception as err:
        if heartbeat:  # the launcher names this exception (its first, not a teardown's) as the job's failure
            record_error(error_path(heartbeat), err)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
