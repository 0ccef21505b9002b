"""Dataset factories behind ``conf/data/{synthetic,text,wikitext2,wikipedia}.yaml`` and plain DataLoaders.

``build_datasets(name, family=, seq_len=, vocab_size=, ...) -> (train, val | None)`` picks the source;
``family`` (``"gpt2"`` or ``"bert"``) picks the item format: GPT-2 LM blocks or BERT pre-training
pairs. ``make_dataloader`` never shards: the distributed strategy injects its own sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .corpus import (BertPairDataset, LMBlockDataset, TokenizedCorpus, all_files, load_rows, make_nsp_instances,
                     normalize_data_files, tokenize_corpus)
from .resumable import ResumableDataLoader
from .synthetic import SyntheticBertDataset, SyntheticGPT2Dataset
from .tokenizer import file_digest, text_digest

SOURCES = ("synthetic", "text", "wikitext2", "wikipedia")
FAMILIES = ("gpt2", "bert")
DEFAULT_CACHE_DIR = "~/.cache/pipeline-recipes"

# Per-source defaults (the YAML files repeat them so that Hydra can override each one).
SOURCE_DEFAULTS: dict[str, dict[str, Any]] = {
    "synthetic": {"structure": "bigram", "noise": 0.1, "pad_fraction": 0.5, "val_samples": 0},
    "text": {"data_files": None, "text_column": "text", "rows_are": "lines", "val_fraction": 0.0},
    "wikitext2": {"path": "Salesforce/wikitext", "hf_name": "wikitext-2-raw-v1", "data_files": None, "split": "train",
                  "val_split": "validation", "text_column": "text", "rows_are": "lines", "max_rows": None},
    "wikipedia": {"path": "wikimedia/wikipedia", "hf_name": "20231101.en", "data_files": None, "split": "train",
                  "val_split": None, "text_column": "text", "rows_are": "documents", "max_rows": 100_000},
}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")


def _from_corpus(corpus: TokenizedCorpus, family: str, seq_len: int, seed: int, num_samples: int | None,
                 mlm_probability: float) -> Dataset:
    if family == "gpt2":
        return LMBlockDataset(corpus, seq_len, num_samples)
    instances = make_nsp_instances(corpus, seq_len, seed, num_samples)
    return BertPairDataset(instances, seq_len, corpus.vocab_size, seed, mlm_probability)


def _split_tail(dataset: Dataset, fraction: float) -> tuple[Dataset, Dataset | None]:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {fraction}")
    n_val = int(len(dataset) * fraction)  # type: ignore[arg-type]
    if n_val == 0:
        return dataset, None
    n = len(dataset)  # type: ignore[arg-type]
    return torch.utils.data.Subset(dataset, range(n - n_val)), torch.utils.data.Subset(dataset, range(n - n_val, n))


def build_datasets(name: str = "synthetic", *, family: str, seq_len: int, vocab_size: int, seed: int = 0,
                   num_samples: int | None = None, cache_dir: str = DEFAULT_CACHE_DIR,
                   tokenizer_file: str | None = None, offline: bool = False, mlm_probability: float = 0.15,
                   **options: Any) -> tuple[Dataset, Dataset | None]:
    """Train and (optional) validation datasets of one source; items are dicts of tensors.

    ``options`` are the source's keys of ``SOURCE_DEFAULTS`` (unknown keys raise ``TypeError``).
    ``num_samples`` caps the training set (``None``: whole corpus; synthetic default 1024).
    """
    _check_family(family)
    if name not in SOURCES:
        raise ValueError(f"unknown data source {name!r}; expected one of {SOURCES}")
    unknown = set(options) - set(SOURCE_DEFAULTS[name])
    if unknown:
        raise TypeError(f"data source {name!r} got unknown option(s) {sorted(unknown)}")
    opt = {**SOURCE_DEFAULTS[name], **options}
    seq_len, vocab_size, seed = int(seq_len), int(vocab_size), int(seed)

    if name == "synthetic":
        cls = SyntheticGPT2Dataset if family == "gpt2" else SyntheticBertDataset
        extra = {} if family == "gpt2" else {"pad_fraction": opt["pad_fraction"], "mlm_probability": mlm_probability}
        common = {"seq_len": seq_len, "vocab_size": vocab_size, "seed": seed, "structure": opt["structure"],
                  "noise": opt["noise"], **extra}
        train = cls(1024 if num_samples is None else int(num_samples), stream=0, **common)
        val = cls(int(opt["val_samples"]), stream=1, **common) if opt["val_samples"] else None
        return train, val

    cache = str(Path(cache_dir).expanduser())
    if name == "text":
        files = normalize_data_files(opt["data_files"])
        if not files or isinstance(files, Mapping):
            raise ValueError("data source 'text' needs data_files: a local text file or a list of them")
        rows = load_rows("text", data_files=files, split="train", text_column=opt["text_column"], cache_dir=cache)
        key = text_digest([file_digest(files), opt["rows_are"], opt["text_column"]])
        corpus = tokenize_corpus(rows, family=family, vocab_size=vocab_size, rows_are=opt["rows_are"],
                                 cache_dir=cache, corpus_key=key, tokenizer_file=tokenizer_file)
        full = _from_corpus(corpus, family, seq_len, seed, None, mlm_probability)
        train, val = _split_tail(full, float(opt["val_fraction"]))
        if num_samples is not None and len(train) > int(num_samples):  # type: ignore[arg-type]
            train = torch.utils.data.Subset(train, range(int(num_samples)))
        return train, val

    # wikitext2 / wikipedia: a hub dataset (network or local HF cache) or local copies via data_files.
    files = normalize_data_files(opt["data_files"])
    source = {"path": None if files and opt["path"] == SOURCE_DEFAULTS[name]["path"] else opt["path"],
              "name": None if files else opt["hf_name"], "data_files": files, "text_column": opt["text_column"],
              "cache_dir": cache, "offline": offline}
    if files:
        origin = file_digest(all_files(files))
    else:
        origin = f"{opt['path']}/{opt['hf_name']}"
    key = text_digest([origin, opt["split"], str(opt["max_rows"]), opt["rows_are"], opt["text_column"]])
    rows = load_rows(split=opt["split"], max_rows=opt["max_rows"], **source)
    corpus = tokenize_corpus(rows, family=family, vocab_size=vocab_size, rows_are=opt["rows_are"], cache_dir=cache,
                             corpus_key=key, tokenizer_file=tokenizer_file)
    train = _from_corpus(corpus, family, seq_len, seed, num_samples, mlm_probability)
    val = None
    if opt["val_split"]:
        val_rows = load_rows(split=opt["val_split"], max_rows=opt["max_rows"], **source)
        # The validation text is tokenized with the tokenizer trained on the training split (same key).
        val_corpus = tokenize_corpus(val_rows, family=family, vocab_size=vocab_size, rows_are=opt["rows_are"],
                                     cache_dir=cache, corpus_key=key, tokenizer_file=tokenizer_file,
                                     tokens_key=text_digest([key, "val", opt["val_split"]]))
        val = _from_corpus(val_corpus, family, seq_len, seed + 1, None, mlm_probability)
    return train, val


def make_dataloader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int = 0, num_workers: int = 0,
                    drop_last: bool = True, pin_memory: bool = False,
                    position: Callable[[], dict[str, int]] | None = None,
                    sampler: Sampler | None = None) -> DataLoader:
    """A DataLoader; shuffling is seeded, or ``sampler`` (e.g. the datamodule's ``DistributedSampler``
    over the data-parallel replicas) picks the order. With ``position`` (the training position, read
    when a checkpoint is saved) it resumes mid-epoch (:class:`~datamodules.resumable.ResumableDataLoader`)."""
    n = len(dataset)  # type: ignore[arg-type]
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if drop_last and n < batch_size:
        raise ValueError(f"the dataset has {n} samples, fewer than one batch of {batch_size}")
    generator = torch.Generator().manual_seed(int(seed)) if shuffle and sampler is None else None
    kwargs = dict(batch_size=batch_size, shuffle=shuffle and sampler is None, sampler=sampler, generator=generator,
                  drop_last=drop_last, num_workers=num_workers, pin_memory=pin_memory, persistent_workers=num_workers > 0)
    if position is not None:
        return ResumableDataLoader(dataset, position=position, **kwargs)
    return DataLoader(dataset, **kwargs)


def build_dataloaders(name: str = "synthetic", *, family: str, seq_len: int, vocab_size: int,
                      global_batch_size: int, batch_size: int | None = None, seed: int = 0, num_workers: int = 0,
                      **kwargs: Any) -> tuple[DataLoader, DataLoader | None]:
    """``build_datasets`` + ``make_dataloader`` without Lightning (batch size: ``batch_size`` or the global one)."""
    train, val = build_datasets(name, family=family, seq_len=seq_len, vocab_size=vocab_size, seed=seed, **kwargs)
    bs = int(batch_size or global_batch_size)
    train_dl = make_dataloader(train, bs, shuffle=True, seed=seed, num_workers=num_workers)
    val_dl = make_dataloader(val, bs, shuffle=False, num_workers=num_workers) if val is not None else None
    return train_dl, val_dl
