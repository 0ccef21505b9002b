"""Dataset factories behind ``conf/data/{synthetic,text,wikitext2,wikipedia}.yaml`` and plain DataLoaders.

``build_source(name, family=, seq_len=, vocab_size=, ...) -> DataSource(train, val, tokenizer)`` (and
``build_datasets``: ``(train, val | None)``) picks the source; ``family`` (``"gpt2"`` or ``"bert"``) picks
the item format: GPT-2 LM blocks or BERT pre-training pairs. Text sources are tokenized by
``data.tokenizer`` (or the offline BPE) and prepared once per node (:mod:`pipeline_recipes.datamodules.cache`).
``make_dataloader`` never shards: the datamodule gives it its sampler.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset, Sampler

from pipeline_recipes.core.node import cpus_per_rank, loader_settings

from .cache import DEFAULT_TIMEOUT_S, prepared
from .corpus import (BertPairDataset, LMBlockDataset, TokenizedCorpus, all_files, assemble_corpus, group_blocks,
                     iter_texts, load_text_dataset, make_nsp_instances, normalize_data_files, saved_dataset_key,
                     tokenize_rows)
from .masking import SpecialIds, default_bert_ids
from .resumable import ResumableDataLoader
from .synthetic import SyntheticBertDataset, SyntheticGPT2Dataset
from .tokenizer import (bert_ids, check_vocab, eos_id, file_digest, hub_offline, load_tokenizer, text_digest,
                        tokenizer_fingerprint, train_bpe, wrap_tokenizer)

SOURCES = ("synthetic", "text", "wikitext2", "wikipedia")
FAMILIES = ("gpt2", "bert")
DEFAULT_CACHE_DIR = "~/.cache/pipeline-recipes"

# Per-source defaults (the YAML files repeat them so that Hydra can override each one).
SOURCE_DEFAULTS: dict[str, dict[str, Any]] = {
    "synthetic": {"structure": "bigram", "noise": 0.1, "pad_fraction": 0.5, "val_samples": 0},
    "text": {"data_files": None, "text_column": "text", "rows_are": "lines", "val_fraction": 0.0, "streaming": False,
             "max_rows": None},
    "wikitext2": {"path": "Salesforce/wikitext", "hf_name": "wikitext-2-raw-v1", "data_files": None, "split": "train",
                  "val_split": "validation", "text_column": "text", "rows_are": "lines", "max_rows": None,
                  "streaming": False},
    "wikipedia": {"path": "wikimedia/wikipedia", "hf_name": "20231101.en", "data_files": None, "split": "train",
                  "val_split": None, "text_column": "text", "rows_are": "documents", "max_rows": 100_000,
                  "streaming": True},
}


@dataclass
class DataSource:
    """A source's datasets and the tokenizer that made them (``None`` for synthetic tokens)."""

    train: Dataset
    val: Dataset | None
    tokenizer: Any = None


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")


def _split_tail(dataset: Dataset, fraction: float) -> tuple[Dataset, Dataset | None]:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {fraction}")
    n_val = int(len(dataset) * fraction)  # type: ignore[arg-type]
    if n_val == 0:
        return dataset, None
    n = len(dataset)  # type: ignore[arg-type]
    return torch.utils.data.Subset(dataset, range(n - n_val)), torch.utils.data.Subset(dataset, range(n - n_val, n))


@contextmanager
def _scratch(tmp: Path) -> Iterator[Path]:
    """A fresh directory beside ``tmp`` for the intermediate Arrow files of one build, removed after it."""
    work = tmp.with_name(tmp.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _Corpus:
    """One split of a text source: its rows (loaded only on a cache miss) and how it is prepared."""

    def __init__(self, key: str, load: Callable[[], Any], *, family: str, rows_are: str, cache: Path,
                 num_proc: int | None, timeout_s: float) -> None:
        self.key, self._load, self.family, self.rows_are = key, load, family, rows_are
        self.cache, self.num_proc, self.timeout_s = cache, num_proc, timeout_s
        self._rows: Any = None

    @property
    def rows(self) -> Any:
        if self._rows is None:
            self._rows = self._load()
        return self._rows

    def _tokens(self, tokenizer: Any, tmp: Path) -> Any:
        return tokenize_rows(self.rows, tokenizer, family=self.family, rows_are=self.rows_are, eos=eos_id(tokenizer),
                             num_proc=self.num_proc, cache_file=str(tmp / "tokens.arrow"))

    def blocks(self, tokenizer: Any, tok_key: str, seq_len: int) -> Any:
        """GPT-2: the Arrow dataset of ``seq_len`` blocks, prepared once per node."""
        import datasets  # local: datasets ≥0.8 s (not for synthetic data)

        key = text_digest([self.key, self.rows_are, tok_key, str(seq_len)])[:24]

        def build(tmp: Path) -> None:
            with _scratch(tmp) as work:
                tokens = self._tokens(tokenizer, work)
                group_blocks(tokens, seq_len, self.rows_are, num_proc=self.num_proc,
                             cache_file=str(work / "blocks.arrow")).save_to_disk(str(tmp))

        return datasets.load_from_disk(str(prepared(self.cache / "blocks" / f"{self.family}-{key}", build,
                                                    self.timeout_s)))

    def sentences(self, tokenizer: Any, tok_key: str) -> TokenizedCorpus:
        """BERT: the documents' sentences as token ids, prepared once per node."""
        key = text_digest([self.key, self.rows_are, tok_key])[:24]

        def build(tmp: Path) -> None:
            with _scratch(tmp) as work:
                assemble_corpus(self._tokens(tokenizer, work), self.rows_are, len(tokenizer)).save(tmp)

        return TokenizedCorpus.load(prepared(self.cache / "tokens" / f"{self.family}-{key}.npz", build, self.timeout_s))


def _tokenizer(name: str | None, corpus: _Corpus, family: str, vocab_size: int, offline: bool,
               timeout_s: float) -> tuple[Any, str]:
    """``data.tokenizer`` (checked against the model's vocabulary), or the offline BPE trained on the
    training split; with its cache key."""
    if name:
        tokenizer = load_tokenizer(str(name), family, offline)
        check_vocab(tokenizer, vocab_size, str(name))
        return tokenizer, tokenizer_fingerprint(tokenizer)

    def build(tmp: Path) -> None:
        tmp.write_text(train_bpe(iter_texts(corpus.rows), vocab_size, family).to_str())

    path = prepared(corpus.cache / "tokenizers" / f"{family}-bpe{vocab_size}-{corpus.key[:16]}.json", build, timeout_s)
    return wrap_tokenizer(Tokenizer.from_file(str(path)), family), f"bpe{vocab_size}-{corpus.key[:16]}"


def _specials(tokenizer: Any, name: str | None, family: str) -> SpecialIds | None:
    if family != "bert":
        return None
    return bert_ids(tokenizer, str(name)) if name else default_bert_ids(len(tokenizer))


def _from_corpus(corpus: _Corpus, tokenizer: Any, tok_key: str, specials: SpecialIds | None, family: str,
                 seq_len: int, seed: int, num_samples: int | None, mlm_probability: float) -> Dataset:
    if family == "gpt2":
        return LMBlockDataset(corpus.blocks(tokenizer, tok_key, seq_len), num_samples)
    sentences = corpus.sentences(tokenizer, tok_key)
    instances = make_nsp_instances(sentences, seq_len, seed, num_samples)
    return BertPairDataset(instances, seq_len, len(tokenizer), seed, mlm_probability, specials)


def build_source(name: str = "synthetic", *, family: str, seq_len: int, vocab_size: int, seed: int = 0,
                 num_samples: int | None = None, cache_dir: str = DEFAULT_CACHE_DIR, tokenizer: str | None = None,
                 offline: bool = False, mlm_probability: float = 0.15, num_proc: int | None = None,
                 prepare_timeout_s: float = DEFAULT_TIMEOUT_S, **options: Any) -> DataSource:
    """Train and (optional) validation datasets of one source, and their tokenizer; items are dicts of
    tensors.

    ``options`` are the source's keys of ``SOURCE_DEFAULTS`` (unknown keys raise ``TypeError``).
    ``num_samples`` caps the training set (``None``: whole corpus; synthetic default 1024).
    ``tokenizer``: an ``AutoTokenizer`` name or path (``None``: the offline BPE). ``offline``: use only
    local caches (also when a Hugging Face offline variable is set). ``num_proc``: processes of
    ``Dataset.map`` (``None``: by size). Tokenized data is cached under ``cache_dir`` and prepared by
    one process per node while the others wait (up to ``prepare_timeout_s``).
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
        return DataSource(train, val)

    hub_offline(bool(offline))  # data.offline=true or HF_*_OFFLINE: local caches only
    cache = Path(cache_dir).expanduser()
    files = normalize_data_files(opt["data_files"])
    max_rows = None if opt["max_rows"] is None else int(opt["max_rows"])
    if name == "text":
        if not files or isinstance(files, Mapping):
            raise ValueError("data source 'text' needs data_files: a local text file or a list of them")
        source = {"path": "text", "name": None, "data_files": files}
        origin = file_digest(files)
    else:  # wikitext2 / wikipedia: a hub dataset (network or local HF cache) or local copies via data_files
        source = {"path": None if files and opt["path"] == SOURCE_DEFAULTS[name]["path"] else opt["path"],
                  "name": None if files else opt["hf_name"], "data_files": files}
        saved = None if files else saved_dataset_key(str(opt["path"]))  # a save_to_disk directory
        origin = (file_digest(all_files(files)) if files else text_digest([saved]) if saved
                  else f"{opt['path']}/{opt['hf_name']}")

    def corpus(split: str) -> _Corpus:
        key = text_digest([origin, split, str(max_rows), opt["rows_are"], opt["text_column"]])

        def load() -> Any:
            return load_text_dataset(split=split, text_column=opt["text_column"], cache_dir=str(cache),
                                     max_rows=max_rows, streaming=bool(opt["streaming"]), fingerprint=key[:32],
                                     **source)

        return _Corpus(key, load, family=family, rows_are=opt["rows_are"], cache=cache, num_proc=num_proc,
                       timeout_s=float(prepare_timeout_s))

    train_corpus = corpus("train" if name == "text" else opt["split"])
    tok, tok_key = _tokenizer(tokenizer, train_corpus, family, vocab_size, bool(offline), float(prepare_timeout_s))
    specials = _specials(tok, tokenizer, family)
    if name == "text":
        full = _from_corpus(train_corpus, tok, tok_key, specials, family, seq_len, seed, None, mlm_probability)
        train, val = _split_tail(full, float(opt["val_fraction"]))
        if num_samples is not None and len(train) > int(num_samples):  # type: ignore[arg-type]
            train = torch.utils.data.Subset(train, range(int(num_samples)))
        return DataSource(train, val, tok)
    train = _from_corpus(train_corpus, tok, tok_key, specials, family, seq_len, seed, num_samples, mlm_probability)
    val = None
    if opt["val_split"]:  # tokenized with the training split's tokenizer
        val = _from_corpus(corpus(opt["val_split"]), tok, tok_key, specials, family, seq_len, seed + 1, None,
                           mlm_probability)
    return DataSource(train, val, tok)


def build_datasets(name: str = "synthetic", **kwargs: Any) -> tuple[Dataset, Dataset | None]:
    """:func:`build_source`'s ``(train, val | None)``."""
    source = build_source(name, **kwargs)
    return source.train, source.val


def make_dataloader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int = 0, num_workers: int = 0,
                    drop_last: bool = True, pin_memory: bool = False,
                    position: Callable[[], dict[str, int]] | None = None,
                    sampler: Sampler | None = None) -> DataLoader:
    """A DataLoader; shuffling is seeded, or ``sampler`` (e.g. the datamodule's ``DistributedSampler``
    over the data-parallel replicas) picks the order. With ``position`` (the training position, read
    when a checkpoint is saved) it resumes mid-epoch
    (:class:`~pipeline_recipes.datamodules.resumable.ResumableDataLoader`)."""
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
                      global_batch_size: int, batch_size: int | None = None, seed: int = 0,
                      num_workers: int | str | None = 0, pin_memory: bool | str | None = False,
                      **kwargs: Any) -> tuple[DataLoader, DataLoader | None]:
    """``build_datasets`` + ``make_dataloader`` without Lightning (batch size: ``batch_size`` or the global one;
    ``auto`` loader settings for one process, on CUDA when it is available)."""
    workers, pin = loader_settings(num_workers, pin_memory, cuda=torch.cuda.is_available(), cpus=cpus_per_rank(1))
    train, val = build_datasets(name, family=family, seq_len=seq_len, vocab_size=vocab_size, seed=seed, **kwargs)
    bs = int(batch_size or global_batch_size)
    loader = {"num_workers": workers, "pin_memory": pin}
    train_dl = make_dataloader(train, bs, shuffle=True, seed=seed, **loader)
    val_dl = make_dataloader(val, bs, shuffle=False, **loader) if val is not None else None
    return train_dl, val_dl
