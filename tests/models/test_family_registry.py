"""A model family is one registry entry (``pipeline_recipes.models.families``) holding what the recipe, the planner
and the FLOP count need of it: a decoder whose forward is not Llama's is added as its adapter plus that entry
(``tests/support/toy_family.py``: Gemma 2, whose logits are soft-capped) and a size of it as one yaml.

Expected values come from the ``transformers`` model itself (loss, gradients, logits) and from the hand count of
Gemma 2's parameters with the PaLM / Megatron-LM formula ``6·N + 12·L·d·T`` (Megatron-LM §5.1 for a block's
``2·P·s + 4·s²·h`` forward FLOPs).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import toy_family
from pipeline_recipes.core.pipeline_model import run_layers, sequential_loss
from pipeline_recipes.models import FAMILIES, ModelFamily, build_model
from pipeline_recipes.models.families import data_format, transformer_shape
from pipeline_recipes.planner.derived_costs import layer_flops
from pipeline_recipes.recipe.report.flops import model_flops_per_token
from pipeline_recipes.recipe.check.settings import ConfigError, check_model, layers_key, num_layers

CONF = Path(__file__).resolve().parents[2] / "conf"
L, H, HEADS, KV, HEAD_DIM, FFN, VOCAB, T = 4, 32, 4, 2, 16, 48, 96, 16
GEMMA2 = {"_target_": toy_family.ENTRY.builder, "name": "gemma2-toy", "family": "gemma2", "seq_len": T,
          "attn_implementation": "eager", "loss_chunk_tokens": None, "init_seed": 0, "data_family": "gpt2",
          "num_hidden_layers": L, "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV,
          "head_dim": HEAD_DIM, "intermediate_size": FFN, "vocab_size": VOCAB, "max_position_embeddings": 64,
          "sliding_window": 6, "query_pre_attn_scalar": HEAD_DIM, "final_logit_softcapping": 0.1,
          "attn_logit_softcapping": 50.0}


@pytest.fixture
def gemma2(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Gemma 2 registered (the one entry) for the test; its config."""
    monkeypatch.setitem(FAMILIES, "gemma2", toy_family.ENTRY)
    return copy.deepcopy(GEMMA2)


def _ids(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


def test_its_pipeline_equals_the_transformers_model_loss_gradients_and_stages(gemma2: dict) -> None:
    model = build_model(gemma2)  # the registry's builder: the toy adapter
    assert isinstance(model, toy_family.Gemma2PipelineModel) and model.family == "gemma2"
    assert len(model.pipeline_layers()) == num_layers(gemma2) == L + 2
    twin = copy.deepcopy(model)
    ids = _ids()
    loss = sequential_loss(model, {"input_ids": ids})
    loss.backward()
    ref = twin.reference()(input_ids=ids, labels=ids).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-5)
    theirs = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-5, msg=name)
    stages = model.partition(2)
    assert [len(r) for r in stages] == [3, 3]  # embeddings + 2 blocks | 2 blocks + head
    hf = model.reference()
    with torch.no_grad():
        out = ids
        for stage in stages:
            out = run_layers([model.pipeline_layers()[i] for i in stage], out, {"input_ids": ids})
        logits = hf(input_ids=ids).logits
        uncapped = hf.lm_head(hf.model(input_ids=ids).last_hidden_state)
    torch.testing.assert_close(out, logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, uncapped, atol=1e-2)  # its own forward: the Llama adapter's head would differ


def test_its_layer_key_flop_shape_and_data_format_come_from_its_entry(gemma2: dict) -> None:
    assert layers_key(gemma2) == "model.num_hidden_layers"
    assert data_format("gemma2") == "gpt2"
    with pytest.raises(ValueError, match="data_family"):
        build_model(gemma2, data_family="bert", device="meta")
    with pytest.raises(ConfigError, match=r"model\.max_position_embeddings"):
        check_model({**gemma2, "seq_len": 65}, {})
    width = HEADS * HEAD_DIM  # head_dim given: the attention term uses the query heads' width, not hidden_size
    assert transformer_shape(gemma2) == (L, width)
    # matmul parameters by hand: q, k, v, o, the gated MLP and four RMSNorms per block, the final norm, and the
    # embedding tied to the head (counted once)
    block = H * HEADS * HEAD_DIM + 2 * H * KV * HEAD_DIM + HEADS * HEAD_DIM * H + 3 * H * FFN + 4 * H
    n = L * block + H + VOCAB * H
    assert model_flops_per_token(gemma2) == 6 * n + 12 * L * width * T
    model = build_model(gemma2, device="meta")
    params = model.layer_param_counts()
    costs = SimpleNamespace(layers=[SimpleNamespace(name=name, params=count)
                                    for name, count in zip(model.layer_names(), params)])
    s = float(T)
    expected = [0.0, *[2.0 * p * s + 4.0 * s * s * width for p in params[1:-1]], 2.0 * params[-1] * s]
    assert layer_flops(costs, gemma2) == expected


def test_its_size_is_one_yaml_composed_with_its_data(gemma2: dict, tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    conf = shutil.copytree(CONF, tmp_path / "conf")
    (conf / "model" / "gemma2-toy.yaml").write_text(yaml.safe_dump(gemma2))
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["model=gemma2-toy", "data=synthetic"])
    assert cfg.data.family == "gpt2" and num_layers(cfg.model) == L + 2
    model = instantiate(cfg.model, device="meta")
    assert isinstance(model, toy_family.Gemma2PipelineModel)


def test_a_familys_own_config_keys_are_read_from_its_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family whose configs spell their sizes otherwise: the layout's rules, the pre-launch check and the FLOP
    shape read its entry's keys (no other file names them)."""
    monkeypatch.setitem(FAMILIES, "toy", ModelFamily("toy.build", "ToyConfig", "ToyModel", layers_key="n_blocks",
                                                     width_key="d_hidden", positions_key="context"))
    cfg = {"family": "toy", "n_blocks": 3, "d_hidden": 24, "context": 8, "seq_len": 8,
           "num_hidden_layers": 99, "hidden_size": 99}  # another family's spellings: not this one's
    assert num_layers(cfg) == 3 + 2 and layers_key(cfg) == "model.n_blocks"
    assert transformer_shape(cfg) == (3, 24)
    with pytest.raises(ConfigError, match=r"model\.context"):
        check_model({**cfg, "seq_len": 9}, {})
    with pytest.raises(ConfigError, match=r"model\.n_blocks"):
        num_layers({"family": "toy", "num_hidden_layers": 4})
