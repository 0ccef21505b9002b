"""Offline tokenizers: a byte-level BPE (as GPT-2's) trained locally with ``tokenizers``, cached on disk.

Nothing is downloaded: the BPE is trained on the corpus itself (under a second for a few MB) and
saved as ``<cache_dir>/tokenizers/<family>-bpe<vocab>-<key>.json``, where ``key`` fingerprints the
corpus (content hash of local files, or the hub dataset's name). A pre-made ``tokenizer.json`` can be
given instead (``tokenizer_file``). Special tokens come first, so their ids match ``masking.py``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .masking import BERT_SPECIAL_TOKENS, GPT2_SPECIAL_TOKENS


def special_tokens(family: str) -> tuple[str, ...]:
    if family == "bert":
        return BERT_SPECIAL_TOKENS
    if family == "gpt2":
        return GPT2_SPECIAL_TOKENS
    raise ValueError(f"unknown model family {family!r}; expected 'gpt2' or 'bert'")


def file_digest(paths: Sequence[str | os.PathLike[str]]) -> str:
    """SHA-256 over the contents of ``paths`` (in order)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(os.fsencode(Path(p).name))
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def text_digest(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file and ``os.replace`` so concurrent ranks never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def train_bpe(texts: Iterable[str], vocab_size: int, family: str) -> Tokenizer:
    """Train a byte-level BPE with at most ``vocab_size`` tokens (special tokens first)."""
    specials = special_tokens(family)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(specials):
        raise ValueError(f"a byte-level BPE needs vocab_size >= {len(alphabet) + len(specials)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_or_train_bpe(texts: Iterable[str], vocab_size: int, family: str, cache_dir: str | os.PathLike[str],
                      key: str) -> Tokenizer:
    """The cached tokenizer for (family, vocab_size, key), training it on ``texts`` on a miss."""
    path = Path(cache_dir).expanduser() / "tokenizers" / f"{family}-bpe{vocab_size}-{key[:16]}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = train_bpe(texts, vocab_size, family)
    atomic_write_text(path, tok.to_str())
    return tok


def load_tokenizer_file(path: str | os.PathLike[str], vocab_size: int, family: str) -> Tokenizer:
    """A local ``tokenizer.json`` (file or directory holding one); its ids must fit the model's vocabulary."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    tok = Tokenizer.from_file(str(p))
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer {p} has {tok.get_vocab_size()} tokens; the model's vocab_size is {vocab_size}")
    for i, name in enumerate(special_tokens(family)):
        if tok.token_to_id(name) != i:
            raise ValueError(f"tokenizer {p}: {name} must have id {i} for {family} data")
    return tok
