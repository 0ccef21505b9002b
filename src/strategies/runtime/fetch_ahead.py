"""The next training batch is fetched in the pipeline's bubble, not between steps.

Lightning (2.6) reads a training batch from the data loader at the start of each step
(``_PrefetchDataFetcher`` prefetches nothing when the loader has a length). Under a pipeline schedule
the rank holding the first stage ends every step (its last backward, GPipe §2 and 1F1B in Chimera
§2) and starts the next one (its first forward): whatever it does between two steps, reading the
batch included, every other rank waits for. Inside a step the same rank waits for its neighbours
(the bubble), with nothing to compute.

:class:`FetchAhead` is Lightning's fetcher plus :meth:`FetchAhead.fetch_ahead`, which reads the next
batch early. The engine calls it in a synchronous step's longest bubble: before the action that the
schedule's simulation shows waiting longest for a peer (at least one forward's time), and only if the
host does wait there (gloo; :meth:`pipeline_recipes.strategies.runtime.executor.StageExecutor.run`). A step without such a
wait (Chimera at N = D has no bubble inside the step; the asynchronous schedules have none; on NCCL
the host never waits for a receive) reads its batch at its start, as Lightning does. The loader
yields the same batches in the same order either way; the fetcher only reads one before it is
asked for, never past the epoch's end.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
from typing_extensions import override


class FetchAhead(_PrefetchDataFetcher):
    """Lightning's fetcher for a loader of known length that can read the next batch early."""

    _ahead: list[Any] | None = None  # the next (batch, batch_idx, dataloader_idx), read early; []: none left

    @classmethod
    def take_over(cls, fetcher: _PrefetchDataFetcher) -> FetchAhead:
        """This fetcher in place of Lightning's ``fetcher``, at the same position of the same iterator."""
        ahead = cls.__new__(cls)
        ahead.__dict__.update(fetcher.__dict__)
        ahead._ahead = None
        return ahead

    def fetch_ahead(self) -> None:
        """Read the batch the next ``next()`` returns, unless it is read already, the loader's length is
        unknown (Lightning's prefetching then decides when the epoch ends) or the epoch has no batch left."""
        if (self._ahead is not None or self.iterator is None or self.done or self.length is None
                or self.fetched >= self.length):
            return
        self._start_profiler()
        try:
            self._ahead = [next(self.iterator)]
        except StopIteration:
            self._ahead = []
        finally:
            self._stop_profiler()

    @override
    def __next__(self) -> Any:
        if self._ahead is None:
            return super().__next__()
        ahead, self._ahead = self._ahead, None
        if not ahead:
            self.done = True
            raise StopIteration
        self.fetched += 1  # as Lightning's fetcher counts a batch it returns
        self.done = self.fetched >= self.length
        return ahead[0]

    @override
    def reset(self) -> None:
        super().reset()
        self._ahead = None


def fetch_during_waits(trainer: Any, engine: Any) -> bool:
    """Put :class:`FetchAhead` in place of the training loop's fetcher (before the first batch is read:
    the strategy's ``on_train_start``) and give the engine its :meth:`~FetchAhead.fetch_ahead` as the
    steps' idle work; whether it did (not for a loader without length, or a ``training_step`` taking
    ``dataloader_iter``: Lightning's own fetcher stays). Loaders reloaded later
    (``reload_dataloaders_every_n_epochs``) get Lightning's fetcher again, which reads at each step's start."""
    loop = getattr(trainer, "fit_loop", None)
    fetcher = getattr(loop, "_data_fetcher", None)
    if type(fetcher) is not _PrefetchDataFetcher or fetcher.length is None:
        engine.idle_work = None
        return False
    ahead = loop._data_fetcher = FetchAhead.take_over(fetcher)

    def fetch_ahead() -> None:
        if loop._data_fetcher is ahead:  # not after a reload of the loaders
            ahead.fetch_ahead()

    engine.idle_work = fetch_ahead
    return True
