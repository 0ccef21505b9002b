"""Data for the pipeline recipes: synthetic tokens, local text files, WikiText-2 and Wikipedia, tokenized by
any ``transformers`` tokenizer (``data.tokenizer``) or an offline BPE.

Public API::

    build_source(name, family=, seq_len=, vocab_size=, seed=, num_samples=, tokenizer=, **source)
        -> DataSource(train, val | None, tokenizer | None)
    build_datasets(name, ...) -> (train, val | None)
    make_dataloader(dataset, batch_size, shuffle=, seed=) / build_dataloaders(...)   # no Lightning import
    build_datamodule(name, family=, seq_len=, vocab_size=, global_batch_size=, batch_size=, ...)  # Hydra target
    PipelineDataModule                                                                # LightningDataModule

``PipelineDataModule``/``build_datamodule`` are imported lazily: Lightning costs seconds to import.
"""

from __future__ import annotations

from typing import Any

from .corpus import (BertPairDataset, LMBlockDataset, load_rows, load_text_dataset, make_nsp_instances,
                     split_documents, tokenize_rows)
from .factory import (SOURCE_DEFAULTS, SOURCES, DataSource, build_dataloaders, build_datasets, build_source,
                      make_dataloader)
from .masking import BERT_SPECIAL_TOKENS, CLS_ID, IGNORE_INDEX, MASK_ID, PAD_ID, SEP_ID, SpecialIds, mlm_mask
from .synthetic import SyntheticBertDataset, SyntheticGPT2Dataset
from .tokenizer import check_tokenizer_config, load_or_train_bpe, load_tokenizer, train_bpe

_LAZY = {"PipelineDataModule", "build_datamodule"}

__all__ = [
    "BertPairDataset", "LMBlockDataset", "SyntheticBertDataset", "SyntheticGPT2Dataset", "SOURCES",
    "SOURCE_DEFAULTS", "DataSource", "build_dataloaders", "build_datasets", "build_source", "make_dataloader",
    "load_rows", "load_text_dataset", "make_nsp_instances", "split_documents", "tokenize_rows", "load_or_train_bpe",
    "load_tokenizer", "check_tokenizer_config", "train_bpe", "mlm_mask", "SpecialIds", "BERT_SPECIAL_TOKENS",
    "CLS_ID", "IGNORE_INDEX", "MASK_ID", "PAD_ID", "SEP_ID", *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import datamodule  # local: Lightning ≥6.5 s (python -X importtime), for its two lazy names only

        return getattr(datamodule, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
