"""Prepared data shared by the ranks of a node: one process builds, the others wait and then read it.

Every artefact (a trained tokenizer, a tokenized Arrow dataset, a corpus array) has a path keyed by its
inputs. :func:`prepared` returns it at once when it exists; otherwise the first process to take the
artefact's file lock builds it into a temporary path and renames it into place, while the other
processes of the node (the local ranks of a job, whichever reaches the data first) wait on the lock,
with a timeout, and then find it built. A file system shared by several nodes works the same way.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

DEFAULT_TIMEOUT_S = 3600.0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def prepared(path: str | os.PathLike[str], build: Callable[[Path], None],
             timeout_s: float = DEFAULT_TIMEOUT_S) -> Path:
    """``path`` once it exists, building it with ``build(tmp_path)`` (a file or a directory) under the
    artefact's lock on a miss. Waiting longer than ``timeout_s`` for another builder raises."""
    final = Path(path).expanduser()
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_file = final.with_name(final.name + ".lock")
    try:
        with FileLock(str(lock_file), timeout=float(timeout_s)):
            if final.exists():  # another process built it while this one waited
                return final
            tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
            _remove(tmp)
            try:
                build(tmp)
                os.replace(tmp, final)
            finally:
                _remove(tmp)
    except Timeout as err:
        raise TimeoutError(f"waited {timeout_s:.0f} s for another process preparing {final} (it holds {lock_file}); "
                           "if that process is gone, delete the lock file; to wait longer raise "
                           "data.prepare_timeout_s") from err
    return final
