"""Seeded synthetic token data with the shapes of real GPT-2 and BERT pre-training batches.

Item ``i`` depends only on ``(seed, i, stream)`` (stream 0: training, 1: validation; the token table
depends on ``seed`` alone, so both follow one distribution). With ``structure="bigram"`` (default) tokens follow a fixed
random successor table (``next = table[prev]`` with probability ``1 - noise``, else uniform), so a
model can learn it and smoke tests see the loss fall; ``structure="uniform"`` draws i.i.d. tokens.
BERT items: ``[CLS] A [SEP] B [SEP]`` padded with ``[PAD]`` (``attention_mask`` 0) for a
``pad_fraction`` of the samples, segment ids, 15% MLM masking and NSP labels (B continues A's chain,
label 0, or starts afresh, label 1).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from .masking import FIRST_BERT_TOKEN, bert_example, sample_rng

STRUCTURES = ("bigram", "uniform")


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


class SyntheticGPT2Dataset(Dataset):
    """``num_samples`` items ``{"input_ids": LongTensor[seq_len]}`` (labels are the inputs, shifted by the loss)."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0,
                 structure: str = "bigram", noise: float = 0.1, stream: int = 0) -> None:
        self.num_samples, self.seq_len, self.seed, self.stream = int(num_samples), int(seq_len), int(seed), int(stream)
        self.chain = _TokenChain(seed, 0, vocab_size, structure, noise)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        ids = self.chain.sample(sample_rng(self.seed, index, self.stream), self.seq_len)
        return {"input_ids": torch.from_numpy(ids.astype(np.int64))}


class SyntheticBertDataset(Dataset):
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

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
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
