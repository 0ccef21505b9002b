"""Decoder-only HF models (Llama, Qwen2, Mistral, Qwen3) as pipelines: the split model equals the unsplit
``transformers`` model (loss and every gradient, eager and sdpa, tied and untied, sliding windows,
padding), per-stage materialisation, pretrained weights read per layer from safetensors, FLOPs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from pipeline_recipes.models import build_model, decoder_families
from pipeline_recipes.core.pipeline_model import (call_layer, materialize_local, run_layers, sequential_loss,
                                                        split_batch)

SMALL = {"num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 48, "vocab_size": 96, "max_position_embeddings": 64, "seq_len": 16}
# (preset, overrides) of the families that exercise a feature of their own: Llama (GQA, untied), Qwen2 (q/k/v
# biases, tied), Mistral (sliding window 6 < 16 tokens, so its mask differs from a causal one), Qwen3 (q/k
# norms, explicit head_dim 16 != 32 / 4). Any other registered decoder family is built from SMALL alone.
FEATURES = {
    "llama": ("llama-tiny", {}),
    "qwen2": ("qwen2-tiny", {}),
    "mistral": ({"family": "mistral", "name": "mistral-small", "init_seed": None}, {"sliding_window": 6}),
    "qwen3": ({"family": "qwen3", "name": "qwen3-small", "init_seed": None}, {"head_dim": 16,
                                                                             "tie_word_embeddings": True}),
}


def make(family: str, **overrides):
    base, extra = FEATURES.get(family, ({"family": family, "name": f"{family}-small", "init_seed": None}, {}))
    return build_model(base, **{**SMALL, **extra, "init_seed": 0, **overrides})


def lm_batch(seed: int = 0, batch: int = 4, seq: int = 16, vocab: int = 96, labels: bool = False,
             padding: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {"input_ids": torch.randint(0, vocab, (batch, seq), generator=g)}
    if labels or padding:
        lab = out["input_ids"].clone()
        lab[:, :3] = -100
        out["labels"] = lab
    if padding:  # right padding: masked keys, ignored labels
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1, 10:] = 0
        mask[3, 5:] = 0
        out["attention_mask"] = mask
        out["labels"][mask == 0] = -100
    return out


def hf_loss(model, batch: dict) -> torch.Tensor:
    return model.reference()(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                             labels=batch.get("labels", batch["input_ids"])).loss


def assert_matches_reference(model, batch: dict) -> None:
    twin = copy.deepcopy(model)
    loss = sequential_loss(model, batch)
    loss.backward()
    ref = hf_loss(twin, batch)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-5)
    ours, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
    assert ours.keys() == theirs.keys()
    assert not [n for n, p in ours.items() if p.grad is None]
    for name, p in ours.items():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", decoder_families())
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_split_model_equals_hf(family: str, attn: str) -> None:
    model = make(family, attn_implementation=attn)
    assert model.family == family and model.config._attn_implementation == attn
    assert_matches_reference(model, lm_batch(labels=True))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_equal_hf(family: str, tied: bool) -> None:
    model = make(family, tie_word_embeddings=tied, attn_implementation="eager")
    assert bool(model.tied_parameters()) == tied
    assert_matches_reference(model, lm_batch())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_padding_mask_matches_hf(attn: str) -> None:
    model = make("llama", attn_implementation=attn)
    batch = lm_batch(padding=True)
    assert_matches_reference(model, batch)
    other = dict(batch, input_ids=batch["input_ids"].clone())
    other["input_ids"][1, 10:] = 7  # padded tokens must not move the real ones
    layers = model.pipeline_layers()[:-1]
    with torch.no_grad():
        a, b = run_layers(layers, batch["input_ids"], batch), run_layers(layers, other["input_ids"], other)
    torch.testing.assert_close(a[1, :10], b[1, :10])


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_eager_layers_are_causal(family: str) -> None:
    """A future token must not influence earlier positions (a bare decoder layer under eager would leak)."""
    model = make(family, attn_implementation="eager").eval()
    batch = lm_batch(batch=1)
    other = {"input_ids": batch["input_ids"].clone()}
    other["input_ids"][0, -1] = (other["input_ids"][0, -1] + 1) % 96
    with torch.no_grad():
        a = run_layers(model.pipeline_layers(), batch["input_ids"], batch)
        b = run_layers(model.pipeline_layers(), other["input_ids"], other)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_sliding_window_is_applied() -> None:
    """Mistral's window of 6: token 0 reaches position 5 through one layer but not position 6."""
    model = make("mistral", attn_implementation="eager", num_hidden_layers=1).eval()
    assert [layer.kind for layer in model.pipeline_layers()[1:-1]] == ["sliding_attention"]
    batch = lm_batch(batch=1)
    other = {"input_ids": batch["input_ids"].clone()}
    other["input_ids"][0, 0] = (other["input_ids"][0, 0] + 1) % 96
    layers = model.pipeline_layers()[:2]
    with torch.no_grad():
        a, b = run_layers(layers, batch["input_ids"], batch), run_layers(layers, other["input_ids"], other)
    assert not torch.allclose(a[0, 5], b[0, 5])
    torch.testing.assert_close(a[0, 6:], b[0, 6:])


def test_tied_gradient_is_sum_of_both_stages() -> None:
    model = make("qwen2")
    batch = lm_batch()
    ref = copy.deepcopy(model)
    sequential_loss(ref, batch).backward()
    layers = model.pipeline_layers()
    emb = copy.deepcopy(layers[0])  # "stage 0" holding its own copy of the tied weight
    loss = model.pipeline_loss(run_layers(layers[1:], call_layer(emb, batch["input_ids"], batch), batch), batch)
    loss.backward()
    torch.testing.assert_close(emb.embed_tokens.weight.grad + layers[-1].lm_head.weight.grad,
                               ref.pipeline_layers()[0].embed_tokens.weight.grad, rtol=1e-5, atol=1e-6)


def test_loss_terms_over_micro_batches_equal_the_batch_loss() -> None:
    model = make("llama")
    batch = lm_batch(batch=8, labels=True)
    batch["labels"][:3, :12] = -100  # uneven token counts per micro-batch
    whole = hf_loss(model, batch)
    parts = split_batch(batch, 4)
    totals = {"tokens": sum(float(model.loss_counts(mb)["tokens"]) for mb in parts)}
    assert float(model.loss_counts(batch)["tokens"]) == totals["tokens"]  # counts add up (the engine counts at once)
    layers = model.pipeline_layers()
    mixed = sum(model.loss_terms(run_layers(layers, mb["input_ids"], mb), mb)["tokens"] / totals["tokens"]
                for mb in parts)
    torch.testing.assert_close(mixed, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("llama", True)])
def test_stages_materialise_bit_identical_to_the_whole_build(family: str, tied: bool) -> None:
    full = make(family, tie_word_embeddings=tied, init_seed=5)
    whole = full.pipeline_layers()
    for s, stage in enumerate(full.partition(3)):
        rank = make(family, tie_word_embeddings=tied, init_seed=5, device="meta")
        materialize_local(rank, stage, torch.device("cpu"))
        layers = rank.pipeline_layers()
        real = {id(t) for t in (*rank.reference().parameters(), *rank.reference().buffers()) if not t.is_meta}
        local = {id(t) for i in stage for t in (*layers[i].parameters(), *layers[i].buffers())}
        assert real == local, f"stage {s}"
        for i in stage:
            ours = dict(layers[i].named_parameters(remove_duplicate=False)) | dict(layers[i].named_buffers())
            theirs = dict(whole[i].named_parameters(remove_duplicate=False)) | dict(whole[i].named_buffers())
            for key, t in ours.items():
                assert torch.equal(t, theirs[key]), f"stage {s} layer {i} {key}"


def test_initialisation_follows_transformers_rules() -> None:
    """Against ``transformers``' own init of the same config: norms are ones, the rotary frequencies equal,
    random matrices have HF's standard deviation."""
    from transformers import LlamaForCausalLM

    model = make("llama", init_seed=3)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(model.config)
    ours = dict(model.reference().named_parameters())
    for key, theirs in hf.named_parameters():
        if theirs.std() == 0:
            assert torch.equal(ours[key], theirs), key
        else:
            assert abs(ours[key].std().item() / theirs.std().item() - 1) < 0.15, key
    torch.testing.assert_close(model.reference().model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)


def test_layer_names_costs_and_errors() -> None:
    model = make("llama", device="meta")
    assert model.layer_names() == ["embeddings", "layer.0", "layer.1", "layer.2", "layer.3", "head"]
    assert [len(s) for s in model.partition(4)] == [2, 1, 1, 2]
    with pytest.raises(ValueError, match="num_hidden_layer"):
        build_model("llama-tiny", num_hidden_layer=2)
    with pytest.raises(ValueError, match="max positions"):
        build_model("llama-tiny", seq_len=65, device="meta")
    with pytest.raises(ValueError, match="unknown model family 'gemma'"):
        build_model({"family": "gemma", "name": "g"}, device="meta")
    from pipeline_recipes.models import build_decoder

    with pytest.raises(ValueError, match="'gemma' is not supported by the decoder adapter; supported: llama"):
        build_decoder(family="gemma", device="meta")
    with pytest.raises(ValueError, match="data_family"):
        build_model("qwen2-tiny", data_family="bert", device="meta")


# --- pretrained weights ---------------------------------------------------------------------------


def _save_hf(tmp_path: Path, preset: str, shard: str | None = None, **overrides):
    """An independent ``transformers`` model of the preset's architecture, saved with ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    config = build_model(preset, device="meta", **overrides).config
    torch.manual_seed(42)
    hf = AutoModelForCausalLM.from_config(config)
    out = tmp_path / preset
    hf.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return hf, out


def test_pretrained_rank_reads_only_its_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf, path = _save_hf(tmp_path, "llama-tiny", shard="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 3  # several shards
    import safetensors

    opened, read = [], []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, file: str, **kw) -> None:
            opened.append(Path(file).name)
            self.inner = real_open(file, **kw)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key: str):
            read.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    model = build_model("llama-tiny", pretrained=str(path), device="meta")
    model.materialize([2, 3], "cpu")  # decoder layers 1 and 2
    wanted = {k for k in index if k.startswith(("model.layers.1.", "model.layers.2."))}
    assert set(read) == wanted
    assert set(opened) == {index[k] for k in wanted}
    theirs = dict(hf.named_parameters())
    for key, p in model.reference().named_parameters():
        if key in wanted:
            assert torch.equal(p, theirs[key]), key
        else:
            assert p.is_meta, key


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])
def test_pretrained_whole_model_equals_hf_logits(tmp_path: Path, preset: str) -> None:
    hf, path = _save_hf(tmp_path, preset)
    model = build_model(preset, pretrained=str(path))
    batch = lm_batch(vocab=1000, seq=32)
    with torch.no_grad():
        logits = model.logits(run_layers(model.pipeline_layers(), batch["input_ids"], batch))
        torch.testing.assert_close(logits, hf.eval()(input_ids=batch["input_ids"]).logits, rtol=1e-5, atol=1e-5)
    if preset == "qwen2-tiny":  # the head alone gets the embedding's tensor from the checkpoint
        head_only = build_model(preset, pretrained=str(path), device="meta")
        head_only.materialize([5], "cpu")
        assert torch.equal(head_only.pipeline_layers()[5].lm_head.weight, hf.lm_head.weight)


def test_pretrained_mismatch_is_refused(tmp_path: Path) -> None:
    _, path = _save_hf(tmp_path, "llama-tiny")
    with pytest.raises(ValueError, match=r"num_hidden_layers: model config 2, checkpoint 4.*model.num_hidden_layers=4"):
        build_model("llama-tiny", pretrained=str(path), num_hidden_layers=2, device="meta")
    with pytest.raises(ValueError, match="is a 'llama' model but model.family='qwen2'"):
        build_model("qwen2-tiny", pretrained=str(path), device="meta")
    with pytest.raises(ValueError, match="no transformers checkpoint"):
        build_model("llama-tiny", pretrained=str(tmp_path / "empty"), device="meta")
    dropout = build_model("llama-tiny", pretrained=str(path), attention_dropout=0.1, device="meta")
    assert dropout.config.attention_dropout == 0.1  # a training setting, not the architecture


def test_flops_count_three_mlp_matrices_and_grouped_query_attention() -> None:
    from pipeline_recipes.recipe.report.flops import model_flops_per_token
    from pipeline_recipes.models import hydra_config

    cfg = hydra_config("llama-tiny")
    L, d, heads, kv, ffn, V, T = 4, 64, 4, 2, 128, 1000, 32
    hd = d // heads
    per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * ffn  # q, k, v, o; gate, up, down
    matmul = L * per_layer + d * V  # untied head; the input embedding is a look-up; norms are not matmuls...
    norms = (2 * L + 1) * d  # ...but count as parameters of the model (matmul_parameters keeps them)
    assert model_flops_per_token(cfg) == 6 * (matmul + norms) + 12 * L * d * T
    big = hydra_config("llama3-1b")  # head_dim given: the attention term uses heads × head_dim
    assert model_flops_per_token({**big, "head_dim": 128}, seq_len=16) - model_flops_per_token(
        {**big, "head_dim": 64}, seq_len=16) == 6 * 16 * (2048 * 32 * 64 * 2 + 2048 * 8 * 64 * 2) + 12 * 16 * 2048 * 16


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])
def test_export_to_transformers(tmp_path: Path, preset: str) -> None:
    """``export_hf.py`` writes a ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` that ``from_pretrained`` loads
    with the trained weights (a tied head stays tied); a ``pretrained`` starting point is not re-read."""
    import importlib.util

    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    root = Path(__file__).resolve().parents[2]
    config = {**OmegaConf.to_container(OmegaConf.load(root / "conf" / "model" / f"{preset}.yaml")),
              "num_hidden_layers": 2}
    torch.manual_seed(0)
    model = instantiate(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # "trained"
    config["pretrained"] = str(tmp_path / "gone")  # the run started from a checkpoint no longer there
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "model_config": config},
               tmp_path / "run.ckpt")
    spec = importlib.util.spec_from_file_location("export_hf", root / "scripts" / "export_hf.py")
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    export.export(tmp_path / "run.ckpt", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded).__name__ == {"llama-tiny": "LlamaForCausalLM", "qwen2-tiny": "Qwen2ForCausalLM"}[preset]
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == config["tie_word_embeddings"]
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        assert torch.equal(model.eval().reference()(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_pretrained_bf16_checkpoint_loads_into_fp32_weights(tmp_path: Path) -> None:
    hf, _ = _save_hf(tmp_path, "llama-tiny")
    out = tmp_path / "bf16"
    hf.to(torch.bfloat16).save_pretrained(out)
    model = build_model("llama-tiny", pretrained=str(out), device="meta")
    model.materialize([0, 5], "cpu")
    assert model.pipeline_layers()[0].embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.pipeline_layers()[0].embed_tokens.weight, hf.model.embed_tokens.weight.float())
    assert torch.equal(model.pipeline_layers()[5].lm_head.weight, hf.lm_head.weight.float())


def test_planner_estimates_decoder_memory_with_the_tied_head() -> None:
    """The pre-flight's fake-tensor estimate runs the decoder layers (rotary embeddings, masks) and sees
    Qwen2's tied embedding; the paper-scale Llama is estimated without memory."""
    from pipeline_recipes.models import hydra_config
    from pipeline_recipes.planner.estimate import estimate_costs

    costs = estimate_costs(hydra_config("qwen2-tiny"))
    assert [layer.name for layer in costs.layers] == ["embeddings", *(f"layer.{i}" for i in range(4)), "head"]
    assert costs.tied == ((0, 5, 1000 * 64 * 4),)
    assert all(layer.stored_alone(4) > layer.stored_alone(1) > 0 for layer in costs.layers[1:])
    big = estimate_costs({**hydra_config("llama3-1b"), "seq_len": 128})
    assert sum(layer.params for layer in big.layers) == 1_235_814_400 + 128256 * 2048  # tied: in both layers


@pytest.mark.parametrize("name, published", [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)])
def test_llama3_presets_have_the_published_parameter_counts(name: str, published: int) -> None:
    """conf/model/llama3-8b.yaml and llama3-70b.yaml are Meta's shapes: their parameter counts are the published
    ones (the checkpoints' safetensors index: total bf16 bytes / 2), counted on the meta device."""
    from pipeline_recipes.models import hydra_config
    from pipeline_recipes.planner.estimate import estimate_costs

    costs = estimate_costs({**hydra_config(name), "seq_len": 16})
    assert costs.tied == () and sum(layer.params for layer in costs.layers) == published


def test_pretrained_hub_name_fetches_only_the_needed_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub name: the index, then only the shards holding this rank's tensors (the download is faked by
    a local directory, so no network is used)."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from pipeline_recipes.models.pretrained import load_layers

    hf, path = _save_hf(tmp_path, "llama-tiny", shard="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    fetched: list[str] = []

    def download(repo: str, filename: str, **kw) -> str:
        assert repo == "org/llama-tiny"
        if not (path / filename).exists():
            raise LocalEntryNotFoundError(filename)
        fetched.append(filename)
        return str(path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    model = build_model("llama-tiny", device="meta", init_seed=0)
    model.materialize([5], "cpu")  # the head: final norm and lm_head
    assert load_layers(model, [5], "org/llama-tiny") == 2
    assert fetched == ["model.safetensors.index.json", *sorted({index["model.norm.weight"], index["lm_head.weight"]})]
    assert torch.equal(model.pipeline_layers()[5].lm_head.weight, hf.lm_head.weight)
