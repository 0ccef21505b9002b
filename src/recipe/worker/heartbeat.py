"""Worker liveness: each rank touches a file every second; the launcher reads how old it is.

A rank that stops answering while alive (stopped, deadlocked, stuck in one operation) stops
touching its file. :func:`pipeline_recipes.recipe.launch.supervise.launch_workers` ends the job when a heartbeat is older than
``strategy.timeout_s`` and names that rank, also when a peer's wait timed out first (a gloo
collective's timeout names no peer).

A rank that raises records its first exception beside its heartbeat (:mod:`pipeline_recipes.core.failures`).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from pipeline_recipes.core.failures import HEARTBEAT_ENV

__all__ = ["HEARTBEAT_ENV", "SILENT_S", "heartbeat_age", "start_heartbeat"]

INTERVAL_S = 1.0
SILENT_S = 3 * INTERVAL_S  # older than this: the rank is not answering right now


def start_heartbeat(path: str | os.PathLike[str], interval_s: float = INTERVAL_S) -> threading.Thread:
    """Touch ``path`` now and every ``interval_s`` from a daemon thread, for the life of the process."""
    target = Path(path)

    def beat() -> None:
        while True:
            target.touch()
            time.sleep(interval_s)

    target.touch()
    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread


def heartbeat_age(path: Path, now: float | None = None) -> float | None:
    """Seconds since ``path`` was last touched; None before the first beat."""
    try:
        return (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return None


