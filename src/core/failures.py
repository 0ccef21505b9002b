"""A rank's first exception, recorded for the launcher, which names the rank that failed first and how.

A rank that raises writes its first exception (one summary line, the lines under it such as a schedule grid,
and whether it only reports another rank's failure) next to its heartbeat (``rank<r>.error``,
:func:`record_error`) before it exits, so the launcher names the exception that ended the job rather than a
later one: a teardown's, or a peer's that was waiting on it (:func:`is_consequence`). Shared by the workers
(:mod:`pipeline_recipes.recipe.worker`), the Lightning strategy's teardown and the launcher.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .disk import NO_SPACE_ERRNOS, NO_SPACE_TEXT
from .errors import exception_chain
from .transport import connection_closed

HEARTBEAT_ENV = "PIPELINE_HEARTBEAT_FILE"  # a worker's heartbeat file (recipe.heartbeat); its error file beside it
ERROR_SUFFIX = ".error"  # beside rank<r>.heartbeat: the rank's first exception


def error_path(heartbeat: str | os.PathLike[str]) -> Path:
    """Where the rank of ``heartbeat`` records its first exception: ``rank<r>.error`` beside it."""
    return Path(heartbeat).with_suffix(ERROR_SUFFIX)


def first_exception(err: BaseException) -> BaseException:
    """The exception that started ``err``'s chain: raised while another was being handled (a teardown
    after a failure), ``err`` is a consequence, so the implicit context is followed back to the first.
    An explicit ``raise ... from`` is the message its author chose and is kept."""
    seen = {id(err)}
    while (err.__cause__ is None and not err.__suppress_context__ and err.__context__ is not None
           and id(err.__context__) not in seen):
        err = err.__context__
        seen.add(id(err))
    return err


def is_consequence(err: BaseException) -> bool:
    """Whether ``err`` only reports another rank's failure: a peer that closed its connection or stopped
    answering (``consequence = True`` on the project's exceptions; gloo's own words otherwise)."""
    return any(getattr(e, "consequence", False) or connection_closed(e) for e in exception_chain(err))


def describe_exception(err: BaseException) -> str:
    """``Type: message`` of ``err``'s first exception (:func:`first_exception`); a full disk or quota is said
    as "no space left on device" with the file."""
    first = first_exception(err)
    for e in exception_chain(first):
        if getattr(e, "errno", None) in NO_SPACE_ERRNOS:
            where = getattr(e, "filename", None)
            return f"OSError: {NO_SPACE_TEXT}" + (f": could not write {where}" if where else "")
    message = str(first)
    return f"{type(first).__name__}: {message}" if message else type(first).__name__


@dataclass(frozen=True)
class RecordedError:
    """A rank's first exception as it recorded it: when (the file's time), the one-line summary, the
    lines under it (a schedule grid), and whether it only reports another rank's failure."""

    at: float
    summary: str
    detail: str = ""
    consequence: bool = False


def record_error(path: str | os.PathLike[str], err: BaseException) -> None:
    """Write :func:`describe_exception` of ``err`` to ``path`` (whole or not at all), unless an earlier
    exception of this rank is there already: the first one stays."""
    target = Path(path)
    if target.exists():
        return
    summary, _, detail = describe_exception(err).partition("\n")
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"summary": summary, "detail": detail, "consequence": is_consequence(err)}))
        os.replace(tmp, target)
    except OSError:  # a full disk: the launcher names the rank by its exit instead
        tmp.unlink(missing_ok=True)


def record_handled_error() -> None:
    """In a worker, while an exception is being handled (a teardown after a failed step): record it
    now, before closing the process group lets the peers fail too and record theirs."""
    err = sys.exc_info()[1]
    if isinstance(err, Exception) and os.environ.get(HEARTBEAT_ENV):
        record_error(error_path(os.environ[HEARTBEAT_ENV]), err)


def read_error(path: Path) -> RecordedError | None:
    """A rank's recorded exception; None when it recorded none."""
    try:
        at, text = path.stat().st_mtime, path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    try:
        raw = json.loads(text)
        return RecordedError(at, str(raw["summary"]), str(raw.get("detail", "")), bool(raw.get("consequence")))
    except (ValueError, KeyError, TypeError):
        return RecordedError(at, text.strip())
