"""Say "no space left on device" when a write fails for want of space, whatever the library's words were.

``torch.save`` to a path on a full file system raises ``RuntimeError: basic_ios::clear: iostream error``
(its C++ stream), to a Python file object ``OSError(ENOSPC)``; a quota raises ``EDQUOT``. :func:`no_space`
recognises all of them, by the errno anywhere in the exception's chain, or else by the file system's free
space being below what was being written.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from .errors import exception_chain

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_TEXT = "no space left on device"
LOW_SPACE_BYTES = 1 << 20  # below this much free space a failed write is taken for a full disk


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes (for an unprivileged user) on the file system of ``path`` or of its nearest existing
    parent; None when none can be read."""
    for candidate in (Path(path).absolute(), *Path(path).absolute().parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def no_space(err: BaseException, path: str | os.PathLike[str], needed_bytes: int | None = None) -> bool:
    """Whether ``err``, raised while writing ``path``, means its file system is full (or over quota)."""
    if any(getattr(e, "errno", None) in NO_SPACE_ERRNOS for e in exception_chain(err)):
        return True
    if any("No space left" in str(e) for e in exception_chain(err)):
        return True
    free = free_bytes(path)
    return free is not None and free < max(LOW_SPACE_BYTES, needed_bytes or 0)


def format_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def no_space_message(path: str | os.PathLike[str], what: str, needed_bytes: int | None = None) -> str:
    """One line: no space left on device, where, how much is free (and needed), and the fix."""
    free = free_bytes(path)
    have = f"{format_bytes(free)} free" if free is not None else "free space unknown"
    need = f", about {format_bytes(needed_bytes)} needed" if needed_bytes else ""
    return (f"{NO_SPACE_TEXT}: {what} {path} ({have} on its file system{need}); free space there, or write "
            "elsewhere (hydra.run.dir=... for the job directory)")
