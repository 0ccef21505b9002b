"""Real tokenizers and real ``datasets`` pipelines, offline: tokenizers saved to a temporary directory
(GPT-2-like and BERT-like special tokens at ids of their own), local text files, a ``save_to_disk``
dataset and the streaming path on local files; the node cache built once; the hub left alone unless
the user says so; the tokenizer checked against the model and carried to the export."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline_recipes.datamodules import build_source, load_text_dataset
from pipeline_recipes.datamodules.cache import prepared
from pipeline_recipes.datamodules.tokenizer import (TOKENIZER_FILES_KEY, check_tokenizer_config, hub_offline,
                                                    tokenizer_files)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_data import write_corpus  # noqa: E402

GPT2_LIKE = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
BERT_LIKE = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
             "mask_token": "[MASK]"}


def save_tokenizer(out: Path, corpus: Path, specials: dict[str, str], vocab: int = 300) -> Path:
    """A byte-level BPE trained with ``tokenizers``, its special tokens added AFTER the vocabulary (so
    their ids are not the offline BPE's 0..4), wrapped as ``PreTrainedTokenizerFast`` and saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus.read_text().splitlines(), trainer=trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    wrapped.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", docs=30)


def reference_blocks(text: str, tokenizer, seq_len: int) -> np.ndarray:
    """Independently of the library: paragraphs (runs of non-blank lines) tokenized whole, each ended
    by the tokenizer's EOS, concatenated and cut into blocks."""
    stream: list[int] = []
    for paragraph in text.split("\n\n"):
        lines = [line.strip() for line in paragraph.split("\n") if line.strip()]
        if lines:
            stream += tokenizer("\n".join(lines) + "\n", add_special_tokens=False)["input_ids"]
            stream.append(tokenizer.eos_token_id)
    n = len(stream) // seq_len
    return np.asarray(stream[:n * seq_len]).reshape(n, seq_len)


@pytest.mark.slow
def test_gpt2_blocks_with_a_saved_tokenizer(tmp_path: Path, corpus: Path) -> None:
    from transformers import AutoTokenizer

    tok_dir = save_tokenizer(tmp_path / "gpt2-like", corpus, GPT2_LIKE)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    eos = tokenizer.eos_token_id
    assert eos == len(tokenizer) - 1 != 0  # the tokenizer's own id, not the offline BPE's 0
    expected = reference_blocks(corpus.read_text(), tokenizer, 16)
    kw = dict(family="gpt2", seq_len=16, vocab_size=320, seed=0, data_files=str(corpus), tokenizer=str(tok_dir))
    one = build_source("text", cache_dir=str(tmp_path / "c1"), num_proc=1, **kw)
    two = build_source("text", cache_dir=str(tmp_path / "c2"), num_proc=2, **kw)  # two map processes, same blocks
    assert one.tokenizer.eos_token_id == eos and one.val is None
    for source in (one, two):
        got = np.stack([source.train[i]["input_ids"].numpy() for i in range(len(source.train))])
        np.testing.assert_array_equal(got, expected)
    batch = one.train.__getitems__([3, 0, 5])  # the DataLoader's batched fetch: one Arrow read
    np.testing.assert_array_equal(np.stack([item["input_ids"].numpy() for item in batch]), expected[[3, 0, 5]])
    assert (expected == eos).any()


def test_bert_pairs_use_the_tokenizers_special_ids(tmp_path: Path, corpus: Path) -> None:
    from transformers import AutoTokenizer

    tok_dir = save_tokenizer(tmp_path / "bert-like", corpus, BERT_LIKE)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    cls, sep, mask, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"))
    specials = {cls, sep, mask, pad, tokenizer.convert_tokens_to_ids("[UNK]")}
    assert min(specials) >= 250  # added after the vocabulary
    train = build_source("text", family="bert", seq_len=32, vocab_size=len(tokenizer), seed=0,
                         data_files=str(corpus), tokenizer=str(tok_dir), cache_dir=str(tmp_path / "cache")).train
    masked_inputs, random_inputs = [], []
    for i in range(len(train)):
        item = train[i]
        ids, labels, attention = item["input_ids"], item["labels"], item["attention_mask"]
        n = int(attention.sum())
        assert ids[0] == cls and ids[n - 1] == sep and int((ids[:n] == sep).sum()) == 2
        assert (ids[n:] == pad).all() and ids.max() < len(tokenizer)
        chosen = labels != -100
        assert chosen.any() and not any(int(t) in specials for t in labels[chosen])  # specials are never masked
        masked_inputs += ids[chosen].tolist()
        random_inputs += [int(t) for t, lab in zip(ids[chosen], labels[chosen]) if t not in (mask, lab)]
    assert 0.6 < masked_inputs.count(mask) / len(masked_inputs) < 0.95  # 80%: the tokenizer's [MASK]
    assert random_inputs and not specials & set(random_inputs)  # random replacements are ordinary tokens


def test_vocab_must_cover_the_tokenizer(tmp_path: Path, corpus: Path) -> None:
    tok_dir = save_tokenizer(tmp_path / "tok", corpus, GPT2_LIKE)
    n = len(json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]) + 1  # + <|endoftext|>
    with pytest.raises(ValueError, match=rf"has {n} tokens but model.vocab_size = 100.*set model.vocab_size={n}"):
        build_source("text", family="gpt2", seq_len=16, vocab_size=100, data_files=str(corpus), tokenizer=str(tok_dir),
                     cache_dir=str(tmp_path / "cache"))
    data = {"name": "text", "family": "gpt2", "vocab_size": 100, "tokenizer": str(tok_dir)}
    with pytest.raises(ValueError, match="model.vocab_size"):
        check_tokenizer_config(data)  # what train.py runs before any process starts
    check_tokenizer_config({**data, "vocab_size": n})
    with pytest.raises(ValueError, match="no pad_token, cls_token, sep_token, mask_token"):
        check_tokenizer_config({**data, "family": "bert", "vocab_size": n})
    with pytest.raises(ValueError, match="no pad_token, cls_token, sep_token, mask_token"):
        build_source("text", family="bert", seq_len=16, vocab_size=n, data_files=str(corpus), tokenizer=str(tok_dir),
                     cache_dir=str(tmp_path / "cache"))


def test_streaming_local_files_takes_the_first_rows(tmp_path: Path, corpus: Path) -> None:
    rows = corpus.read_text().split("\n")[:-1]
    streamed = load_text_dataset(data_files=str(corpus), streaming=True, max_rows=25, cache_dir=str(tmp_path / "c"))
    assert streamed["text"] == [r.rstrip("\n") for r in rows[:25]]
    kw = dict(family="gpt2", seq_len=8, vocab_size=300, seed=0, data_files=str(corpus), max_rows=60, val_split=None)
    full = build_source("wikitext2", streaming=False, cache_dir=str(tmp_path / "a"), **kw).train
    stream = build_source("wikitext2", streaming=True, cache_dir=str(tmp_path / "b"), **kw).train
    assert len(full) == len(stream) > 0
    assert all(torch.equal(full[i]["input_ids"], stream[i]["input_ids"]) for i in range(len(full)))


def test_a_dataset_saved_to_disk(tmp_path: Path, corpus: Path) -> None:
    import datasets

    docs = [" ".join(p.split("\n")[1:]) for p in corpus.read_text().split("\n\n") if p.strip()]
    splits = {"train": docs[:-4], "validation": docs[-4:]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"article": v}) for k, v in splits.items()}).save_to_disk(
        tmp_path / "ds")
    source = build_source("wikipedia", family="bert", seq_len=32, vocab_size=300, seed=0, path=str(tmp_path / "ds"),
                          hf_name=None, text_column="article", val_split="validation", streaming=False,
                          cache_dir=str(tmp_path / "cache"))
    assert len(source.train) > len(source.val) > 0
    assert source.train[0]["input_ids"][0] == source.tokenizer.cls_token_id == 2  # the offline BPE's [CLS]


def test_node_cache_is_built_once(tmp_path: Path) -> None:
    builds: list[int] = []

    def build(tmp: Path) -> None:
        builds.append(1)
        time.sleep(0.3)
        tmp.write_text("prepared")

    found: list[Path] = []
    ranks = [threading.Thread(target=lambda: found.append(prepared(tmp_path / "artefact", build, 30)))
             for _ in range(3)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=30)
    assert builds == [1] and len(found) == 3 and all(p.read_text() == "prepared" for p in found)

    from filelock import FileLock

    with FileLock(str(tmp_path / "other.lock")):  # another process is preparing it and does not finish
        with pytest.raises(TimeoutError, match="data.prepare_timeout_s"):
            prepared(tmp_path / "other", build, timeout_s=0.2)


def test_the_hub_is_offline_only_when_told(tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not hub_offline(False, environ={})
    assert hub_offline(True, environ={})
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        assert hub_offline(False, environ={var: "1"})
    # train.py and the recipe's processes leave the variables alone
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    code = ("import os, sys; sys.path.insert(0, '.'); import train, pipeline_recipes.recipe.worker.entry, pipeline_recipes.recipe.launch.main; "
            "print(sorted(k for k in os.environ if k.endswith('_OFFLINE')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT / "src")},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
    # a local tokenizer and local files need no network even when the hub is online
    import datasets.config
    import huggingface_hub.constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def no_network(self: socket.socket, address: object) -> None:
        raise AssertionError(f"network access to {address}")

    tok_dir = save_tokenizer(tmp_path / "tok", corpus, GPT2_LIKE)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    source = build_source("text", family="gpt2", seq_len=16, vocab_size=320, data_files=str(corpus),
                          tokenizer=str(tok_dir), cache_dir=str(tmp_path / "cache"))
    assert len(source.train) > 0 and os.environ.get("HF_HUB_OFFLINE") is None


def test_the_tokenizer_travels_to_the_export(tmp_path: Path, corpus: Path) -> None:
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "scripts"))
    import export_hf

    tokenizer = AutoTokenizer.from_pretrained(save_tokenizer(tmp_path / "tok", corpus, BERT_LIKE))
    state = {"PipelineDataModule": {TOKENIZER_FILES_KEY: tokenizer_files(tokenizer)}}  # as Lightning saves it
    export_hf.save_tokenizer(state, tmp_path / "hf")
    again = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The cat sat on a mat."
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"] and again.mask_token_id == tokenizer.mask_token_id
    assert export_hf.save_tokenizer({}, tmp_path / "none") == []  # synthetic data: no tokenizer


@pytest.mark.slow
def test_train_py_on_local_text_with_a_saved_tokenizer_then_export(tmp_path: Path, corpus: Path) -> None:
    """``train.py data=text data.tokenizer=<dir>`` on two ranks (the launcher prepares the node's cache
    before they start, both read it), a checkpoint, and ``export_hf.py``: the exported directory loads as a model and
    as the tokenizer it trained with. A model vocabulary below the tokenizer's stops before launch."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tok_dir = save_tokenizer(tmp_path / "tok", corpus, GPT2_LIKE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}
    common = [sys.executable, str(ROOT / "train.py"), "data=text", f"data.data_files={corpus}",
              f"data.tokenizer={tok_dir}", f"data.cache_dir={tmp_path / 'cache'}", "trainer=cpu", "logger=none",
              "preflight=false"]
    small = subprocess.run([*common, f"hydra.run.dir={tmp_path / 'small'}", "model.vocab_size=100"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert small.returncode == 2 and "set model.vocab_size=301" in small.stderr, small.stderr[-2000:]
    assert not (tmp_path / "small" / "logs").exists()  # no process started
    run = tmp_path / "run"
    done = subprocess.run([*common, f"hydra.run.dir={run}", "strategy=gpipe", "strategy.D=2", "trainer.devices=2",
                           "trainer.max_steps=2", "checkpoint.every_n_steps=2", "data.global_batch_size=4",
                           "model.seq_len=16"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert len(json.loads((run / "results.json").read_text())["loss_history"]) == 2
    assert "tokenizing" in done.stdout + done.stderr  # the launcher prepared the node's cache once
    assert not any("tokenizing" in (run / "logs" / f"rank{r}.log").read_text() for r in (0, 1))  # ranks read it
    sys.path.insert(0, str(ROOT / "scripts"))
    import export_hf

    export_hf.export(run / "checkpoints" / "step-000002.ckpt", tmp_path / "hf")  # the sharded checkpoint
    exported, original = AutoTokenizer.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(tok_dir)
    text = "The cat sat on a mat."
    assert exported(text)["input_ids"] == original(text)["input_ids"]
    assert exported.eos_token_id == original.eos_token_id == 300
    assert GPT2LMHeadModel.from_pretrained(tmp_path / "hf").config.vocab_size >= len(exported)
