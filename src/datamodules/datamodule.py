"""The LightningDataModule of every data source (``conf/data/*.yaml``; Hydra target ``build_datamodule``).

It returns DataLoaders of per-replica mini-batches (``batch_size``; ``global_batch_size`` when not
given) and ``drop_last=True``. Every strategy sees the same global batches: the training loader always
draws from one ``DistributedSampler`` seeded with ``data.seed`` over the trainer's data-parallel
replicas (the strategy's ``distributed_sampler_kwargs``: W replicas of a pipeline, the world of DDP, one
of a single process), so replica ``r`` of W takes every W-th sample of the same permutation and the W
per-replica batches of step ``i`` together are samples ``[i·B̂, (i+1)·B̂)`` of it, whatever W is.
(Lightning's own injected sampler would be seeded with the global seed, and a single process would
shuffle with another generator.) The training loader resumes mid-epoch from a checkpoint
(:mod:`pipeline_recipes.datamodules.resumable`, position read by :class:`TrainingPosition`). Text sources are tokenized
and grouped once per node, the other ranks waiting for the cache (:mod:`pipeline_recipes.datamodules.cache`); the
tokenizer's files travel in every checkpoint (:meth:`PipelineDataModule.state_dict`), so
``scripts/export_hf.py`` saves it with the model. Importing this module imports Lightning (~7 s).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from pipeline_recipes.core.node import cpus_per_rank, loader_settings

from .factory import build_source, make_dataloader
from .tokenizer import TOKENIZER_FILES_KEY, tokenizer_files


class TrainingPosition:
    """Where training stands in the data (epoch, batches of it trained on): what a resumable training
    loader saves in checkpoints. Read from the datamodule's trainer when the checkpoint is written."""

    def __init__(self, datamodule: L.LightningDataModule, global_batch_size: int) -> None:
        self.datamodule, self.global_batch_size = datamodule, int(global_batch_size)

    def __call__(self) -> dict[str, int]:
        trainer = getattr(self.datamodule, "trainer", None)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return {}
        loop = trainer.fit_loop
        per_epoch = trainer.num_training_batches
        return {"epoch": int(trainer.current_epoch), "batches": int(loop.epoch_loop.batch_progress.current.processed),
                "epoch_batches": int(per_epoch) if per_epoch != float("inf") else 2**62,
                "global_batch_size": self.global_batch_size}


class PipelineDataModule(L.LightningDataModule):
    """Datasets of ``build_datasets(name, ...)`` served as DataLoaders of ``batch_size`` samples."""

    def __init__(self, name: str = "synthetic", *, family: str, seq_len: int, vocab_size: int,
                 global_batch_size: int, batch_size: int | None = None, seed: int = 0,
                 num_workers: int | str | None = 0, pin_memory: bool | str | None = False, **source: Any) -> None:
        super().__init__()
        self.name, self.family, self.seq_len, self.vocab_size = name, family, int(seq_len), int(vocab_size)
        self.global_batch_size = int(global_batch_size)
        self.batch_size = int(batch_size) if batch_size else self.global_batch_size
        if self.global_batch_size % self.batch_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} is not a multiple of the per-replica "
                             f"batch_size {self.batch_size}")
        loader_settings(num_workers, pin_memory, cuda=False, cpus=1)  # a bad value fails here, not at the first batch
        self.seed, self.num_workers, self.pin_memory = int(seed), num_workers, pin_memory
        self.source = dict(source)
        self.train_set: Any = None
        self.val_set: Any = None
        self.tokenizer: Any = None
        self._tokenizer_files: dict[str, bytes] | None = None

    def _build(self) -> None:
        source = build_source(self.name, family=self.family, seq_len=self.seq_len, vocab_size=self.vocab_size,
                              seed=self.seed, **self.source)
        self.train_set, self.val_set, self.tokenizer = source.train, source.val, source.tokenizer

    def prepare_data(self) -> None:
        """Train and cache the tokenizer and the tokenized data on the node's local rank 0 (the synthetic
        source needs nothing); ranks that reach ``setup`` first wait for it on the cache's file lock."""
        if self.name != "synthetic" and self.train_set is None:
            self._build()

    @override
    def state_dict(self) -> dict[str, Any]:
        """The tokenizer's files (what ``save_pretrained`` writes), for the export; empty for synthetic data."""
        if self.tokenizer is None:
            return {}
        if self._tokenizer_files is None:
            self._tokenizer_files = tokenizer_files(self.tokenizer)
        return {TOKENIZER_FILES_KEY: dict(self._tokenizer_files)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the data configuration defines the tokenizer of the resumed run."""

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self._build()

    def replicas(self) -> tuple[int, int]:
        """(data-parallel replicas, this process's replica) of the trainer's strategy; (1, 0) alone."""
        trainer = getattr(self, "trainer", None)
        shard = trainer.distributed_sampler_kwargs if trainer is not None else None
        if not shard:
            return 1, 0
        return int(shard["num_replicas"]), int(shard["rank"])

    def loader_args(self) -> dict[str, Any]:
        """``num_workers`` and ``pin_memory`` of the loaders: as set, or under ``auto`` for this rank's
        device (:func:`pipeline_recipes.core.node.loader_settings`: workers and pinned memory on CUDA only)."""
        trainer = getattr(self, "trainer", None)
        cuda = trainer is not None and trainer.strategy.root_device.type == "cuda"
        processes = int(trainer.num_devices) if trainer is not None else 1
        workers, pin = loader_settings(self.num_workers, self.pin_memory, cuda=cuda, cpus=cpus_per_rank(processes))
        return {"num_workers": workers, "pin_memory": pin}

    def train_dataloader(self) -> DataLoader:
        self.setup()
        replicas, rank = self.replicas()
        # drop_last: every W keeps the same floor(n / B̂) global batches of the same permutation
        sampler = DistributedSampler(self.train_set, num_replicas=replicas, rank=rank, shuffle=True, seed=self.seed,
                                     drop_last=True)
        return make_dataloader(self.train_set, self.batch_size, shuffle=True, seed=self.seed, **self.loader_args(),
                               position=TrainingPosition(self, self.global_batch_size), sampler=sampler)

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches, or ``[]`` when the source has no validation split (Lightning then skips it)."""
        self.setup()
        if self.val_set is None:
            return []
        return make_dataloader(self.val_set, self.batch_size, shuffle=False, **self.loader_args())


def build_datamodule(name: str = "synthetic", **kwargs: Any) -> PipelineDataModule:
    """Hydra target of ``conf/data/*.yaml``; pass ``batch_size=global_batch_size // replicas``."""
    return PipelineDataModule(name, **kwargs)
