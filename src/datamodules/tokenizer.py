"""Tokenizers: any ``transformers`` tokenizer (``data.tokenizer``), or a byte-level BPE trained offline.

* ``data.tokenizer=<name or path>``: ``AutoTokenizer.from_pretrained`` (a hub name such as ``gpt2`` or
  ``bert-base-uncased``, a directory written by ``save_pretrained``, or a bare ``tokenizer.json``).
  Its special tokens are used as they are (GPT-2's ``<|endoftext|>`` = 50256 ends documents; BERT's
  ``[CLS]``/``[SEP]``/``[MASK]``/``[PAD]`` build the pairs), and the model's vocabulary must cover it
  (:func:`check_vocab`, also run before launch by :func:`check_tokenizer_config`).
* ``data.tokenizer=null`` (default, no network): a byte-level BPE as GPT-2's, trained with
  ``tokenizers`` on the corpus itself (under a second for a few MB), cached as
  ``<cache_dir>/tokenizers/<family>-bpe<vocab>-<key>.json`` (``key`` fingerprints the corpus), wrapped
  as a ``PreTrainedTokenizerFast`` whose special tokens come first (the ids of ``masking.py``).

The hub is offline only when the user says so: ``data.offline=true`` or one of Hugging Face's own
variables (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``, ``TRANSFORMERS_OFFLINE``); see :func:`hub_offline`.
Otherwise a hub name is looked up once with a short timeout (:func:`hub_unreachable`); without an answer
the local cache is read, or the error says so at once instead of after the libraries' retries.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import huggingface_hub.constants
from huggingface_hub.errors import HFValidationError, HfHubHTTPError
from huggingface_hub.utils import validate_repo_id
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline_recipes.core.errors import DataError

from .masking import BERT_SPECIAL_TOKENS, GPT2_SPECIAL_TOKENS, SpecialIds

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
TOKENIZER_FILES_KEY = "tokenizer_files"  # the datamodule's checkpoint state: {file name: bytes} of save_pretrained
_TRUE = {"1", "ON", "YES", "TRUE"}


def special_tokens(family: str) -> tuple[str, ...]:
    if family == "bert":
        return BERT_SPECIAL_TOKENS
    if family == "gpt2":
        return GPT2_SPECIAL_TOKENS
    raise ValueError(f"unknown model family {family!r}; expected 'gpt2' or 'bert'")


def hub_offline(offline: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the hub must not be contacted: ``data.offline=true`` or a Hugging Face offline variable.
    When so, ``datasets``/``huggingface_hub``/``transformers`` are switched to their local caches (also
    when they are already imported)."""
    env = os.environ if environ is None else environ
    if not (offline or any(env.get(v, "").upper() in _TRUE for v in OFFLINE_VARIABLES)):
        return False
    if environ is None:
        set_hub_offline()
    return True


HUB_TIMEOUT_S = 10.0  # one look-up of a hub repository before loading from it (no retries)


def hub_endpoint() -> str:
    return str(huggingface_hub.constants.ENDPOINT)


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is looked up on the hub: a repository id (``name`` or ``namespace/name``, by the
    hub's own rule) that is not a path existing here. A path written as one (``/data/tok``, ``./tok``,
    ``~/tok``, ``a/b/c``, a URL) is never a hub name: missing, it is a missing local path."""
    if "://" in name or name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_unreachable(repo_id: str, repo_type: str = "dataset", timeout_s: float = HUB_TIMEOUT_S) -> Exception | None:
    """One look-up of ``repo_id`` on the hub, with a timeout and no retries: the error when no answer
    came (no network, no name resolution, a refused connection, a timeout); None when the hub answered,
    also with "not found" or "gated" (the loader then says which), and for a name that is no repository
    id (:func:`is_hub_id`: nothing was asked; the loader says what is wrong with it)."""
    from huggingface_hub import HfApi  # local: hub client ≥0.2 s, only to ask the hub

    try:
        HfApi(endpoint=hub_endpoint()).repo_info(repo_id, repo_type=repo_type, timeout=timeout_s)
    except (HfHubHTTPError, HFValidationError):  # an answer, or not a name the hub could be asked about
        return None
    except Exception as err:  # noqa: BLE001 - the transport's errors differ by huggingface_hub version
        return err
    return None


def set_hub_offline() -> None:
    """Cache-only mode for ``datasets``, ``huggingface_hub`` and ``transformers`` in this process."""
    for var in OFFLINE_VARIABLES:
        os.environ[var] = "1"
    import datasets.config  # local: datasets ≥0.8 s (not for synthetic data)

    datasets.config.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


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


def _special_kwargs(family: str, vocab: Mapping[str, int]) -> dict[str, str]:
    """The family's special tokens by role, where the vocabulary has them."""
    if family == "gpt2":
        eos = GPT2_SPECIAL_TOKENS[0]
        return {"bos_token": eos, "eos_token": eos, "unk_token": eos} if eos in vocab else {}
    roles = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), BERT_SPECIAL_TOKENS))
    return {role: name for role, name in roles.items() if name in vocab}


def wrap_tokenizer(tok: Tokenizer, family: str) -> Any:
    """A ``tokenizers.Tokenizer`` (the offline BPE, a bare ``tokenizer.json``) as a
    ``PreTrainedTokenizerFast`` with the family's special tokens by role."""
    from transformers import PreTrainedTokenizerFast  # local: transformers ≥1.0 s; after the offline switches

    return PreTrainedTokenizerFast(tokenizer_object=tok, **_special_kwargs(family, tok.get_vocab()))


def load_tokenizer(name_or_path: str, family: str, offline: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained(name_or_path)`` (local files only when offline); a path to a
    ``tokenizer.json`` file is wrapped by :func:`wrap_tokenizer`."""
    path = Path(str(name_or_path)).expanduser()
    if path.is_file():
        return wrap_tokenizer(Tokenizer.from_file(str(path)), family)
    if not path.is_dir() and (path.suffix == ".json" or not is_hub_id(str(name_or_path))):
        raise DataError(f"data.tokenizer={name_or_path}: FileNotFoundError: no such directory or file "
                        f"{str(path.resolve())!r} (a relative path is read from the working directory {os.getcwd()}"
                        "), and it is not a Hugging Face Hub name ('name' or 'namespace/name'). Fixes: "
                        "data.tokenizer=<an existing directory written by save_pretrained, or a tokenizer.json>; "
                        "or a hub name (data.tokenizer=gpt2); or data.tokenizer=null (a BPE trained offline on the "
                        "corpus)")
    from transformers import AutoTokenizer  # local: transformers ≥1.0 s; after the offline switches

    local = hub_offline(offline)
    if not local and not path.is_dir() and (unreachable := hub_unreachable(str(name_or_path), "model")) is not None:
        try:  # the hub did not answer: a copy in the local cache will do (transformers would retry first)
            return AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=True)
        except (OSError, ValueError) as err:
            raise DataError(f"data.tokenizer={name_or_path}: couldn't reach the Hugging Face Hub ({hub_endpoint()}):"
                            f" {type(unreachable).__name__}: {unreachable}; and it is not in the local cache. Fixes: "
                            "run once with network to download it; or give a directory written by save_pretrained "
                            "or a tokenizer.json; or data.tokenizer=null (a BPE trained offline on the corpus)"
                            ) from err
    try:
        return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else str(name_or_path), local_files_only=local)
    except (OSError, ValueError) as err:
        where = "the local Hugging Face cache (offline)" if local else "the hub or the local cache"
        raise DataError(f"data.tokenizer={name_or_path}: no tokenizer found as a local directory or in {where}: "
                        f"{err}. Fixes: give a directory written by save_pretrained, a tokenizer.json, or a hub name"
                        + (" (with network: drop data.offline and the HF_*_OFFLINE variables)" if local else "")
                        + "; or data.tokenizer=null (a BPE trained offline on the corpus)") from err


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A content hash of the tokenizer (its serialized backend and special tokens): keys the caches."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return text_digest([type(tokenizer).__name__, body, repr(sorted(tokenizer.special_tokens_map.items()))])


def check_vocab(tokenizer: Any, vocab_size: int, name: str) -> None:
    """The model's embedding must have a row for every id of the tokenizer."""
    n = len(tokenizer)
    if n > int(vocab_size):
        padded = -(-n // 64) * 64
        raise ValueError(f"data.tokenizer={name} has {n} tokens but model.vocab_size = {vocab_size}: the embedding "
                         f"needs a row per token id; set model.vocab_size={n} or more (e.g. {padded}, a multiple "
                         "of 64)")


def eos_id(tokenizer: Any) -> int | None:
    """The id that ends a document in a causal-LM stream: EOS (GPT-2's ``<|endoftext|>``), else SEP."""
    for attr in ("eos_token_id", "sep_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return None


def bert_ids(tokenizer: Any, name: str) -> SpecialIds:
    """BERT's special ids as this tokenizer defines them."""
    ids = {role: getattr(tokenizer, f"{role}_token_id", None) for role in ("pad", "cls", "sep", "mask")}
    missing = [role for role, value in ids.items() if value is None]
    if missing:
        raise ValueError(f"data.tokenizer={name} has no {', '.join(f'{r}_token' for r in missing)}: BERT "
                         "pre-training pairs need [CLS], [SEP], [MASK] and [PAD]; use a BERT-style tokenizer "
                         "(e.g. bert-base-uncased) or data.tokenizer=null (the offline BPE)")
    special = frozenset(int(i) for i in tokenizer.all_special_ids)
    return SpecialIds(int(ids["pad"]), int(ids["cls"]), int(ids["sep"]), int(ids["mask"]), len(tokenizer),
                      special | {int(v) for v in ids.values()})


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes for ``tokenizer`` (checkpoints carry them for the export)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def write_tokenizer_files(files: Mapping[str, bytes], out_dir: str | os.PathLike[str]) -> list[str]:
    """Write :func:`tokenizer_files`'s output into ``out_dir`` (loadable by ``AutoTokenizer``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if Path(name).name != name:
            raise ValueError(f"tokenizer file name {name!r} is not a plain file name")
        (out / name).write_bytes(data)
    return sorted(files)


def check_tokenizer_config(data: Mapping[str, Any]) -> None:
    """Before launch: ``data.tokenizer`` loads, ``model.vocab_size`` covers it and BERT data finds its
    special tokens (nothing to check for the offline BPE, trained to the model's vocabulary)."""
    name = data.get("tokenizer")
    if not name or data.get("name") == "synthetic":
        return
    family = str(data.get("family", "gpt2"))
    tokenizer = load_tokenizer(str(name), family, bool(data.get("offline", False)))
    check_vocab(tokenizer, int(data["vocab_size"]), str(name))
    if family == "bert":
        bert_ids(tokenizer, str(name))
