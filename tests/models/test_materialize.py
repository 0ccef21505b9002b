"""Per-stage construction: a model built on the meta device, materialised stage by stage, equals the
model built whole with the same seed bit for bit, and each simulated rank holds real tensors for exactly
its stages (tied copies included). Single process, tiny models: a rank is simulated by a fresh meta build
that materialises one stage's layers, as ``PipelineEngine`` does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline_recipes.models import build_model
from pipeline_recipes.core.pipeline_model import materialize_local

SMALL = {"gpt2-tiny": {"n_layer": 6, "n_embd": 32, "n_head": 2, "vocab_size": 96, "seq_len": 16},
         "bert-tiny": {"num_hidden_layers": 6, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
                       "vocab_size": 96, "seq_len": 16}}


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, shared ones under each of their names."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def _real_ids(model) -> set[int]:
    ref = model.reference()
    return {id(t) for t in (*ref.parameters(), *ref.buffers()) if not t.is_meta}


def _stage_ids(model, stage: range) -> set[int]:
    layers = model.pipeline_layers()
    return {id(t) for i in stage for t in (*layers[i].parameters(), *layers[i].buffers())}


@pytest.mark.parametrize("name,tied", [("gpt2-tiny", True), ("gpt2-tiny", False), ("bert-tiny", True),
                                       ("bert-tiny", False)])
@pytest.mark.parametrize("stages", [4, 8])
def test_each_stage_materialises_exactly_its_layers_bit_identical(name: str, tied: bool, stages: int) -> None:
    kwargs = {**SMALL[name], "tie_word_embeddings": tied, "init_seed": 11}
    full = build_model(name, **kwargs)
    assert not any(t.is_meta for t in _tensors(full.reference()).values())
    partition = full.partition(stages)
    covered: set[str] = set()
    for s, stage in enumerate(partition):
        rank = build_model(name, device="meta", **kwargs)
        assert not _real_ids(rank)  # nothing allocated by the build
        materialize_local(rank, stage, torch.device("cpu"))
        assert _real_ids(rank) == _stage_ids(rank, stage), f"stage {s}: real tensors outside its layers, or missing"
        layers, whole = rank.pipeline_layers(), full.pipeline_layers()
        for i in stage:
            ours, theirs = _tensors(layers[i]), _tensors(whole[i])
            assert ours.keys() == theirs.keys()
            for key, t in ours.items():
                assert t.dtype == theirs[key].dtype and torch.equal(t, theirs[key]), f"stage {s} layer {i} {key}"
                covered.add(f"{i}.{key}")
        if tied and stages - 1 == s:  # the head's copy of the tied embedding, materialised without layer 0
            (group,) = rank.tied_parameters()
            (first, first_name), (last, last_name) = group
            assert layers[last].get_parameter(last_name) is layers[first].get_parameter(first_name)
            assert torch.equal(layers[last].get_parameter(last_name), whole[first].get_parameter(first_name))
    assert covered == {f"{i}.{k}" for i, layer in enumerate(full.pipeline_layers()) for k in _tensors(layer)}


def test_initialisation_follows_transformers_rules() -> None:
    """Against ``transformers``' own init of the same config (an independent build): deterministic
    tensors equal exactly, random ones have HF's standard deviations, BERT's padding row is zero."""
    from transformers import BertForPreTraining, GPT2LMHeadModel

    gpt2 = build_model("gpt2-tiny", init_seed=3)
    hf = GPT2LMHeadModel(gpt2.config)
    ours = dict(gpt2.reference().named_parameters())
    for key, theirs in hf.named_parameters():
        mine = ours[key]
        if theirs.std() == 0:  # LayerNorm weights (ones), biases (zeros)
            assert torch.equal(mine, theirs), key
        else:
            assert abs(mine.std().item() / theirs.std().item() - 1) < 0.1, key
    n_layer, init_range = gpt2.config.n_layer, gpt2.config.initializer_range
    assert abs(ours["transformer.h.0.attn.c_proj.weight"].std().item() * (2 * n_layer) ** 0.5 / init_range - 1) < 0.1
    assert not torch.equal(ours["transformer.h.0.attn.c_attn.weight"], ours["transformer.h.1.attn.c_attn.weight"])

    bert = build_model("bert-tiny", init_seed=3)
    reference = BertForPreTraining(bert.config)
    for key, buf in reference.named_buffers():
        assert torch.equal(dict(bert.reference().named_buffers())[key], buf), key
    emb = bert.reference().bert.embeddings.word_embeddings
    assert emb.padding_idx is not None and not emb.weight[emb.padding_idx].any()


def test_seed_picks_the_weights_and_the_global_stream_is_untouched() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    meta = build_model("gpt2-tiny", device="meta", init_seed=1)
    meta.materialize([1, 2], "cpu")
    assert torch.equal(torch.rand(3), expected)
    other = build_model("gpt2-tiny", init_seed=2)
    assert not torch.equal(meta.pipeline_layers()[1].block.attn.c_attn.weight,
                           other.pipeline_layers()[1].block.attn.c_attn.weight)
    # without init_seed the seed is drawn from the global generator: same global seed, same model
    torch.manual_seed(9)
    a = build_model("gpt2-tiny", device="meta")
    torch.manual_seed(9)
    b = build_model("gpt2-tiny")
    a.materialize(None, "cpu")
    for (key, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), key


def test_materialise_casts_to_the_declared_dtype_after_an_fp32_init() -> None:
    full = build_model("gpt2-tiny", init_seed=4)
    half = build_model("gpt2-tiny", device="meta", init_seed=4).to(torch.bfloat16)
    half.materialize([0, 1], "cpu")
    w = half.pipeline_layers()[1].block.attn.c_attn.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, full.pipeline_layers()[1].block.attn.c_attn.weight.to(torch.bfloat16))


def test_meta_model_without_materialize_is_refused() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2, device="meta"), nn.Linear(2, 2)])

        def pipeline_layers(self) -> nn.ModuleList:
            return self.layers

    materialize_local(Plain(), [1], torch.device("cpu"))  # real layers: nothing to do
    with pytest.raises(TypeError, match="meta device.*materialize"):
        materialize_local(Plain(), [0], torch.device("cpu"))
    with pytest.raises(ValueError, match="out of range"):
        build_model("gpt2-tiny", device="meta", init_seed=0).materialize([99], "cpu")
