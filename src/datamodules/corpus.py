"""Text corpora through ``datasets.load_dataset``, tokenized offline, as GPT-2 blocks or BERT pairs.

* ``load_rows``: local files (``text``/``parquet``/``json``/``csv`` builders, picked from the
  extension) or a hub dataset (``Salesforce/wikitext``, ``wikimedia/wikipedia``) for users with network or a
  local cache; ``offline=True`` switches ``datasets``/``huggingface_hub`` to cache-only at run time.
* ``TokenizedCorpus``: documents -> sentences -> token ids (one flat ``int32`` array plus offsets),
  cached as ``.npz`` next to the tokenizer.
* ``LMBlockDataset``: the token stream cut into ``seq_len`` blocks (GPT-2's ``run_clm`` grouping).
* ``BertPairDataset``: sentence-pair instances built as Google's ``create_pretraining_data.py`` does
  (50% actual next segment, 50% random segment from another document), MLM-masked per item.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

from .masking import bert_example, sample_rng
from .tokenizer import file_digest, load_or_train_bpe, load_tokenizer_file, text_digest

BUILDERS = {".txt": "text", ".raw": "text", ".tokens": "text", ".parquet": "parquet", ".json": "json",
            ".jsonl": "json", ".csv": "csv"}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def set_hub_offline() -> None:
    """Cache-only mode for ``datasets`` and ``huggingface_hub`` (also when they are already imported)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets.config
    import huggingface_hub.constants

    datasets.config.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


DataFiles = str | Sequence[str] | Mapping[str, str | Sequence[str]]


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


def load_rows(path: str | None = None, name: str | None = None, data_files: DataFiles | None = None,
              split: str = "train", text_column: str = "text", cache_dir: str | None = None,
              max_rows: int | None = None, offline: bool = False) -> list[str]:
    """The ``text_column`` of one split as a list of strings.

    With ``data_files`` and no ``path`` the builder comes from the file extension. ``split`` may be any
    ``datasets`` split expression (``"train[:1%]"``).
    """
    import datasets

    if offline:
        set_hub_offline()
    normalized = normalize_data_files(data_files)
    files = all_files(normalized)
    if path is None:
        if not files:
            raise ValueError("give a dataset 'path' (hub name or builder) or local 'data_files'")
        exts = {Path(f).suffix.lower() for f in files}
        builders = {BUILDERS.get(e) for e in exts}
        if len(builders) != 1 or None in builders:
            raise ValueError(f"cannot infer a datasets builder from extensions {sorted(exts)}; set 'path'")
        path = builders.pop()
    kwargs: dict[str, Any] = {"split": split}
    if normalized is not None:
        kwargs["data_files"] = normalized
    if cache_dir is not None:
        kwargs["cache_dir"] = str(Path(cache_dir).expanduser() / "datasets")
    if path == "text":
        kwargs["keep_linebreaks"] = False
    ds = datasets.load_dataset(path, name, **kwargs)
    if text_column not in ds.column_names:
        raise ValueError(f"column {text_column!r} not in {ds.column_names}")
    if max_rows is not None:
        ds = ds.select(range(min(int(max_rows), len(ds))))
    return [str(t) for t in ds[text_column]]


def split_documents(rows: Sequence[str], rows_are: str) -> list[list[str]]:
    """Documents as lists of sentences.

    ``rows_are="lines"`` (text files, wikitext): blank rows end a document and every non-blank row is a
    line; ``"documents"`` (wikipedia): every row is one document. Lines are split into sentences at
    ``.``, ``!``, ``?`` followed by white space.
    """
    if rows_are not in ("lines", "documents"):
        raise ValueError(f"rows_are must be 'lines' or 'documents', got {rows_are!r}")
    docs: list[list[str]] = []
    current: list[str] = []
    for row in rows:
        lines = row.split("\n") if rows_are == "documents" else [row]
        for line in lines:
            line = line.strip()
            if line:
                current.extend(s for s in _SENTENCE_END.split(line) if s)
        if rows_are == "documents" or not row.strip():
            if current:
                docs.append(current)
            current = []
    if current:
        docs.append(current)
    return docs


@dataclass
class TokenizedCorpus:
    """Token ids of all sentences: ``ids[sent_offsets[i]:sent_offsets[i+1]]`` is sentence ``i``;
    document ``d`` holds sentences ``doc_offsets[d]:doc_offsets[d+1]``. GPT-2 streams separate sentences
    by a space and documents by a newline (``"\\n"`` is tokenized with each document's last sentence)."""

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


def tokenize_corpus(rows: Sequence[str], *, family: str, vocab_size: int, rows_are: str, cache_dir: str,
                    corpus_key: str, tokenizer_file: str | None = None,
                    tokens_key: str | None = None) -> TokenizedCorpus:
    """Split ``rows`` into documents and sentences, tokenize them (training/caching a BPE), cache the ids.

    The BPE is found or trained under ``corpus_key``; the ids are cached under ``tokens_key`` (default:
    derived from ``corpus_key``), so a validation split can reuse the training split's tokenizer.
    """
    docs = split_documents(rows, rows_are)
    if not docs:
        raise ValueError("the corpus has no text")
    texts: list[str] = []
    for doc in docs:
        for j, sentence in enumerate(doc):
            last = j == len(doc) - 1
            texts.append(sentence + ("\n" if last else " ") if family == "gpt2" else sentence)
    if tokenizer_file:
        tok = load_tokenizer_file(tokenizer_file, vocab_size, family)
        tok_id = file_digest([_tokenizer_json(tokenizer_file)])
    else:
        tok = load_or_train_bpe(texts, vocab_size, family, cache_dir, corpus_key)
        tok_id = f"bpe{vocab_size}"
    key = text_digest([tokens_key or corpus_key, rows_are, tok_id])
    cache = Path(cache_dir).expanduser() / "tokens" / f"{family}-{key[:20]}.npz"
    if cache.exists():
        z = np.load(cache)
        return TokenizedCorpus(z["ids"], z["sent_offsets"], z["doc_offsets"], tok.get_vocab_size())
    lengths = np.empty(len(texts), dtype=np.int64)
    chunks = []
    for start in range(0, len(texts), 4096):
        for k, enc in enumerate(tok.encode_batch(texts[start:start + 4096], add_special_tokens=False)):
            lengths[start + k] = len(enc.ids)
            chunks.append(np.asarray(enc.ids, dtype=np.int32))
    ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    sent_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    doc_offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, ids=ids, sent_offsets=sent_offsets, doc_offsets=doc_offsets)
    os.replace(tmp, cache)
    return TokenizedCorpus(ids, sent_offsets, doc_offsets, tok.get_vocab_size())


def _tokenizer_json(path: str) -> str:
    p = Path(path).expanduser()
    return str(p / "tokenizer.json" if p.is_dir() else p)


class LMBlockDataset(Dataset):
    """Consecutive ``seq_len`` blocks of the token stream: ``{"input_ids": LongTensor[seq_len]}``."""

    def __init__(self, corpus: TokenizedCorpus, seq_len: int, num_samples: int | None = None) -> None:
        self.ids, self.seq_len = corpus.ids, int(seq_len)
        blocks = len(self.ids) // self.seq_len
        if blocks == 0:
            raise ValueError(f"the corpus has {len(self.ids)} tokens, fewer than one block of {seq_len}")
        self.num_blocks = blocks if num_samples is None else min(blocks, int(num_samples))

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        import torch

        if not 0 <= index < self.num_blocks:
            raise IndexError(index)
        block = self.ids[index * self.seq_len:(index + 1) * self.seq_len]
        return {"input_ids": torch.from_numpy(block.astype(np.int64))}


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
                 seed: int = 0, mlm_probability: float = 0.15) -> None:
        if not instances:
            raise ValueError("no BERT sentence pairs could be built from the corpus")
        self.instances, self.seq_len, self.vocab_size = list(instances), int(seq_len), int(vocab_size)
        self.seed, self.mlm_probability = int(seed), float(mlm_probability)

    def __len__(self) -> int:
        return len(self.instances)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        a, b, is_random = self.instances[index]
        return bert_example(a, b, is_random, self.seq_len, self.vocab_size, sample_rng(self.seed, index, 1),
                            self.mlm_probability)
