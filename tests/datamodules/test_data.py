"""Data sources: synthetic determinism and formats, local text files with an offline BPE, the WikiText-2 and
Wikipedia loaders pointed at local files written here (nothing is fetched), DataLoaders and configs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml

from pipeline_recipes.datamodules import (CLS_ID, IGNORE_INDEX, MASK_ID, PAD_ID, SEP_ID, SOURCE_DEFAULTS,
                                          build_dataloaders, build_datasets, make_dataloader, split_documents)

CONF = Path(__file__).resolve().parents[2] / "conf" / "data"
WORDS = ("the cat dog sat on a mat and ran over hill while bird sang song of river stone tree under light "
         "pipeline model layer stage batch gradient loss token").split()


def write_corpus(path: Path, docs: int = 40, seed: int = 0) -> Path:
    """A wikitext-like file: headings, paragraphs of sentences, blank lines between documents."""
    rng = random.Random(seed)
    lines = []
    for d in range(docs):
        lines.append(f" = Article {d} = ")
        for _ in range(rng.randint(2, 5)):
            sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "."
                         for _ in range(rng.randint(1, 4))]
            lines.append(" ".join(sentences))
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def check_bert_item(item: dict, seq_len: int, vocab: int) -> None:
    assert set(item) == {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}
    ids, tt, am, lab = item["input_ids"], item["token_type_ids"], item["attention_mask"], item["labels"]
    assert all(t.shape == (seq_len,) and t.dtype == torch.long for t in (ids, tt, am, lab))
    assert item["next_sentence_label"].shape == () and int(item["next_sentence_label"]) in (0, 1)
    n = int(am.sum())
    assert am[:n].all() and not am[n:].any()  # padding only at the end
    assert (ids[n:] == PAD_ID).all() and (tt[n:] == 0).all() and (lab[n:] == IGNORE_INDEX).all()
    assert ids[0] == CLS_ID and ids[n - 1] == SEP_ID and int((ids[:n] == SEP_ID).sum()) == 2
    sep = int((ids == SEP_ID).nonzero()[0])
    assert (tt[:sep + 1] == 0).all() and (tt[sep + 1:n] == 1).all()
    masked = lab != IGNORE_INDEX
    assert masked.any() and (lab[masked] >= 5).all() and (lab[masked] < vocab).all()
    assert not masked[[0, sep, n - 1]].any()  # specials are never masked
    assert ids.max() < vocab and ids.min() >= 0


def test_synthetic_gpt2_deterministic() -> None:
    a, _ = build_datasets("synthetic", family="gpt2", seq_len=16, vocab_size=100, seed=3, num_samples=10)
    b, _ = build_datasets("synthetic", family="gpt2", seq_len=16, vocab_size=100, seed=3, num_samples=10)
    c, _ = build_datasets("synthetic", family="gpt2", seq_len=16, vocab_size=100, seed=4, num_samples=10)
    assert len(a) == 10 and set(a[0]) == {"input_ids"}
    assert a[0]["input_ids"].shape == (16,) and a[0]["input_ids"].dtype == torch.long
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in (9, 0, 5))  # order does not matter
    assert not torch.equal(a[0]["input_ids"], c[0]["input_ids"])
    assert not torch.equal(a[0]["input_ids"], a[1]["input_ids"])
    ids = torch.stack([a[i]["input_ids"] for i in range(10)])
    assert ids.min() >= 0 and ids.max() < 100
    with pytest.raises(IndexError):
        a[10]


def test_synthetic_bigram_is_learnable_structure() -> None:
    ds, _ = build_datasets("synthetic", family="gpt2", seq_len=64, vocab_size=500, seed=0, num_samples=20)
    follow = {}
    hits = total = 0
    for i in range(20):
        ids = ds[i]["input_ids"].tolist()
        for prev, nxt in zip(ids, ids[1:]):
            total += 1
            hits += follow.setdefault(prev, nxt) == nxt
    assert hits / total > 0.7  # mostly a fixed successor per token
    uniform, _ = build_datasets("synthetic", family="gpt2", seq_len=8, vocab_size=500, seed=0, num_samples=2,
                                structure="uniform")
    assert uniform[0]["input_ids"].shape == (8,)


def test_synthetic_bert_format_and_determinism() -> None:
    ds, val = build_datasets("synthetic", family="bert", seq_len=32, vocab_size=1000, seed=1, num_samples=64,
                             val_samples=8)
    items = [ds[i] for i in range(64)]
    for item in items:
        check_bert_item(item, 32, 1000)
    padded = sum(int(item["attention_mask"].sum()) < 32 for item in items)
    assert 10 < padded < 54  # pad_fraction 0.5
    nsp = sum(int(item["next_sentence_label"]) for item in items)
    assert 10 < nsp < 54
    masked = torch.stack([item["labels"] != IGNORE_INDEX for item in items])
    real = torch.stack([(item["attention_mask"] == 1) & (item["input_ids"] != CLS_ID) & (item["input_ids"] != SEP_ID)
                        for item in items])
    assert 0.10 < masked.sum() / (real | masked).sum() < 0.20  # 15% of the real tokens
    inputs_at_masked = torch.stack([item["input_ids"] for item in items])[masked]
    assert 0.6 < float((inputs_at_masked == MASK_ID).float().mean()) < 0.95  # 80% become [MASK]
    again, _ = build_datasets("synthetic", family="bert", seq_len=32, vocab_size=1000, seed=1, num_samples=64)
    assert all(torch.equal(again[5][k], items[5][k]) for k in items[5])
    assert len(val) == 8 and not torch.equal(val[0]["input_ids"], items[0]["input_ids"])


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_small_synthetic_set_is_generated_once_with_the_same_items(family: str, monkeypatch) -> None:
    """A set within ``MATERIALISED_BYTES`` is generated whole when built; its items, read one by one or a
    batch at once, equal those of the same set generated item by item (the cap at 0), and changing a read
    item leaves the set unchanged."""
    from pipeline_recipes.datamodules import synthetic

    kwargs = dict(family=family, seq_len=24, vocab_size=300, seed=7, num_samples=40, val_samples=6)
    whole, whole_val = build_datasets("synthetic", **kwargs)
    assert whole._items is not None and whole_val._items is not None
    monkeypatch.setattr(synthetic, "MATERIALISED_BYTES", 0)
    lazy, lazy_val = build_datasets("synthetic", **kwargs)
    assert lazy._items is None
    for a, b in ((whole, lazy), (whole_val, lazy_val)):
        assert len(a) == len(b)
        for i in range(len(a)):
            assert a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i])
    for batch in (whole.__getitems__([5, 0, 39, 5]), lazy.__getitems__([5, 0, 39, 5])):  # a DataLoader's batched read
        assert [set(item) for item in batch] == [set(lazy[0])] * 4
        assert all(torch.equal(item[k], lazy[i][k]) for item, i in zip(batch, (5, 0, 39, 5)) for k in item)
    item, batched = whole[3], whole.__getitems__([3])[0]
    item["input_ids"].fill_(0)
    batched["input_ids"].fill_(0)
    assert torch.equal(whole[3]["input_ids"], lazy[3]["input_ids"])
    with pytest.raises(IndexError):
        whole.__getitems__([0, 40])
    with pytest.raises(IndexError):
        whole[40]
    with pytest.raises(IndexError):
        whole[-1]


def test_dataloader_batches_shuffle_and_drop_last() -> None:
    train, _ = build_dataloaders("synthetic", family="bert", seq_len=16, vocab_size=200, global_batch_size=8,
                                 batch_size=4, seed=0, num_samples=10)
    batches = list(train)
    assert len(batches) == 2  # 10 samples, batches of 4, last one dropped
    assert batches[0]["input_ids"].shape == (4, 16) and batches[0]["next_sentence_label"].shape == (4,)
    assert train.drop_last and not isinstance(train.sampler, torch.utils.data.DistributedSampler)
    ds, _ = build_datasets("synthetic", family="gpt2", seq_len=4, vocab_size=50, seed=0, num_samples=32)
    order = lambda seed: torch.cat([b["input_ids"] for b in make_dataloader(ds, 8, shuffle=True, seed=seed)])
    assert torch.equal(order(1), order(1)) and not torch.equal(order(1), order(2))
    with pytest.raises(ValueError, match="fewer than one batch"):
        make_dataloader(ds, 64, shuffle=False)


def test_split_documents() -> None:
    rows = [" = Title = ", "First one. Second one! Third?", "", "", "Other doc line."]
    assert split_documents(rows, "lines") == [["= Title =", "First one.", "Second one!", "Third?"], ["Other doc line."]]
    assert split_documents(["A b. C d.\nE f.", "G."], "documents") == [["A b.", "C d.", "E f."], ["G."]]


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.slow
def test_text_file_offline_bpe(tmp_path: Path, family: str) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt")
    cache = tmp_path / "cache"
    kw = dict(family=family, seq_len=32, vocab_size=400, seed=0, data_files=str(corpus), cache_dir=str(cache))
    train, val = build_datasets("text", val_fraction=0.1, **kw)
    assert val is not None and len(train) > 5 and len(val) >= 1
    assert list(cache.glob("tokenizers/*.json"))
    assert list(cache.glob("blocks/gpt2-*" if family == "gpt2" else "tokens/bert-*.npz"))  # the node's shared cache
    item = train[0]
    if family == "gpt2":
        assert set(item) == {"input_ids"} and item["input_ids"].shape == (32,)
        assert item["input_ids"].max() < 400
    else:
        for i in range(len(train)):
            check_bert_item(train[i], 32, 400)
        labels = [int(train[i]["next_sentence_label"]) for i in range(len(train))]
        assert 0 < sum(labels) < len(labels)  # both actual-next and random-next pairs
    again, _ = build_datasets("text", val_fraction=0.1, **kw)  # from the cache
    assert all(torch.equal(again[0][k], item[k]) for k in item)
    capped, none = build_datasets("text", num_samples=3, **kw)
    assert len(capped) == 3 and none is None


def test_text_requires_files() -> None:
    with pytest.raises(ValueError, match="data_files"):
        build_datasets("text", family="gpt2", seq_len=8, vocab_size=300)
    with pytest.raises(TypeError, match="unknown option"):
        build_datasets("synthetic", family="gpt2", seq_len=8, vocab_size=300, data_files="x.txt")
    with pytest.raises(ValueError, match="family"):
        build_datasets("synthetic", family="t5", seq_len=8, vocab_size=300)


def _parquet(path: Path, rows: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": rows}), path)
    return path


def test_wikitext2_from_local_parquet(tmp_path: Path) -> None:
    text = write_corpus(tmp_path / "raw.txt").read_text().split("\n")
    rows = [line + "\n" if line else "" for line in text]  # wikitext rows keep their line breaks
    train_file = _parquet(tmp_path / "train.parquet", rows[: len(rows) * 3 // 4])
    val_file = _parquet(tmp_path / "validation.parquet", rows[len(rows) * 3 // 4:])
    train, val = build_datasets("wikitext2", family="gpt2", seq_len=16, vocab_size=300, seed=0,
                                data_files={"train": str(train_file), "validation": str(val_file)},
                                cache_dir=str(tmp_path / "cache"))
    assert len(train) > 10 and val is not None and len(val) >= 1
    assert train[0]["input_ids"].shape == (16,) and val[0]["input_ids"].max() < 300
    loader, val_loader = build_dataloaders("wikitext2", family="gpt2", seq_len=16, vocab_size=300, global_batch_size=4,
                                           data_files=str(train_file), val_split=None,
                                           cache_dir=str(tmp_path / "cache"))
    assert next(iter(loader))["input_ids"].shape == (4, 16) and val_loader is None


def test_wikipedia_documents_from_local_parquet(tmp_path: Path) -> None:
    docs = ["\n".join(p for p in write_corpus(tmp_path / f"d{i}.txt", docs=1, seed=i).read_text().split("\n")[1:] if p)
            for i in range(12)]
    data = _parquet(tmp_path / "wiki.parquet", docs)
    train, val = build_datasets("wikipedia", family="bert", seq_len=48, vocab_size=350, seed=0, data_files=str(data),
                                cache_dir=str(tmp_path / "cache"), max_rows=10)
    assert val is None and len(train) >= 10
    for i in range(len(train)):
        check_bert_item(train[i], 48, 350)


def test_yaml_configs() -> None:
    files = {p.stem: yaml.safe_load(p.read_text()) for p in CONF.glob("*.yaml")}
    assert set(files) == {"synthetic", "text", "wikitext2", "wikipedia"}
    for name, cfg in files.items():
        assert cfg["_target_"] == "pipeline_recipes.datamodules.build_datamodule" and cfg["name"] == name
        for key in ("global_batch_size", "seed", "num_samples", "family", "seq_len", "vocab_size"):
            assert key in cfg, (name, key)
        mandatory = {k for k, v in cfg.items() if v == "???"}  # e.g. text's data_files
        assert {k: cfg[k] for k in set(SOURCE_DEFAULTS[name]) - mandatory} == {
            k: v for k, v in SOURCE_DEFAULTS[name].items() if k not in mandatory}, name


@pytest.mark.slow
def test_lightning_datamodule_from_hydra_config() -> None:
    """Hydra instantiation of conf/data/synthetic.yaml with conf/model/gpt2-tiny.yaml (imports Lightning)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"model": OmegaConf.load(CONF.parent / "model" / "bert-tiny.yaml"),
                            "data": OmegaConf.load(CONF / "synthetic.yaml")})
    cfg.data.num_samples = 64
    OmegaConf.resolve(cfg)
    assert cfg.data.family == "bert" and cfg.data.seq_len == 32 and cfg.data.global_batch_size == 32
    dm = instantiate(cfg.data, batch_size=cfg.data.global_batch_size // 4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (8, 32) and dm.val_dataloader() == []
    with pytest.raises(Exception, match="multiple"):  # Hydra wraps the ValueError
        instantiate(cfg.data, batch_size=5)
