"""A DataLoader that resumes in the middle of an epoch: same samples, same order, no sample read twice.

Lightning keeps a loader's ``state_dict()`` in the fit loop's checkpoint state and calls
``load_state_dict`` before iterating again, but only for loaders that have both methods; a plain
DataLoader restarts the epoch from its first batch. A loader counting its own yields would be one
batch off, since Lightning fetches one batch ahead; so the position comes from the trainer
(``position``: the datamodule reads the fit loop's progress): the epoch, the batches of it already
trained on, and the global batch size.

On resume the first iteration sets the sampler's epoch (the ``DistributedSampler`` of the
datamodule; Lightning sets it only after its first fetch), and skips the finished batches by index: no
sample is loaded for them. ``len()`` stays the epoch's full length, as Lightning's loop expects.
The per-replica batches of any W cover the same global batches, so the position holds when the
number of replicas changes; a different global batch size mid-epoch is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader


class _SkipFirst:
    """An index sampler whose first iteration leaves out its first ``skip`` items."""

    def __init__(self, base: Any, skip: int) -> None:
        self.base, self.skip = base, skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        for i, item in enumerate(self.base):
            if i >= skip:
                yield item

    def __len__(self) -> int:
        return len(self.base)


class ResumableDataLoader(DataLoader):
    """``DataLoader`` plus ``state_dict``/``load_state_dict`` (see the module docstring)."""

    def __init__(self, *args: Any, position: Callable[[], dict[str, int]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position
        self._resume_epoch: int | None = None
        self._skip = 0

    def state_dict(self) -> dict[str, int]:
        return dict(self.position()) if self.position is not None else {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not state:
            return
        epoch, done, per_epoch = int(state["epoch"]), int(state["batches"]), int(state["epoch_batches"])
        if done >= per_epoch:  # saved at the end of an epoch: the next one starts afresh
            epoch, done = epoch + 1, 0
        global_batch = state.get("global_batch_size")
        current = getattr(self.position, "global_batch_size", None)
        if done and global_batch is not None and current is not None and int(global_batch) != int(current):
            raise ValueError(
                f"the checkpoint stopped after {done} batches of {global_batch} samples in epoch {epoch}; resuming "
                f"with data.global_batch_size = {current} would not continue at the same sample: resume with "
                f"data.global_batch_size={global_batch}, or from a checkpoint taken at the end of an epoch"
            )
        self._resume_epoch, self._skip = epoch, done

    @property
    def _index_sampler(self) -> Any:
        base = super()._index_sampler
        return _SkipFirst(base, self._skip) if self._skip else base

    def __iter__(self) -> Any:
        if self._resume_epoch is not None:
            epoch, self._resume_epoch = self._resume_epoch, None
            _set_epoch(self.sampler, epoch)
            iterator = super().__iter__()  # takes the skipping index sampler
            self._skip = 0
            return iterator
        return super().__iter__()


def _set_epoch(sampler: Any, epoch: int) -> None:
    """Put ``sampler`` at ``epoch`` when it has ``set_epoch`` (the ``DistributedSampler`` the datamodule
    gives every strategy, one process included). A plain ``RandomSampler`` replays its seeded generator
    from the start: exact in the first epoch, another order in later ones."""
    if callable(getattr(sampler, "set_epoch", None)):
        sampler.set_epoch(epoch)
