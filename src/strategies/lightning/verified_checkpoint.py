"""A ``ModelCheckpoint`` that never removes its last verified checkpoint before a newer one has verified.

Lightning's ``ModelCheckpoint`` with ``save_top_k=1`` (``checkpoint.keep=latest``) removes the previous checkpoint
as soon as it has saved the new one. :class:`VerifiedCheckpoint` removes it only when the new one passes
:func:`~pipeline_recipes.strategies.checkpoint.verify_checkpoint` (every file present with its listed size, every
torch file whole with its CRCs right), checked on global rank 0, the rank that removes checkpoints
(``Strategy.remove_checkpoint``). When the new one fails it keeps the previous one, says so in one warning, and
removes it together with the next previous checkpoint once a newer save verifies.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from pipeline_recipes.strategies.checkpoint import CheckpointError, verify_checkpoint


class VerifiedCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose removal of an older checkpoint waits until the newer one saved has verified."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list[str] = []  # older checkpoints kept because a newer save failed to verify (rank 0)

    @override
    def _should_remove_checkpoint(self, trainer: pl.Trainer, previous: str, current: str) -> bool:
        """Lightning's rules, and on rank 0 also ``current`` (just saved) verified; else ``previous`` is kept."""
        if not super()._should_remove_checkpoint(trainer, previous, current):
            return False
        if not trainer.is_global_zero:  # removes nothing (Strategy.remove_checkpoint): reads nothing
            return True
        writer = getattr(trainer.strategy, "writer", None)
        if writer is not None and writer.background:  # written in the background: the strategy removes the
            return True  # previous one once the new one is written and verifies (PipelineStrategy.remove_checkpoint)
        try:
            verify_checkpoint(current)
        except (CheckpointError, OSError) as err:
            self.kept.append(previous)
            rank_zero_warn(f"keeping {previous} until a newer checkpoint verifies: {err}")
            return False
        return True

    @override
    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Remove ``filepath`` and the checkpoints kept while newer saves failed to verify."""
        for path in [*self.kept, filepath]:
            super()._remove_checkpoint(trainer, path)
        self.kept.clear()
