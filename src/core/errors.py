"""Errors every layer shares."""

from __future__ import annotations


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
