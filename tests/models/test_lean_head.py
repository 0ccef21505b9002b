"""The lean block and head of the model adapters: GPT-2's one-op tanh GELU, the causal mask built once
per stage forward (none under SDPA), and the LM loss computed a chunk of tokens at a time
(:mod:`models.lm_loss`). Every expected value comes from an independent source: ``transformers``' own
models (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``BertForPreTraining``), the
unchunked ``F.cross_entropy`` of the whole logits, or a plain backward of an unpatched copy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.masking_utils import create_causal_mask

from pipeline_recipes.models import build_model
from pipeline_recipes.models.lm_loss import linear_cross_entropy
from pipeline_recipes.recipe.check.settings import ConfigError, check_model
from pipeline_recipes.core.pipeline_model import run_layers, sequential_loss
from pipeline_recipes.strategies.runtime.stage import PipelineStage

VOCAB = 1000


def _lm_batch(batch: int = 4, seq: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, 5:9] = -100  # some ignored targets
    return {"input_ids": ids, "labels": labels}


def _bert_batch(batch: int = 4, seq: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = torch.full_like(ids, -100)
    masked = torch.rand(batch, seq, generator=g) < 0.3
    labels[masked] = ids[masked]
    attention = torch.ones_like(ids)
    attention[1, 24:] = 0
    return {"input_ids": ids, "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(batch, -1),
            "attention_mask": attention, "labels": labels,
            "next_sentence_label": torch.randint(0, 2, (batch,), generator=g)}


def _hf_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    hf = model.reference()
    if model.family == "bert":
        return hf(**batch).loss
    return hf(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.reference().named_parameters() if p.grad is not None}


# --- GELU ------------------------------------------------------------------------------------------------


def test_gpt2_block_uses_the_one_op_tanh_gelu_and_matches_gelu_new() -> None:
    model = build_model("gpt2-tiny", init_seed=0)
    assert model.config.activation_function == "gelu_pytorch_tanh"
    block = model.pipeline_layers()[1]
    reference = copy.deepcopy(block)
    reference.block.mlp.act = ACT2FN["gelu_new"]  # GPT-2's own config value: the tanh formula in Python
    assert type(block.block.mlp.act).__name__ != type(reference.block.mlp.act).__name__
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for layer in (block, reference):
        inp = x.clone().requires_grad_(True)
        out = layer(inp)
        out.pow(2).sum().backward()
        outs.append(out)
        grads.append([inp.grad, *(p.grad for p in layer.parameters())])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_an_explicit_activation_function_is_kept() -> None:
    assert build_model("gpt2-tiny", activation_function="gelu_new", device="meta").config.activation_function == \
        "gelu_new"


# --- masks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_causal_mask_is_built_once_per_stage_forward(preset: str, attn: str) -> None:
    model = build_model(preset, attn_implementation=attn, init_seed=0)
    layers = model.pipeline_layers()
    masks = layers[1].masks
    assert all(layer.masks is masks for layer in layers[1:-1])
    batch = _lm_batch()
    x = layers[0](batch["input_ids"])
    for step in range(2):  # two micro-batches of another length: one build each
        seq = 32 - 8 * step
        before = masks.builds
        run_layers(layers[1:-1], x[:, :seq], {k: v[:, :seq] for k, v in batch.items()})
        assert masks.builds == before + 1
    config = layers[1].block.attn.config if preset == "gpt2-tiny" else layers[1].layer.self_attn.config
    before = masks.builds
    mask = masks.get(create_causal_mask, config, x[:, :24], None, torch.arange(24).unsqueeze(0))  # the one used
    assert masks.builds == before
    if attn == "sdpa":
        assert mask is None  # the kernel's is_causal applies, as in HF's model under sdpa
    else:
        assert isinstance(mask, torch.Tensor)


def test_the_rotary_pair_is_computed_once_per_stage_forward() -> None:
    model = build_model("llama-tiny", init_seed=0)
    layers = model.pipeline_layers()
    calls = []
    layers[1].rotary_emb.register_forward_hook(lambda *args: calls.append(1))
    batch = _lm_batch()
    x = layers[0](batch["input_ids"])
    before = run_layers(layers[1:-1], x, batch)
    assert len(calls) == 1
    layers[1].rotary_emb.inv_freq.mul_(1.0)  # a changed buffer (its version) is seen
    again = run_layers(layers[1:-1], x, batch)
    assert len(calls) == 2
    torch.testing.assert_close(again, before, rtol=0, atol=0)
    with torch.no_grad():  # and equals the unsplit model's hidden states
        want = model.reference().model(input_ids=batch["input_ids"]).last_hidden_state
        torch.testing.assert_close(layers[-1].norm(run_layers(layers[1:-1], x, batch)), want)


# --- the chunked loss against transformers' models --------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 7, 4096])
@pytest.mark.parametrize("preset,overrides", [
    ("gpt2-tiny", {}),  # tied
    ("gpt2-tiny", {"tie_word_embeddings": False}),
    ("llama-tiny", {}),  # untied
    ("qwen2-tiny", {}),  # tied, q/k/v biases
    ("bert-tiny", {}),  # untied, decoder bias
    ("bert-tiny", {"tie_word_embeddings": True}),
])
def test_loss_and_gradients_equal_transformers(preset: str, overrides: dict, chunk: int | None) -> None:
    model = build_model(preset, init_seed=0, loss_chunk_tokens=chunk, **overrides)
    batch = _bert_batch() if model.family == "bert" else _lm_batch()
    want = _hf_loss(model, batch)
    want.backward()
    expected = _grads(model)
    model.reference().zero_grad(set_to_none=True)
    got = sequential_loss(model, batch)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grads = _grads(model)
    assert grads.keys() == expected.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_loss_terms_add_up_to_the_unchunked_terms(preset: str) -> None:
    chunked = build_model(preset, init_seed=0, loss_chunk_tokens=5)
    whole = build_model(preset, init_seed=0, loss_chunk_tokens=None)
    batch = _bert_batch() if chunked.family == "bert" else _lm_batch()
    a = chunked.loss_terms(run_layers(chunked.pipeline_layers(), batch["input_ids"], batch), batch)
    b = whole.loss_terms(run_layers(whole.pipeline_layers(), batch["input_ids"], batch), batch)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-5)
    out = run_layers(chunked.pipeline_layers(), batch["input_ids"], batch)
    logits = chunked.logits(out)
    logits = logits[0] if isinstance(logits, tuple) else logits
    want = run_layers(whole.pipeline_layers(), batch["input_ids"], batch)
    torch.testing.assert_close(logits, want[0] if isinstance(want, tuple) else want)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_chunked_loss_under_bf16_autocast_equals_the_whole_logits(preset: str) -> None:
    """Autocast: products on bf16 casts and the softmax in fp32, as for the whole logits."""
    results = []
    for chunk in (None, 16):
        model = build_model(preset, init_seed=0, loss_chunk_tokens=chunk)
        batch = _bert_batch() if model.family == "bert" else _lm_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sequential_loss(model, batch)
        loss.backward()
        assert loss.dtype == torch.float32
        results.append((loss.detach(), _grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=2e-3, atol=2e-3)
    for name, g in grads_a.items():
        assert grads_b[name].dtype == torch.float32
        torch.testing.assert_close(grads_b[name], g, rtol=5e-2, atol=2e-3, msg=name)


def test_linear_cross_entropy_equals_cross_entropy_of_the_whole_logits() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 13, 16, generator=g)
    weight, bias = torch.randn(101, 16, generator=g), torch.randn(101, generator=g)
    labels = torch.randint(0, 101, (3, 13), generator=g)
    labels[1, 2:6] = -100
    upstream = torch.randn(3, 13, generator=g)
    results = []
    for chunk in (None, 1, 5, 100):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        if chunk is None:  # the independent reference
            loss = F.cross_entropy(F.linear(*leaves).transpose(1, 2), labels, reduction="none")
        else:
            loss = linear_cross_entropy(*leaves, labels, chunk)
        (loss * upstream).sum().backward()
        assert loss.shape == labels.shape and bool((loss[1, 2:6] == 0).all())
        results.append((loss, *(t.grad for t in leaves)))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# --- memory: the whole logits are never kept -------------------------------------------------------------


def _saved_sizes(model, batch: dict[str, torch.Tensor]) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of every tensor autograd keeps for the backward of the loss (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[tuple[tuple[int, ...], int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved.append((tuple(t.shape), t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sequential_loss(model, batch)
    return saved


def test_the_whole_logits_are_never_saved_for_the_backward() -> None:
    vocab = 8192  # a vocabulary much wider than the model: the logits dominate the head's memory
    batch = {"input_ids": torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(0))}
    tokens = batch["input_ids"].numel()
    sizes = {}
    for chunk in (None, 32):
        model = build_model("gpt2-tiny", init_seed=0, vocab_size=vocab, loss_chunk_tokens=chunk)
        saved = _saved_sizes(model, batch)
        sizes[chunk] = sum(nbytes for _, nbytes in saved)
        wide = [shape for shape, _ in saved if vocab in shape]
        if chunk is None:  # the check sees the logits where they are kept
            assert any(torch.Size(shape).numel() >= tokens * vocab for shape in wide)
        else:
            assert wide == []
    logits_bytes = tokens * vocab * 4
    assert sizes[32] < sizes[None] - logits_bytes  # at least one fp32 copy of the logits less


def _allocation_peak(fn) -> tuple[object, int]:
    """``fn()``'s result and the peak of the bytes it allocated (torch's CPU memory profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = peak = 0
    for _, delta in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                           if e.name() == "[memory]"):
        live += delta
        peak = max(peak, live)
    return out, peak


def test_the_chunked_backward_allocates_less() -> None:
    """The backward's peak allocation, from torch's CPU memory profiler, of one micro-batch."""
    vocab = 8192
    batch = {"input_ids": torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0))}
    peaks = {}
    for chunk in (None, 32):
        model = build_model("gpt2-tiny", init_seed=0, vocab_size=vocab, loss_chunk_tokens=chunk)
        loss = sequential_loss(model, batch)
        peaks[chunk] = _allocation_peak(loss.backward)[1]
    logits_bytes = batch["input_ids"].numel() * vocab * 4
    assert peaks[None] >= logits_bytes  # the profiler sees the whole logits' gradient
    assert peaks[32] < peaks[None] - logits_bytes, peaks


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_transient_bytes_is_the_measured_peak_of_one_chunk(autocast: bool) -> None:
    """What the pre-flight adds for the chunked loss (``transient_bytes``) against the larger of the
    forward's and the backward's measured allocation peaks, less the backward's fp32 weight gradient and
    input gradient (counted elsewhere); one chunk's logits dominate (vocabulary 8192, 256 tokens a chunk)."""
    from pipeline_recipes.models.lm_loss import transient_bytes

    tokens, hidden, vocab, chunk = 512, 16, 8192, 256
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, forward = _allocation_peak(lambda: linear_cross_entropy(h, w, None, labels, chunk))
    _, backward = _allocation_peak(lambda: loss.sum().backward())
    backward -= (vocab + tokens) * hidden * 4
    predicted = transient_bytes(tokens, vocab, hidden, chunk, 2 if autocast else 4)
    assert abs(max(forward, backward) - predicted) <= 0.05 * predicted, (forward, backward, predicted)


# --- the runtime's stage: split backward, recomputation ---------------------------------------------------


@pytest.mark.parametrize("mode", ["split", "recompute"])
def test_the_last_stage_under_split_backward_and_recomputation(mode: str) -> None:
    """The last stage of gpt2-tiny (tied head) under ``I``/``W`` or recomputation equals a plain
    backward of an unpatched copy."""
    model = build_model("gpt2-tiny", init_seed=0, loss_chunk_tokens=7)
    reference = copy.deepcopy(model)
    stage = PipelineStage(1, 2, model.pipeline_layers()[3:], split_backward=mode == "split",
                          recompute=mode == "recompute")
    batches = [_lm_batch(seed=s) for s in range(2)]
    inputs = [run_layers(reference.pipeline_layers()[:3], b["input_ids"], b).detach() for b in batches]
    want_inputs = []
    for x, b in zip(inputs, batches):
        x = x.clone().requires_grad_(True)
        reference.pipeline_loss(run_layers(reference.pipeline_layers()[3:], x, b), b).backward()
        want_inputs.append(x.grad)
    loss = model.pipeline_loss
    for mb, (x, b) in enumerate(zip(inputs, batches)):
        stage.forward((0, mb, None), x, b, loss, train=True)
    got_inputs = []
    for mb, b in enumerate(batches):
        if mode == "split":
            got_inputs.append(stage.input_gradient((0, mb, None), None, b, loss))
        else:
            got_inputs.append(stage.backward((0, mb, None), None, b, loss))
    if mode == "split":
        for mb, b in enumerate(batches):
            stage.weight_gradient((0, mb, None), b, loss)
    for got, want in zip(got_inputs, want_inputs):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    layers, ref_layers = model.pipeline_layers()[3:], reference.pipeline_layers()[3:]
    for layer, ref in zip(layers, ref_layers):
        for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_loss_reads_the_stashed_weight_version() -> None:
    """Asynchronous schedules run a step's forwards on a stashed copy of the weights (weight stashing):
    the chunked loss reads the head's weight, so its gradient must reach that copy, not the live weight."""
    from pipeline_recipes.strategies.runtime.versions import WeightVersions

    model = build_model("gpt2-tiny", init_seed=0, loss_chunk_tokens=7, tie_word_embeddings=False)
    reference = copy.deepcopy(model)
    layers = model.pipeline_layers()[3:]
    versions = WeightVersions("pipedream_2bw", 2, {1: layers})
    versions.begin_step(0)
    stage = PipelineStage(1, 2, layers, versions=versions)
    batch = _lm_batch()
    x = run_layers(reference.pipeline_layers()[:3], batch["input_ids"], batch).detach()
    stage.forward((0, 0, None), x, batch, model.pipeline_loss, train=True)
    stage.backward((0, 0, None), None, batch, model.pipeline_loss)
    reference.pipeline_loss(run_layers(reference.pipeline_layers()[3:], x, batch), batch).backward()
    live = layers[-1].lm_head.weight
    assert live.grad is None
    copy_grad = versions.versions[1][0][id(live)].grad
    torch.testing.assert_close(copy_grad, reference.pipeline_layers()[-1].lm_head.weight.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_zero_bubble_pipelines_equal_the_unsplit_hf_models() -> None:
    """Two gloo ranks, split backwards (``I``/``W``) with the chunked loss on the last stage: GPT-2 with
    tied embeddings under ZB-H1 and BERT (padded, MLM + NSP) under ZB-H2 equal the unsplit HF models
    trained in one process, as tests/models/test_model_equivalence.py checks for the other schedules."""
    from distributed import run_world
    from test_model_equivalence import TOL, _pipeline_vs_hf

    cases = [{"model": "gpt2-tied", "schedule": "zb_h1", "W": 1, "D": 2, "N": 3},
             {"model": "bert-padded", "schedule": "zb_h2", "W": 1, "D": 2, "N": 2}]
    results = run_world(2, _pipeline_vs_hf, cases)
    for i, case in enumerate(cases):
        for rank_results in results:
            r = rank_results[i]
            assert r["losses"] == pytest.approx(r["ref_losses"], abs=TOL), case
            assert max(r["errs"].values()) < TOL, case


# --- configuration ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 1.5, "auto", True])
def test_a_bad_chunk_size_is_refused_before_launch(value: object) -> None:
    with pytest.raises(ConfigError, match="model.loss_chunk_tokens"):
        check_model({"loss_chunk_tokens": value}, {})
    with pytest.raises(ValueError, match="model.loss_chunk_tokens"):
        build_model("gpt2-tiny", loss_chunk_tokens=value, device="meta")


def test_good_chunk_sizes_pass() -> None:
    check_model({"loss_chunk_tokens": None}, {})
    check_model({"loss_chunk_tokens": 4096}, {})
