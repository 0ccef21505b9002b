"""Token conventions and BERT's masked-LM corruption (BERT: Pre-training of Deep Bidirectional
Transformers for Language Understanding, Devlin et al., 2019, section 3.1).

The synthetic data and the offline BPE use ``[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4`` for BERT
(``BertConfig.pad_token_id`` is 0, :func:`default_bert_ids`) and ``<|endoftext|>=0`` for GPT-2. Real
tokenizers bring their own ids (BERT's ``[CLS]=101``, GPT-2's ``<|endoftext|>=50256``):
:class:`SpecialIds` carries them. Of the real, non-special tokens 15% (at least one) are selected; a
selected token becomes ``[MASK]`` 80% of the time, a random non-special token 10%, stays unchanged
10%, and its label is the original id; every other label is -100 (ignored by the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from pipeline_recipes.core.pipeline_model import IGNORE_INDEX

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)
GPT2_SPECIAL_TOKENS = ("<|endoftext|>",)
EOS_ID = 0
FIRST_BERT_TOKEN = len(BERT_SPECIAL_TOKENS)  # ids below are special


@dataclass(frozen=True)
class SpecialIds:
    """BERT's special token ids in one vocabulary of ``vocab_size`` ids (``len(tokenizer)``);
    ``special`` holds every id never masked nor drawn as a random replacement."""

    pad: int
    cls: int
    sep: int
    mask: int
    vocab_size: int
    special: frozenset[int]
    _pool: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        first = len(self.special)
        if self.special != frozenset(range(first)):  # specials not all first: draw from the other ids
            pool = np.setdiff1d(np.arange(self.vocab_size), np.fromiter(self.special, dtype=np.int64))
            object.__setattr__(self, "_pool", pool)

    def random_tokens(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` ids drawn uniformly from the non-special ones."""
        if self._pool is None:
            return rng.integers(len(self.special), self.vocab_size, size=n)
        return rng.choice(self._pool, size=n)

    def maskable(self, ids: np.ndarray) -> np.ndarray:
        """Where ``ids`` hold ordinary tokens."""
        if self._pool is None:
            return ids >= len(self.special)
        return ~np.isin(ids, np.fromiter(self.special, dtype=np.int64))


def default_bert_ids(vocab_size: int) -> SpecialIds:
    """The ids of the synthetic data and of the offline BPE: ``[PAD] [UNK] [CLS] [SEP] [MASK]`` first."""
    return SpecialIds(PAD_ID, CLS_ID, SEP_ID, MASK_ID, int(vocab_size), frozenset(range(FIRST_BERT_TOKEN)))


def sample_rng(seed: int, index: int, stream: int = 0) -> np.random.Generator:
    """An RNG that depends only on (seed, index): items are the same whatever the order, worker or rank."""
    return np.random.default_rng([int(seed), int(index), int(stream)])


def mlm_mask(input_ids: np.ndarray, candidates: np.ndarray, vocab_size: int, rng: np.random.Generator,
             mlm_probability: float = 0.15, specials: SpecialIds | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(corrupted_ids, labels)`` for one sequence; ``candidates`` are the maskable positions
    (``specials``: the vocabulary's ids, default :func:`default_bert_ids`)."""
    specials = specials or default_bert_ids(vocab_size)
    ids = input_ids.copy()
    labels = np.full_like(ids, IGNORE_INDEX)
    if len(candidates) == 0:
        return ids, labels
    n = max(1, int(round(mlm_probability * len(candidates))))
    chosen = np.sort(rng.choice(candidates, size=min(n, len(candidates)), replace=False))
    labels[chosen] = ids[chosen]
    action = rng.random(len(chosen))
    ids[chosen[action < 0.8]] = specials.mask
    rand = chosen[(action >= 0.8) & (action < 0.9)]
    ids[rand] = specials.random_tokens(rng, len(rand))
    return ids, labels


def bert_example(tokens_a: np.ndarray, tokens_b: np.ndarray, is_random_next: bool, seq_len: int, vocab_size: int,
                 rng: np.random.Generator, mlm_probability: float = 0.15,
                 specials: SpecialIds | None = None) -> dict[str, Tensor]:
    """``[CLS] A [SEP] B [SEP] [PAD]...`` with segment ids, padding mask, MLM labels and the NSP label
    (0: B follows A, 1: B is random, as ``BertForPreTraining`` expects)."""
    sp = specials or default_bert_ids(vocab_size)
    n_real = len(tokens_a) + len(tokens_b) + 3
    if n_real > seq_len:
        raise ValueError(f"pair of {len(tokens_a)}+{len(tokens_b)} tokens does not fit seq_len={seq_len}")
    ids = np.full(seq_len, sp.pad, dtype=np.int64)
    ids[:n_real] = np.concatenate([[sp.cls], tokens_a, [sp.sep], tokens_b, [sp.sep]])
    token_type = np.zeros(seq_len, dtype=np.int64)
    token_type[len(tokens_a) + 2:n_real] = 1
    attention = np.zeros(seq_len, dtype=np.int64)
    attention[:n_real] = 1
    candidates = np.flatnonzero((attention == 1) & sp.maskable(ids))
    ids, labels = mlm_mask(ids, candidates, vocab_size, rng, mlm_probability, sp)
    return {
        "input_ids": torch.from_numpy(ids),
        "token_type_ids": torch.from_numpy(token_type),
        "attention_mask": torch.from_numpy(attention),
        "labels": torch.from_numpy(labels),
        "next_sentence_label": torch.tensor(int(is_random_next), dtype=torch.long),
    }
