"""Seeded synthetic token data with the shapes of real GPT-2 and BERT pre-training batches.

Item ``i`` depends only on ``(seed, i, stream)`` (stream 0: training, 1: validation; the token table
depends on ``seed`` alone, so both follow one distribution). With ``structure="bigram"`` (default) tokens follow a fixed
random successor table (``next = table[prev]`` with probability ``1 - noise``, else uniform), so a
model can learn it and smoke tests see the loss fall; ``structure="uniform"`` draws i.i.d. tokens.
BERT items: ``[CLS] A [SEP] B [SEP]`` padded with ``[PAD]`` (``attention_mask`` 0) for a
``pad_fraction`` of the samples, segment ids, 15% MLM masking and NSP labels (B continues A's chain,
label 0, or starts afresh, label 1).

A set of up to :data:`MATERIALISED_BYTES` is generated whole when it is built and read by index
afterwards, as a tokenized corpus is read from its cache (generating 16 GPT-2 items per step cost the
first stage of a 2-stage pipeline about 2 % of its step on 2 CPU cores); a larger one is generated
item by item as it is read. Either way item ``i`` is the same.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from .masking import FIRST_BERT_TOKEN, bert_example, sample_rng

STRUCTURES = ("bigram", "uniform")
MATERIALISED_BYTES = 256 * 2**20  # a set up to this size is generated once, when built


class _TokenChain:
    """Tokens in ``[low, high)`` from a seeded successor table (or uniform)."""

    def __init__(self, seed: int, low: int, high: int, structure: str, noise: float) -> None:
        if structure not in STRUCTURES:
            raise ValueError(f"unknown structure {structure!r}; expected one of {STRUCTURES}")
        if high - low < 2:
            raise ValueError(f"vocabulary range [{low}, {high}) is too small")
        self.low, self.high, self.structure, self.noise = low, high, structure, float(noise)
        self.table = low + np.random.default_rng([int(seed), 0x7AB1E]).permutation(high - low)
        self._table_list = self.table.tolist()

    def sample(self, rng: np.random.Generator, length: int, first: int | None = None) -> np.ndarray:
        if self.structure == "uniform":
            return rng.integers(self.low, self.high, size=length)
        fresh = rng.integers(self.low, self.high, size=length).tolist()
        keep_chain = (rng.random(length) >= self.noise).tolist()
        table, low = self._table_list, self.low
        out = [0] * length  # a loop over Python ints: numpy's per-element indexing made this the data loader's cost
        prev = first
        for t in range(length):
            prev = out[t] = table[prev - low] if (prev is not None and keep_chain[t]) else fresh[t]
        return np.asarray(out, dtype=np.int64)


class _GeneratedItems(Dataset):
    """``num_samples`` items made by :meth:`_generate` from ``(seed, index, stream)``; the whole set is
    generated once by :meth:`_materialise` when it holds up to :data:`MATERIALISED_BYTES`."""

    num_samples: int
    _items: dict[str, Tensor] | None = None

    def _generate(self, index: int) -> dict[str, Tensor]:
        raise NotImplementedError

    def _materialise(self) -> None:
        if self.num_samples == 0:
            return
        first = self._generate(0)
        item_bytes = sum(t.numel() * t.element_size() for t in first.values())
        if item_bytes * self.num_samples <= MATERIALISED_BYTES:
            items = [first, *(self._generate(i) for i in range(1, self.num_samples))]
            self._items = {key: torch.stack([item[key] for item in items]) for key in first}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        if self._items is None:
            return self._generate(index)
        return {key: values[index].clone() for key, values in self._items.items()}  # the set stays unchanged

    def __getitems__(self, indices: list[int]) -> list[dict[str, Tensor]]:
        """A DataLoader's batch at once: one indexed copy per field (the set stays unchanged), its rows the items."""
        if self._items is None:
            return [self[i] for i in indices]
        if indices and not 0 <= min(indices) <= max(indices) < self.num_samples:
            raise IndexError(f"indices {min(indices)}..{max(indices)} outside [0, {self.num_samples})")
        index = torch.as_tensor(indices, dtype=torch.long)
        rows = {key: values[index] for key, values in self._items.items()}
        return [{key: batch[i] for key, batch in rows.items()} for i in range(len(indices))]


class SyntheticGPT2Dataset(_GeneratedItems):
    """``num_samples`` items ``{"input_ids": LongTensor[seq_len]}`` (labels are the inputs, shifted by the loss)."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0,
                 structure: str = "bigram", noise: float = 0.1, stream: int = 0) -> None:
        self.num_samples, self.seq_len, self.seed, self.stream = int(num_samples), int(seq_len), int(seed), int(stream)
        self.chain = _TokenChain(seed, 0, vocab_size, structure, noise)
        self._materialise()

    def _generate(self, index: int) -> dict[str, Tensor]:
        ids = self.chain.sample(sample_rng(self.seed, index, self.stream), self.seq_len)
        return {"input_ids": torch.from_numpy(ids.astype(np.int64))}


class SyntheticBertDataset(_GeneratedItems):
    """``num_samples`` BERT pre-training items: input_ids, token_type_ids, attention_mask, labels,
    next_sentence_label (see the module docstring)."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0,
                 structure: str = "bigram", noise: float = 0.1, pad_fraction: float = 0.5,
                 mlm_probability: float = 0.15, stream: int = 0) -> None:
        if seq_len < 7:
            raise ValueError(f"BERT samples need seq_len >= 7, got {seq_len}")
        self.num_samples, self.seq_len, self.seed, self.stream = int(num_samples), int(seq_len), int(seed), int(stream)
        self.vocab_size, self.pad_fraction, self.mlm_probability = int(vocab_size), float(pad_fraction), mlm_probability
        self.chain = _TokenChain(seed, FIRST_BERT_TOKEN, vocab_size, structure, noise)
        self._materialise()

    def _generate(self, index: int) -> dict[str, Tensor]:
        rng = sample_rng(self.seed, index, self.stream)
        n_real = self.seq_len
        if rng.random() < self.pad_fraction:
            n_real = int(rng.integers(self.seq_len // 2, self.seq_len))
        body = max(n_real - 3, 2)
        len_a = int(rng.integers(1, body))
        tokens_a = self.chain.sample(rng, len_a)
        is_random_next = bool(rng.random() < 0.5)
        # B continues A's chain (IsNext) or starts afresh (NotNext).
        tokens_b = self.chain.sample(rng, body - len_a, first=None if is_random_next else int(tokens_a[-1]))
        return bert_example(tokens_a, tokens_b, is_random_next, self.seq_len, self.vocab_size, rng,
                            self.mlm_probability)
