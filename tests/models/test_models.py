"""GPT-2 and BERT pipeline models: paper parameter counts, equality with the unsplit HF models
(loss and every gradient, eager and sdpa, tied and untied), tied-parameter groups, configs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from pipeline_recipes.models import PAPER_PARAMS, build_model, hydra_config, model_names
from pipeline_recipes.core.pipeline_model import call_layer, run_layers, sequential_loss, split_batch

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"


@pytest.mark.parametrize("name", sorted(PAPER_PARAMS))
def test_paper_parameter_counts_on_meta(name: str) -> None:
    model = build_model(name, device="meta")
    assert model.num_parameters() == PAPER_PARAMS[name]
    # the reference HF model holds exactly the same tensors
    ref = model.reference()
    assert {id(p) for p in ref.parameters()} == {id(p) for p in model.parameters()}
    assert {id(b) for b in ref.buffers()} == {id(b) for b in model.buffers()}  # model.to() moves all of it
    assert all(p.is_meta for p in model.parameters())


def test_paper_configs_shapes() -> None:
    gpt2 = build_model("gpt2", device="meta")
    assert (gpt2.config.n_layer, gpt2.config.n_embd, gpt2.config.n_head, gpt2.seq_len) == (64, 1280, 20, 632)
    assert len(gpt2.pipeline_layers()) == 66 and gpt2.tied_parameters() == []
    bert = build_model("bert48", device="meta")
    assert (bert.config.num_hidden_layers, bert.config.hidden_size, bert.config.intermediate_size) == (48, 1024, 4096)
    assert len(bert.pipeline_layers()) == 50 and bert.seq_len == 128 and bert.tied_parameters() == []
    pred = bert.reference().cls.predictions
    assert pred.bias is pred.decoder.bias  # one output bias


def gpt2_batch(seed: int = 0, batch: int = 4, seq: int = 32, vocab: int = 1000, labels: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    out = {"input_ids": ids}
    if labels:
        lab = torch.randint(0, vocab, (batch, seq), generator=g)
        lab[:, :5] = -100
        out["labels"] = lab
    return out


def bert_batch(seed: int = 0, batch: int = 4, seq: int = 32, vocab: int = 1000) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    attention = torch.ones(batch, seq, dtype=torch.long)
    attention[1, 20:] = 0
    attention[3, 9:] = 0
    ids[attention == 0] = 0
    token_type = torch.zeros(batch, seq, dtype=torch.long)
    token_type[:, seq // 2:] = 1
    token_type[attention == 0] = 0
    labels = torch.full((batch, seq), -100)
    pick = (torch.rand(batch, seq, generator=g) < 0.3) & (attention == 1)
    pick[:, 1] = True
    labels[pick] = ids[pick]
    ids[pick] = 4
    nsp = torch.randint(0, 2, (batch,), generator=g)
    return {"input_ids": ids, "token_type_ids": token_type, "attention_mask": attention, "labels": labels,
            "next_sentence_label": nsp}


def hf_loss(model, batch: dict) -> torch.Tensor:
    ref = model.reference()
    if model.family == "gpt2":
        return ref(input_ids=batch["input_ids"], labels=batch.get("labels", batch["input_ids"])).loss
    return ref(**batch).loss


def assert_matches_reference(model, batch: dict) -> None:
    """Pipeline loss/grads on ``model`` equal the HF model's on a deep copy (same init)."""
    twin = copy.deepcopy(model)
    loss = sequential_loss(model, batch)
    loss.backward()
    ref_loss = hf_loss(twin, batch)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    ours = dict(model.named_parameters())
    theirs = dict(twin.named_parameters())
    assert ours.keys() == theirs.keys()
    missing = [n for n, p in ours.items() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    for name, p in ours.items():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("labels", [False, True])
def test_gpt2_tiny_equals_hf(attn: str, tied: bool, labels: bool) -> None:
    model = build_model("gpt2-tiny", attn_implementation=attn, tie_word_embeddings=tied, init_seed=0)
    assert model.config._attn_implementation == attn
    assert_matches_reference(model, gpt2_batch(labels=labels))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("tied", [False, True])
def test_bert_tiny_equals_hf_with_padding(attn: str, tied: bool) -> None:
    model = build_model("bert-tiny", attn_implementation=attn, tie_word_embeddings=tied, init_seed=0)
    assert model.config._attn_implementation == attn
    batch = bert_batch()
    assert (batch["attention_mask"] == 0).any()
    assert_matches_reference(model, batch)


def test_bert_padding_mask_is_applied() -> None:
    """Changing padded tokens must not change the real tokens' outputs (under both kernels)."""
    for attn in ("eager", "sdpa"):
        model = build_model("bert-tiny", attn_implementation=attn, init_seed=0).eval()
        batch = bert_batch()
        other = dict(batch, input_ids=batch["input_ids"].clone())
        other["input_ids"][1, 20:] = 7
        layers = model.pipeline_layers()[:-1]
        a = run_layers(layers, batch["input_ids"], batch)
        b = run_layers(layers, other["input_ids"], other)
        torch.testing.assert_close(a[1, :20], b[1, :20])


def test_gpt2_eager_block_is_causal() -> None:
    """A future token must not influence earlier positions (a bare GPT2Block under eager would leak)."""
    model = build_model("gpt2-tiny", attn_implementation="eager", init_seed=0).eval()
    batch = gpt2_batch(batch=1)
    other = {"input_ids": batch["input_ids"].clone()}
    other["input_ids"][0, -1] = (other["input_ids"][0, -1] + 1) % 1000
    a = run_layers(model.pipeline_layers(), batch["input_ids"], batch)
    b = run_layers(model.pipeline_layers(), other["input_ids"], other)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_eager_and_sdpa_agree() -> None:
    for name, batch in (("gpt2-tiny", gpt2_batch()), ("bert-tiny", bert_batch())):
        model = build_model(name, attn_implementation="eager", init_seed=0)
        eager = sequential_loss(model, batch)
        model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "sdpa"
        torch.testing.assert_close(sequential_loss(model, batch), eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_tied_parameter_groups(name: str) -> None:
    model = build_model(name, tie_word_embeddings=True, init_seed=0)
    layers = model.pipeline_layers()
    (group,) = model.tied_parameters()
    assert [i for i, _ in group] == [0, len(layers) - 1]
    params = [dict(layers[i].named_parameters(remove_duplicate=False))[n] for i, n in group]
    assert params[0] is params[1]
    untied = build_model(name, tie_word_embeddings=False, init_seed=0)
    assert untied.tied_parameters() == []


def test_tied_gradient_is_sum_of_both_uses() -> None:
    """What a runtime does when the two tied copies live on different stages: sum their gradients."""
    model = build_model("gpt2-tiny", init_seed=0)
    batch = gpt2_batch()
    ref = copy.deepcopy(model)
    sequential_loss(ref, batch).backward()
    layers = model.pipeline_layers()
    emb_copy = copy.deepcopy(layers[0])  # a "stage 0" holding its own copy of the tied weight
    x = call_layer(emb_copy, batch["input_ids"], batch)
    loss = model.pipeline_loss(run_layers(layers[1:], x, batch), batch)
    loss.backward()
    summed = emb_copy.wte.weight.grad + layers[-1].lm_head.weight.grad
    torch.testing.assert_close(summed, ref.pipeline_layers()[0].wte.weight.grad, rtol=1e-5, atol=1e-6)


def test_micro_batches_average_to_the_batch_loss() -> None:
    model = build_model("gpt2-tiny", init_seed=0)
    batch = gpt2_batch(batch=8)
    whole = sequential_loss(model, batch)
    parts = torch.stack([sequential_loss(model, mb) for mb in split_batch(batch, 4)]).mean()
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_loss_terms_over_micro_batches_equal_the_batch_loss(name: str) -> None:
    """The runtime's weighting: sum over micro-batches of loss_terms / total loss_counts == HF loss."""
    model = build_model(name, init_seed=0)
    batch = gpt2_batch(batch=8, labels=True) if name == "gpt2-tiny" else bert_batch(batch=8)
    if name == "gpt2-tiny":
        batch["labels"][:3, :20] = -100  # uneven token counts per micro-batch
    whole = hf_loss(model, batch)
    parts = split_batch(batch, 4)
    totals: dict[str, float] = {}
    for mb in parts:
        for k, v in model.loss_counts(mb).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    # counts add up over samples: the engine counts the replica's mini-batch at once (PipelineModel contract)
    assert {k: float(v) for k, v in model.loss_counts(batch).items()} == totals
    layers = model.pipeline_layers()
    mixed = sum(v / totals[k] for mb in parts
                for k, v in model.loss_terms(run_layers(layers, model.pipeline_input(mb), mb), mb).items())
    torch.testing.assert_close(mixed, whole, rtol=1e-5, atol=1e-6)


def test_init_seed_is_reproducible_and_private() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("gpt2-tiny", init_seed=7)
    assert torch.equal(torch.rand(1), before)  # the global RNG was not consumed
    b = build_model("gpt2-tiny", init_seed=7)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


def test_layer_costs_and_partition() -> None:
    model = build_model("gpt2-tiny", embedding_cost=0.5, head_cost=2.0, init_seed=0)
    assert model.layer_costs("layers") == [0.5, 1, 1, 1, 1, 2.0]
    params = model.layer_costs("params")
    assert params == [float(c) for c in model.layer_param_counts()]
    # a tied weight is counted in both layers that hold it
    assert sum(params) == model.num_parameters() + model.config.vocab_size * model.config.n_embd
    with pytest.raises(ValueError, match="cost kind"):
        model.layer_costs("flops")
    default = build_model("gpt2-tiny", init_seed=0)
    assert [len(s) for s in default.partition(4)] == [2, 1, 1, 2]
    table = default.partition_table(default.partition(2))
    assert "embeddings" in table and "head" in table and f"{sum(default.layer_param_counts()):,}" in table
    assert default.layer_names() == ["embeddings", "block.0", "block.1", "block.2", "block.3", "head"]


def test_build_model_from_mapping_and_errors() -> None:
    cfg = hydra_config("gpt2-tiny")
    model = build_model(cfg, n_layer=2)
    assert len(model.pipeline_layers()) == 4 and model.name == "gpt2-tiny"
    with pytest.raises(ValueError, match="n_layers"):
        build_model("gpt2-tiny", n_layers=2)
    with pytest.raises(ValueError, match="unknown model"):
        build_model("gpt3")
    with pytest.raises(ValueError, match="max positions"):
        build_model("gpt2-tiny", seq_len=65)


def test_presets_are_the_yaml_configs_of_registered_families() -> None:
    """A preset is its yaml, read as it is; each names a registered family, whose builder is its ``_target_``, whose
    data format its ``data_family`` (where it says one) and whose keys hold its blocks, width and positions."""
    from pipeline_recipes.models import FAMILIES

    files = {p.stem: yaml.safe_load(p.read_text()) for p in CONF.glob("*.yaml")}
    assert model_names() == sorted(files)
    for name, cfg in files.items():
        assert hydra_config(name) == cfg, name
        family = FAMILIES[cfg["family"]]
        assert cfg["_target_"] == family.builder, name
        assert cfg.get("data_family", cfg["family"]) == family.data_format, name
        assert all(isinstance(cfg[key], int) for key in (family.layers_key, family.width_key, family.positions_key))
    assert files["gpt2-tiny"]["tie_word_embeddings"] is True
    assert {"gpt2", "bert48", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-base", "bert-large",
            "gpt2-tiny", "bert-tiny", "llama3-1b", "llama-tiny", "qwen2-tiny"} <= set(files)
    cfg = hydra_config("llama3-1b")
    cfg["rope_parameters"]["factor"] = 1.0  # a copy: the next reader gets the file's
    assert hydra_config("llama3-1b")["rope_parameters"]["factor"] == 32.0


def test_hydra_instantiate_with_overrides() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONF.parent), version_base="1.3"):
        cfg = compose(config_name="model/bert-tiny", overrides=["model.num_hidden_layers=2",
                                                                "model.attn_implementation=eager"])
    model = instantiate(cfg.model)
    assert len(model.pipeline_layers()) == 4 and model.config._attn_implementation == "eager"
    assert build_model(cfg.model).num_parameters() == model.num_parameters()


def test_train_eval_reaches_reference() -> None:
    model = build_model("bert-tiny", init_seed=0)
    model.eval()
    assert not model.reference().training and not model.pipeline_layers()[1].layer.training
    model.train()
    assert model.reference().training


def test_each_registered_family_names_its_transformers_classes() -> None:
    """A family's key is the ``model_type`` of the ``transformers`` config class it names."""
    import transformers

    from pipeline_recipes.models import FAMILIES

    for name, spec in FAMILIES.items():
        assert getattr(transformers, spec.config_class).model_type == name
        assert getattr(transformers, spec.model_class).config_class is getattr(transformers, spec.config_class)


def test_a_model_size_is_one_yaml(tmp_path: Path) -> None:
    """A size is one yaml (here in a copy of ``conf/``): it composes as ``model=<name>`` and builds: the family's
    builder comes from its yaml's ``_target_``, the family from the registry."""
    import shutil

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    conf = shutil.copytree(CONF.parent, tmp_path / "conf")
    size = {**yaml.safe_load((CONF / "llama-tiny.yaml").read_text()), "name": "qwen3-mini", "family": "qwen3",
            "num_hidden_layers": 3, "head_dim": 16}
    (conf / "model" / "qwen3-mini.yaml").write_text(yaml.safe_dump(size))
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["model=qwen3-mini"])
    model = instantiate(cfg.model)
    assert "qwen3-mini" not in model_names()
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == 3
    assert len(model.pipeline_layers()) == 3 + 2  # embedding, blocks, head
