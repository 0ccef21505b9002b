"""Errors every layer shares: a refused setting (:class:`ConfigError`, its fixes as data in :mod:`.fixes`), data
that cannot be had (:class:`DataError`), a diverged run (:class:`TrainingDiverged`), and the helpers that name them."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from .fixes import ConfigError

__all__ = ["ConfigError", "DataError", "TrainingDiverged", "did_you_mean", "exception_chain"]


class DataError(ConfigError):
    """The job's data cannot be had (no such file, offline with an empty cache, no answer from the hub): the
    message names the setting, the cause and the fixes (last). Torch-free, so that the launcher tells it apart
    without importing ``datasets`` or torch."""


def did_you_mean(value: object, options: Iterable[object]) -> str | None:
    """The option closest to a misspelled ``value`` (difflib's ratio ≥ 0.6), or None."""
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1)
    return close[0] if close else None


def exception_chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or while handling (``__cause__``, else ``__context__``),
    each once."""
    seen: list[BaseException] = []
    node: BaseException | None = err
    while node is not None and all(node is not e for e in seen):
        seen.append(node)
        node = node.__cause__ or node.__context__
    return seen


class TrainingDiverged(FloatingPointError):
    """The training loss was NaN or infinite (``nonfinite_loss=stop``), or stayed so for more steps in a row
    than ``nonfinite_loss_patience`` allows (``nonfinite_loss=skip``): the run ends as ``diverged``."""
