"""The ``I``/``W`` split of a stage's backward (:mod:`strategies.deferred_weights`): after ``I`` and
``W`` every gradient equals one plain backward of an unpatched copy (the independent reference), in
fp32 exactly and under bf16 autocast as autograd's own casts give it. Single process; the multi-process
tests (tests/strategies/runtime/test_modern_runtime.py, tests/strategies/runtime/test_runtime_features.py) run every split schedule
against a single-process step."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from pipeline_recipes.strategies.compute.deferred_weights import DeferringLinear, WeightGradientStore, defer_weight_gradients


def _model() -> nn.Module:
    torch.manual_seed(0)
    frozen = nn.Linear(12, 12)
    frozen.requires_grad_(False)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), Conv1D(12, 16), nn.Tanh(), frozen,
                         nn.Linear(12, 4, bias=False))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).sum()


def _split_and_reference(autocast: bool, backward_in_autocast: bool = False) -> tuple[nn.Module, nn.Module, list, list]:
    """Two micro-batches through a patched model (I, I, then W in the other order) and through an
    unpatched copy (plain backwards); returns both models and both lists of input gradients.
    ``backward_in_autocast``: the backwards run inside the autocast region too (as a pipeline step
    under Lightning's bf16 precision runs them)."""
    reference = _model()
    split = copy.deepcopy(reference)
    store = WeightGradientStore()
    assert defer_weight_gradients([split], store) == 4  # Linear, Conv1D, frozen Linear, Linear without bias
    xs = [torch.randn(3, 5, 8) for _ in range(2)]
    expected, got = [], []
    for x in xs:
        x = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(reference, x)
            if backward_in_autocast:
                loss.backward()
        if not backward_in_autocast:
            loss.backward()
        expected.append(x.grad)
    for key, x in enumerate(xs):
        x = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(split, x)
            if backward_in_autocast:
                with store.deferring(key):
                    loss.backward()
        if not backward_in_autocast:
            with store.deferring(key):
                loss.backward()
        got.append(x.grad)
        # I: the input gradient and the small gradients now, the linear layers' weight gradients later
        assert split[0].weight.grad is None and split[3].weight.grad is None and split[6].weight.grad is None
        assert split[0].bias.grad is not None and split[2].weight.grad is not None
    assert store.pending == [0, 1]
    store.run(1)
    store.run(0)
    assert store.pending == []
    return split, reference, got, expected


def test_input_then_weight_gradients_equal_one_backward_in_fp32() -> None:
    split, reference, got, expected = _split_and_reference(autocast=False)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for (name, p), q in zip(split.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert split[5].weight.grad is None  # frozen: no gradient, none deferred


@pytest.mark.parametrize("backward_in_autocast", [False, True])
def test_input_then_weight_gradients_equal_one_backward_under_bf16_autocast(backward_in_autocast: bool) -> None:
    split, reference, got, expected = _split_and_reference(autocast=True, backward_in_autocast=backward_in_autocast)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype == torch.float32
        torch.testing.assert_close(g, e)
    for (name, p), q in zip(split.named_parameters(), reference.parameters()):
        if q.grad is not None:
            assert p.grad.dtype == torch.float32, name  # cast back as autograd's cast node does
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_outside_an_input_gradient_pass_the_layers_compute_as_before() -> None:
    reference = _model()
    patched = copy.deepcopy(reference)
    defer_weight_gradients([patched], WeightGradientStore())
    x = torch.randn(2, 3, 8)
    _loss(reference, x).backward()
    _loss(patched, x).backward()  # a whole backward (B): nothing deferred
    for p, q in zip(patched.parameters(), reference.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    with torch.no_grad():  # evaluation: the layers' own forward, no autograd function
        torch.testing.assert_close(patched(x), reference(x), rtol=0, atol=0)
    assert type(patched[0]) is DeferringLinear and isinstance(patched[0], nn.Linear)
    assert repr(patched) == repr(reference)  # prints as the layers it replaced


def test_a_patched_model_pickles_and_computes_as_before() -> None:
    patched = _model()
    defer_weight_gradients([patched], WeightGradientStore())
    twin = pickle.loads(pickle.dumps(patched))  # torch.save(model) pickles the classes by name
    assert [type(m) for m in twin] == [type(m) for m in patched]
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(twin(x), patched(x), rtol=0, atol=0)


def test_under_autocast_the_forwards_keep_no_copy_of_the_weights() -> None:
    """Autocast casts a weight once per region for every forward (its cache); an unpatched layer saves
    that one cast, a patched one saves the weight itself and casts it again in its backward: no
    micro-batch in flight holds a copy of its own."""
    model = _model()
    defer_weight_gradients([model], WeightGradientStore())
    weights = {tuple(m.weight.shape): m.weight for m in model
               if isinstance(m, (nn.Linear, Conv1D)) and m.weight.requires_grad}  # frozen: autocast does not cache it
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        for _ in range(3):
            _loss(model, torch.randn(3, 5, 8))
    kept = [t for t in saved if tuple(t.shape) in weights]
    assert kept and all(t is weights[tuple(t.shape)] for t in kept)


def test_copies_and_repeated_patching_keep_their_own_store() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 1))
    first, second = WeightGradientStore(), WeightGradientStore()
    assert defer_weight_gradients([model], first) == 1  # the attention's out_proj is a Linear subclass: left alone
    assert type(model[1].out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert defer_weight_gradients([model], second) == 1  # patched again: the new store
    twin = copy.deepcopy(model)
    x = torch.randn(2, 4)
    with second.deferring("a"):
        model[0](x).sum().backward()
    assert model[0].weight.grad is None and twin[0].weight.grad is None
    twin[0](x).sum().backward()  # the copy computes with its own weight
    assert twin[0].weight.grad is not None and model[0].weight.grad is None
    second.run("a")
    torch.testing.assert_close(model[0].weight.grad, twin[0].weight.grad)


def test_the_store_rejects_an_input_gradient_twice_and_a_weight_gradient_without_one() -> None:
    store = WeightGradientStore()
    with store.deferring("mb0"):
        with pytest.raises(RuntimeError, match="already deferred"):
            with store.deferring("mb1"):
                pass
    with pytest.raises(RuntimeError, match="already deferred"):
        with store.deferring("mb0"):
            pass
    with pytest.raises(RuntimeError, match="W of mb1 before its I"):
        store.run("mb1")
    assert store.defer(lambda: None) is False  # not collecting: the caller computes now


def test_a_failed_input_gradient_pass_defers_nothing() -> None:
    store = WeightGradientStore()
    with pytest.raises(ValueError), store.deferring("mb0"):
        store.defer(lambda: None)
        raise ValueError("the backward failed")
    assert store.pending == []
    with store.deferring("mb0"):  # a retry of that I
        pass
    assert store.pending == ["mb0"]


def test_weight_gradients_accumulate_into_the_views_the_gradient_buckets_hand_out() -> None:
    """Gradient synchronisation makes every ``.grad`` a view of a flat bucket before the step
    (:mod:`strategies.grad_sync`): I and W add into those views and never replace them."""
    reference = _model()
    split = copy.deepcopy(reference)
    split[0].bias.requires_grad_(False)  # a trainable weight beside a frozen bias
    reference[0].bias.requires_grad_(False)
    store = WeightGradientStore()
    defer_weight_gradients([split], store)
    params = [p for p in split.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params))
    offsets = [sum(q.numel() for q in params[:i]) for i in range(len(params))]
    views = [flat[o: o + p.numel()].view_as(p) for o, p in zip(offsets, params)]
    for p, view in zip(params, views):
        p.grad = view
    for key in range(2):
        x = torch.randn(3, 5, 8)
        _loss(reference, x).backward()
        with store.deferring(key):
            _loss(split, x).backward()
        store.run(key)
    assert split[0].bias.grad is None
    for p, view, q in zip(params, views, [q for q in reference.parameters() if q.requires_grad]):
        assert p.grad is view  # still the bucket's view: the bucket holds the gradient
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat, torch.cat([q.grad.reshape(-1) for q in reference.parameters()
                                                if q.requires_grad]), rtol=1e-6, atol=1e-6)
