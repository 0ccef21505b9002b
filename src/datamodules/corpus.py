"""Text corpora through ``datasets``: loaded (or streamed), tokenized and grouped with ``Dataset.map``.

* :func:`load_text_dataset`: local files (``text``/``parquet``/``json``/``csv`` builders, picked from the
  extension) or a hub dataset (``Salesforce/wikitext``, ``wikimedia/wikipedia``) as an Arrow dataset of
  one ``text`` column. With ``streaming=True`` the rows are read as an ``IterableDataset`` and only the
  first ``max_rows`` are taken (``IterableDataset.take``) and written to Arrow: a large corpus is never
  downloaded whole. A hub dataset is first looked up once with a short timeout and no retries
  (:func:`hub_unreachable`): without an answer it is read from the local cache, or
  :class:`DataUnavailable` says why and what to do, at once instead of after ``datasets``' retries.
* :func:`tokenize_rows`: ``Dataset.map(batched=True, num_proc=…)`` with any ``transformers`` tokenizer.
  GPT-2 (causal LM): each non-blank line (``rows_are="lines"``) is tokenized with its line break, a
  blank line ends a document with the tokenizer's EOS (GPT-2's ``<|endoftext|>``; repeated blank lines
  give one), and every row of ``rows_are="documents"`` is one document ending in EOS. BERT: rows are
  split into sentences (at ``.``, ``!``, ``?``), each tokenized without special tokens.
* :func:`group_blocks`: the GPT-2 token stream cut into ``seq_len`` blocks (``run_clm``'s grouping, with
  no token lost at batch edges), again a batched ``Dataset.map``; the result does not depend on ``num_proc``.
* :func:`assemble_corpus` + :func:`make_nsp_instances`: BERT sentence pairs as Google's
  ``create_pretraining_data.py`` builds them (50% actual next segment, 50% random segment from
  another document), MLM-masked per item (:class:`BertPairDataset`).

The factory (:mod:`pipeline_recipes.datamodules.factory`) keeps each result in a node-wide cache
(:mod:`pipeline_recipes.datamodules.cache`).
"""

from __future__ import annotations

import ast
import os
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from pipeline_recipes.core.errors import DataError

from .masking import SpecialIds, bert_example, sample_rng
from .tokenizer import hub_unreachable, is_hub_id

BUILDERS = {".txt": "text", ".raw": "text", ".tokens": "text", ".parquet": "parquet", ".json": "json",
            ".jsonl": "json", ".csv": "csv"}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
AUTO_NUM_PROC_ROWS = 10_000  # num_proc=None: one process below this many rows (a pool costs more than it saves)

DataFiles = str | Sequence[str] | Mapping[str, str | Sequence[str]]


class DataUnavailable(ConnectionError):
    """A hub dataset that neither the hub (offline, or no answer) nor the local cache can give."""


def _fixes(path: str, cache: str | None) -> str:
    where = f" into {cache}" if cache else ""
    return (f"Fixes: run once with network (and without data.offline) to download {path!r}{where}, after which "
            "offline runs read it from there; or a local copy of its text: data.data_files=<file or list> (or "
            "data=text data.data_files=<file>); or data=synthetic")


def on_hub(path: str) -> bool:
    """Whether ``datasets`` looks ``path`` up on the hub: a repo id (:func:`.tokenizer.is_hub_id`), not a
    builder or a local path (a missing local path is not asked about: ``datasets`` says it is missing)."""
    from datasets import packaged_modules  # local: datasets ≥0.8 s (not for synthetic data)

    builders = set(getattr(packaged_modules, "_PACKAGED_DATASETS_MODULES", {})) | set(BUILDERS.values())
    return path not in builders and is_hub_id(path)


def missing_column(text_column: str, columns: Sequence[str] | None) -> DataError:
    """The error of a ``data.text_column`` that the data does not have, with the columns it has."""
    columns = list(columns or [])
    fix = f"data.text_column={columns[0]}" if len(columns) == 1 else f"data.text_column=<one of {columns}>"
    return DataError(f"data.text_column={text_column}: column {text_column!r} not in the data's columns {columns}. "
                     f"Fixes: {fix}; or data.data_files=<files with the column {text_column!r}>")


def unknown_split(split: str, splits: Sequence[str], err: BaseException | None = None) -> DataError:
    """The error of a split (``data.split`` / ``data.val_split``) that the data does not have."""
    return DataError(f"split {split!r} (data.split / data.val_split) is not in the data, whose splits are "
                     f"{list(splits)}{f' ({err})' if err is not None else ''}. Fixes: data.split / data.val_split="
                     f"<one of {list(splits)}>, data.val_split=null (no validation set), or data.data_files="
                     "{train: <files>, validation: <files>} (a split per key)")


_UNKNOWN_SPLIT = re.compile(r'Unknown split "(?P<split>[^"]*)"\. Should be one of (?P<splits>\[.*\])')


def _split_error(err: ValueError, split: str) -> DataError | None:
    """``datasets``' ``Unknown split "x". Should be one of [...]`` as :func:`unknown_split`; None for another."""
    found = _UNKNOWN_SPLIT.search(str(err))
    if found is None:
        return None
    try:
        splits = [str(s) for s in ast.literal_eval(found["splits"])]
    except (ValueError, SyntaxError):
        splits = [found["splits"]]
    return unknown_split(found["split"] or split, splits)


@contextmanager
def _cache_only() -> Iterator[None]:
    """``datasets`` and ``huggingface_hub`` read only their caches inside (this process, then restored)."""
    import datasets.config  # local: datasets ≥0.8 s (not for synthetic data)

    before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = before


def _load_dataset(path: str, name: str | None, kwargs: dict[str, Any]) -> Any:
    """``datasets.load_dataset``; a hub dataset fails fast, naming the cause, when it cannot be had."""
    import datasets  # local: datasets ≥0.8 s (not for synthetic data)
    import datasets.config

    if not on_hub(path):
        return datasets.load_dataset(path, name, **kwargs)
    cache = kwargs.get("cache_dir")
    if datasets.config.HF_HUB_OFFLINE:
        try:
            return datasets.load_dataset(path, name, **kwargs)
        except (ConnectionError, FileNotFoundError) as err:
            raise DataUnavailable(
                f"dataset {path!r} ({name}) is not in the local cache{f' {cache}' if cache else ''} and the hub is "
                "off: offline mode (data.offline=true, or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE / "
                f"TRANSFORMERS_OFFLINE set) reads only the cache. {_fixes(path, cache)}") from err
    unreachable = hub_unreachable(path)
    if unreachable is None:
        return datasets.load_dataset(path, name, **kwargs)
    with _cache_only():  # datasets would find a cached copy too, but only after retrying for half a minute
        try:
            return datasets.load_dataset(path, name, **kwargs)
        except (ConnectionError, FileNotFoundError) as err:
            raise DataUnavailable(
                f"couldn't reach the Hugging Face Hub ({datasets.config.HF_ENDPOINT}) for dataset {path!r}: "
                f"{type(unreachable).__name__}: {unreachable}; and it is not in the local cache"
                f"{f' {cache}' if cache else ''}. {_fixes(path, cache)}") from err


def normalize_data_files(data_files: DataFiles | None) -> list[str] | dict[str, list[str]] | None:
    """``str | list | {split: str | list}`` -> plain lists (accepts OmegaConf containers)."""
    if data_files is None:
        return None
    if isinstance(data_files, (str, os.PathLike)):
        return [str(Path(data_files).expanduser())]
    if isinstance(data_files, Mapping):
        return {str(k): normalize_data_files(v) for k, v in data_files.items()}  # type: ignore[misc]
    return [str(Path(f).expanduser()) for f in data_files]


def all_files(data_files: list[str] | dict[str, list[str]] | None) -> list[str]:
    if data_files is None:
        return []
    if isinstance(data_files, dict):
        return [f for split in sorted(data_files) for f in data_files[split]]
    return list(data_files)


def resolve_num_proc(num_proc: int | None, rows: int) -> int | None:
    """``num_proc`` for ``Dataset.map``: as given, or (``None``) up to 8 of this node's cores for large
    datasets and one process for small ones. ``None`` means one process to ``datasets``."""
    if num_proc is not None:
        n = int(num_proc)
        if n < 1:
            raise ValueError(f"data.num_proc must be a positive integer or null, got {num_proc}")
        return n if n > 1 else None
    if rows < AUTO_NUM_PROC_ROWS:
        return None
    n = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return n if n > 1 else None


def _builder(path: str | None, files: list[str]) -> str:
    if path is not None:
        return path
    if not files:
        raise ValueError("give a dataset 'path' (hub name or builder) or local 'data_files'")
    exts = {Path(f).suffix.lower() for f in files}
    builders = {BUILDERS.get(e) for e in exts}
    if len(builders) != 1 or None in builders:
        raise ValueError(f"cannot infer a datasets builder from extensions {sorted(exts)}; set 'path'")
    return str(builders.pop())


def _load_kwargs(path: str, data_files: Any, split: str, cache_dir: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"split": split}
    if data_files is not None:
        kwargs["data_files"] = data_files
    if cache_dir is not None:
        kwargs["cache_dir"] = str(Path(cache_dir).expanduser() / "datasets")
    if path == "text":
        kwargs["keep_linebreaks"] = False
    return kwargs


def _stream_rows(path: str, name: str | None, kwargs: dict[str, Any], text_column: str,
                 max_rows: int | None) -> Iterator[dict[str, str]]:
    """The first ``max_rows`` rows of a streamed split (``IterableDataset.take``)."""
    import datasets  # local: datasets ≥0.8 s (not for synthetic data)
    import datasets.config

    if on_hub(path) and not datasets.config.HF_HUB_OFFLINE and (unreachable := hub_unreachable(path)) is not None:
        raise DataUnavailable(f"couldn't reach the Hugging Face Hub ({datasets.config.HF_ENDPOINT}) to stream dataset "
                              f"{path!r}: {type(unreachable).__name__}: {unreachable}. {_fixes(path, None)}")
    stream = datasets.load_dataset(path, name, streaming=True, **kwargs)
    if text_column not in (stream.column_names or [text_column]):
        raise missing_column(text_column, stream.column_names)
    if max_rows is not None:
        stream = stream.take(int(max_rows))
    for row in stream:
        yield {"text": str(row[text_column])}


def load_text_dataset(path: str | None = None, name: str | None = None, data_files: DataFiles | None = None,
                      split: str = "train", text_column: str = "text", cache_dir: str | None = None,
                      max_rows: int | None = None, streaming: bool = False, fingerprint: str | None = None) -> Any:
    """The ``text_column`` of one split as an Arrow ``datasets.Dataset`` with one column, ``text``.

    With ``data_files`` and no ``path`` the builder comes from the file extension; a ``path`` that is a
    directory written by ``Dataset.save_to_disk``/``DatasetDict.save_to_disk`` is read with
    ``load_from_disk`` (memory-mapped: ``streaming`` does not apply). Without streaming ``split`` may be
    any ``datasets`` split expression (``"train[:1%]"``); with it, a split name. ``fingerprint`` names the
    streamed rows' Arrow cache (default: derived from the arguments).
    """
    import datasets  # local: datasets ≥0.8 s (not for synthetic data)

    if path is not None and _saved_to_disk(Path(path).expanduser()):
        ds = datasets.load_from_disk(str(Path(path).expanduser()))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise unknown_split(split, sorted(ds), f"{path} holds these")
            ds = ds[split]
        return _text_column(ds, text_column, max_rows)
    normalized = normalize_data_files(data_files)
    path = _builder(path, all_files(normalized))
    kwargs = _load_kwargs(path, normalized, split, cache_dir)
    if streaming:
        features = datasets.Features({"text": datasets.Value("string")})
        gen_kwargs = {"path": path, "name": name, "kwargs": kwargs, "text_column": text_column, "max_rows": max_rows}
        cache = kwargs.get("cache_dir")
        return datasets.Dataset.from_generator(_stream_rows, features=features, gen_kwargs=gen_kwargs,
                                               cache_dir=cache, fingerprint=fingerprint)
    try:
        ds = _load_dataset(path, name, kwargs)
    except ValueError as err:  # datasets' unknown split: named by the settings that pick it
        if (unknown := _split_error(err, split)) is not None:
            raise unknown from err
        raise
    return _text_column(ds, text_column, max_rows)


def _saved_to_disk(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def saved_dataset_key(path: str | os.PathLike[str]) -> str | None:
    """For a ``save_to_disk`` directory: its splits' ``state.json`` files (they hold the fingerprints), else None."""
    p = Path(path).expanduser()
    if not _saved_to_disk(p):
        return None
    return "\n".join(f"{f.relative_to(p)}:{f.read_text()}" for f in sorted(p.rglob("state.json")))


def _text_column(ds: Any, text_column: str, max_rows: int | None) -> Any:
    if text_column not in ds.column_names:
        raise missing_column(text_column, ds.column_names)
    if max_rows is not None:
        ds = ds.select(range(min(int(max_rows), len(ds))))
    ds = ds.select_columns([text_column])
    return ds.rename_column(text_column, "text") if text_column != "text" else ds


def load_rows(path: str | None = None, name: str | None = None, data_files: DataFiles | None = None,
              split: str = "train", text_column: str = "text", cache_dir: str | None = None,
              max_rows: int | None = None, streaming: bool = False) -> list[str]:
    """:func:`load_text_dataset`'s rows as a list of strings."""
    return [str(t) for t in load_text_dataset(path, name, data_files, split, text_column, cache_dir, max_rows,
                                              streaming)["text"]]


def iter_texts(ds: Any, batch_size: int = 1000) -> Iterator[str]:
    """The ``text`` column in batches (for training a tokenizer without holding the corpus)."""
    for batch in ds.iter(batch_size=batch_size):
        yield from batch["text"]


def _sentences(row: str, rows_are: str) -> list[str]:
    lines = row.split("\n") if rows_are == "documents" else [row]
    return [s for line in lines if line.strip() for s in _SENTENCE_END.split(line.strip()) if s]


def split_documents(rows: Sequence[str], rows_are: str) -> list[list[str]]:
    """Documents as lists of sentences.

    ``rows_are="lines"`` (text files, wikitext): blank rows end a document and every non-blank row is a
    line; ``"documents"`` (wikipedia): every row is one document. Lines are split into sentences at
    ``.``, ``!``, ``?`` followed by white space.
    """
    _check_rows_are(rows_are)
    docs: list[list[str]] = []
    current: list[str] = []
    for row in rows:
        current.extend(_sentences(row, rows_are))
        if rows_are == "documents" or not row.strip():
            if current:
                docs.append(current)
            current = []
    if current:
        docs.append(current)
    return docs


def _check_rows_are(rows_are: str) -> None:
    if rows_are not in ("lines", "documents"):
        raise ValueError(f"rows_are must be 'lines' or 'documents', got {rows_are!r}")


def _causal_batch(batch: dict[str, list], tokenizer: Any, rows_are: str, eos: int | None) -> dict[str, list]:
    texts = batch["text"]
    blank = [not t.strip() for t in texts]
    if rows_are == "lines":
        body = [t.strip() + "\n" for t, b in zip(texts, blank) if not b]
    else:
        body = ["\n".join(line.strip() for line in t.split("\n") if line.strip()) + "\n" for t, b in zip(texts, blank)
                if not b]
    encoded = iter(tokenizer(body, add_special_tokens=False)["input_ids"] if body else [])
    end = [] if eos is None else [eos]
    ids = []
    for b in blank:
        if b:
            ids.append(end if rows_are == "lines" else [])
        else:
            ids.append(list(next(encoded)) + (end if rows_are == "documents" else []))
    return {"input_ids": ids, "length": [len(x) for x in ids], "blank": blank}


def _bert_batch(batch: dict[str, list], tokenizer: Any, rows_are: str) -> dict[str, list]:
    texts = batch["text"]
    per_row = [_sentences(t, rows_are) for t in texts]
    flat = [s for sents in per_row for s in sents]
    encoded = iter(tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else [])
    return {"sentences": [[list(next(encoded)) for _ in sents] for sents in per_row],
            "blank": [not t.strip() for t in texts]}


def tokenize_rows(ds: Any, tokenizer: Any, *, family: str, rows_are: str, eos: int | None = None,
                  num_proc: int | None = None, cache_file: str | None = None) -> Any:
    """Token ids per row (see the module docstring): GPT-2 ``input_ids``/``length``/``blank``, BERT
    ``sentences``/``blank``; ``Dataset.map(batched=True, num_proc=…)`` written to ``cache_file``."""
    _check_rows_are(rows_are)
    fn, kwargs = ((_bert_batch, {"tokenizer": tokenizer, "rows_are": rows_are}) if family == "bert" else
                  (_causal_batch, {"tokenizer": tokenizer, "rows_are": rows_are, "eos": eos}))
    return ds.map(fn, batched=True, fn_kwargs=kwargs, remove_columns=ds.column_names,
                  num_proc=resolve_num_proc(num_proc, len(ds)), cache_file_name=cache_file,
                  new_fingerprint=None if cache_file is None else Path(cache_file).stem, desc="tokenizing")


def stream_lengths(tokens: Any, rows_are: str) -> np.ndarray:
    """Tokens each row contributes to the GPT-2 stream: all of them, except that a blank line's EOS is
    dropped at the start and after another EOS (one EOS between documents)."""
    lengths = np.asarray(tokens["length"], dtype=np.int64)
    if rows_are != "lines":
        return lengths
    blank = np.asarray(tokens["blank"], dtype=bool)
    after_eos = True
    for i in range(len(lengths)):
        if blank[i]:
            if after_eos:
                lengths[i] = 0
            after_eos = True
        elif lengths[i]:
            after_eos = False
    return lengths


def _blocks_batch(batch: dict[str, list], tokens: Any, offsets: np.ndarray, seq_len: int) -> dict[str, list]:
    first, last = int(batch["block"][0]), int(batch["block"][-1])  # a batch is a contiguous range of blocks
    start, end = first * seq_len, (last + 1) * seq_len
    r0 = int(np.searchsorted(offsets, start, side="right")) - 1
    r1 = int(np.searchsorted(offsets, end, side="left"))
    rows = tokens[r0:r1]["input_ids"]
    stream = np.concatenate([np.asarray(row[:offsets[r0 + j + 1] - offsets[r0 + j]], dtype=np.int32)
                             for j, row in enumerate(rows)])
    base = int(offsets[r0])
    return {"input_ids": [stream[k * seq_len - base:(k + 1) * seq_len - base] for k in range(first, last + 1)]}


def group_blocks(tokens: Any, seq_len: int, rows_are: str, *, num_proc: int | None = None,
                 cache_file: str | None = None) -> Any:
    """The rows' token stream cut into consecutive ``seq_len`` blocks (the tail shorter than a block is
    dropped): a ``Dataset`` with one ``input_ids`` column, built by a batched ``Dataset.map`` over the
    block indices (each batch reads the rows it spans), so no token is lost at batch edges."""
    import datasets  # local: datasets ≥0.8 s (not for synthetic data)

    lengths = stream_lengths(tokens, rows_are)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n_blocks = int(offsets[-1]) // int(seq_len)
    if n_blocks == 0:
        raise DataError(f"the corpus has {int(offsets[-1])} tokens, fewer than one block of {seq_len} (data.seq_len"
                        "). Fixes: more text (data.data_files=<more files>, data.max_rows=null), a shorter "
                        "model.seq_len (data.seq_len follows it), or data=synthetic")
    index = datasets.Dataset.from_dict({"block": np.arange(n_blocks, dtype=np.int64)})
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    return index.map(_blocks_batch, batched=True, fn_kwargs={"tokens": tokens, "offsets": offsets, "seq_len": seq_len},
                     remove_columns=["block"], features=features, num_proc=resolve_num_proc(num_proc, n_blocks),
                     cache_file_name=cache_file, new_fingerprint=None if cache_file is None else Path(cache_file).stem,
                     desc="grouping")


@dataclass
class TokenizedCorpus:
    """Token ids of all sentences: ``ids[sent_offsets[i]:sent_offsets[i+1]]`` is sentence ``i``;
    document ``d`` holds sentences ``doc_offsets[d]:doc_offsets[d+1]``."""

    ids: np.ndarray
    sent_offsets: np.ndarray
    doc_offsets: np.ndarray
    vocab_size: int  # of the tokenizer (at most the model's)

    def document(self, d: int) -> list[np.ndarray]:
        s0, s1 = self.doc_offsets[d], self.doc_offsets[d + 1]
        return [self.ids[self.sent_offsets[i]:self.sent_offsets[i + 1]] for i in range(s0, s1)]

    @property
    def num_documents(self) -> int:
        return len(self.doc_offsets) - 1

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "wb") as f:
            np.savez(f, ids=self.ids, sent_offsets=self.sent_offsets, doc_offsets=self.doc_offsets,
                     vocab_size=np.int64(self.vocab_size))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TokenizedCorpus:
        z = np.load(path)
        return cls(z["ids"], z["sent_offsets"], z["doc_offsets"], int(z["vocab_size"]))


def assemble_corpus(tokens: Any, rows_are: str, vocab_size: int) -> TokenizedCorpus:
    """BERT's tokenized rows (``sentences``, ``blank``) as documents of sentences, in row order (the
    documents of :func:`split_documents`)."""
    chunks: list[np.ndarray] = []
    sent_lengths: list[int] = []
    doc_sizes: list[int] = []
    current = 0
    for batch in tokens.iter(batch_size=1000):
        for sents, blank in zip(batch["sentences"], batch["blank"]):
            for s in sents:
                chunks.append(np.asarray(s, dtype=np.int32))
                sent_lengths.append(len(s))
            current += len(sents)
            if (rows_are == "documents" or blank) and current:
                doc_sizes.append(current)
                current = 0
    if current:
        doc_sizes.append(current)
    if not doc_sizes:
        raise ValueError("the corpus has no text")
    ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    sent_offsets = np.concatenate([[0], np.cumsum(sent_lengths)]).astype(np.int64)
    doc_offsets = np.concatenate([[0], np.cumsum(doc_sizes)]).astype(np.int64)
    return TokenizedCorpus(ids, sent_offsets, doc_offsets, int(vocab_size))


class LMBlockDataset(Dataset):
    """``seq_len`` blocks of the token stream (an Arrow dataset of :func:`group_blocks`):
    ``{"input_ids": LongTensor[seq_len]}``."""

    def __init__(self, blocks: Any, num_samples: int | None = None) -> None:
        self.blocks = blocks.with_format("numpy", columns=["input_ids"])
        self.num_blocks = len(blocks) if num_samples is None else min(len(blocks), int(num_samples))

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < self.num_blocks:
            raise IndexError(index)
        return {"input_ids": torch.from_numpy(np.asarray(self.blocks[int(index)]["input_ids"], dtype=np.int64))}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Tensor]]:
        """A batch's items in one Arrow read (the DataLoader's batched fetch)."""
        if any(not 0 <= i < self.num_blocks for i in indices):
            raise IndexError(indices)
        rows = np.asarray(self.blocks[[int(i) for i in indices]]["input_ids"], dtype=np.int64)
        return [{"input_ids": torch.from_numpy(row)} for row in rows]


def _truncate_pair(a: list[int], b: list[int], max_tokens: int) -> None:
    while len(a) + len(b) > max_tokens:
        (a if len(a) > len(b) else b).pop()


def make_nsp_instances(corpus: TokenizedCorpus, seq_len: int, seed: int,
                       max_instances: int | None = None) -> list[tuple[np.ndarray, np.ndarray, bool]]:
    """Sentence-pair instances ``(tokens_a, tokens_b, is_random_next)`` filling up to ``seq_len - 3`` tokens."""
    rng = random.Random(seed)
    max_tokens = seq_len - 3
    if max_tokens < 2:
        raise ValueError(f"BERT pairs need seq_len >= 5, got {seq_len}")
    docs = [[s for s in corpus.document(d) if len(s)] for d in range(corpus.num_documents)]
    docs = [d for d in docs if d]
    out: list[tuple[np.ndarray, np.ndarray, bool]] = []
    for d, doc in enumerate(docs):
        chunk: list[np.ndarray] = []
        length = 0
        i = 0
        while i < len(doc):
            chunk.append(doc[i])
            length += len(doc[i])
            if i == len(doc) - 1 or length >= max_tokens:
                a_end = 1 if len(chunk) == 1 else rng.randint(1, len(chunk) - 1)
                a = [int(t) for s in chunk[:a_end] for t in s]
                if len(chunk) == 1 or rng.random() < 0.5:
                    is_random = True
                    others = [k for k in range(len(docs)) if k != d] or [d]
                    other = docs[rng.choice(others)]
                    start = rng.randrange(len(other))
                    b = [int(t) for s in other[start:] for t in s][:max_tokens]
                    i -= len(chunk) - a_end  # the unused segments are read again
                else:
                    is_random = False
                    b = [int(t) for s in chunk[a_end:] for t in s]
                _truncate_pair(a, b, max_tokens)
                if a and b:
                    out.append((np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64), is_random))
                chunk, length = [], 0
            i += 1
        if max_instances is not None and len(out) >= max_instances:
            break
    rng.shuffle(out)
    return out if max_instances is None else out[:max_instances]


class BertPairDataset(Dataset):
    """BERT pre-training items from NSP instances; MLM masking depends only on ``(seed, index)``."""

    def __init__(self, instances: Sequence[tuple[np.ndarray, np.ndarray, bool]], seq_len: int, vocab_size: int,
                 seed: int = 0, mlm_probability: float = 0.15, specials: SpecialIds | None = None) -> None:
        if not instances:
            raise ValueError("no BERT sentence pairs could be built from the corpus")
        self.instances, self.seq_len, self.vocab_size = list(instances), int(seq_len), int(vocab_size)
        self.seed, self.mlm_probability, self.specials = int(seed), float(mlm_probability), specials

    def __len__(self) -> int:
        return len(self.instances)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        a, b, is_random = self.instances[index]
        return bert_example(a, b, is_random, self.seq_len, self.vocab_size, sample_rng(self.seed, index, 1),
                            self.mlm_probability, self.specials)
