"""Memory costs of a model without running it: parameter counts and the bytes autograd would keep.

For the pre-flight check (:func:`pipeline_recipes.planner.preflight.preflight`) there is no time to profile, so the
model is built on the meta device and given fake tensors (``FakeTensorMode``: no memory is allocated
and nothing is initialised, even for the paper's 1.39 B GPT-2), and every layer runs forward on fake
tensors at two micro-batch sizes, counting the distinct non-parameter tensors saved for backward
exactly as :class:`pipeline_recipes.strategies.runtime.recompute.SavedBytes` does on a real device: CAPTURE's M_i (a layer
alone, output included) and M_a (what it adds after the previous layer), fitted with a line in ``B``
(CAPTURE §III-A2). The backward transient, which fake tensors cannot show, is estimated as the
layer's largest parameter (a freshly computed weight gradient before accumulation) plus twice its
largest saved tensor (gradients of the same shape), and on the head the chunked LM loss's one chunk of
logits (:mod:`pipeline_recipes.models.lm_loss`). Identical blocks (same class, parameter shapes
and input shape after an identical block) run once.

The forward runs under the run's precision: ``bf16-mixed``/``16-mixed`` inside ``torch.autocast``
with that dtype, so the saved tensors have the dtypes the run keeps ("Mixed Precision Training",
Micikevicius et al., §3: matrix products on half-precision casts, reductions and norms in fp32).
Autocast caches one half-precision copy of each weight per autocast region, referenced by every
graph until its backward: those bytes are counted once per layer (``LayerCosts.cast_bytes``), not
per micro-batch. Fake CUDA tensors cannot run on a machine without CUDA, so a CUDA prediction runs
on fake CPU tensors under CPU autocast, with :func:`_cuda_kernels` putting in place what differs on
CUDA: CUDA autocast's fp32 ops (``pow``, ``softmax``, ``layer_norm``, ... the list of ATen's
``autocast_mode.h``), its fused dropout (a one-byte mask instead of a mask of the input's dtype) and
the fused attention kernels (FlashAttention, Dao et al., §3.1: the output and the log-sum-exp are
kept, not the attention matrix; the memory-efficient kernel where there is a mask).
Times are left at zero: this is a memory estimate only. :func:`with_run_memory` puts its memory fields
into a profile measured without autocast (the planner's), for a mixed-precision run.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from typing_extensions import override

from pipeline_recipes.models import build_model
from pipeline_recipes.models.materialize import allocate_empty
from pipeline_recipes.core.pipeline_model import run_layers

from .costs import fit_line
from .model_costs import LayerCosts, ModelCosts
from .profile import make_batch, model_config_dict

AUTOCAST_DTYPES = {"bf16-mixed": "bfloat16", "bf16": "bfloat16", "16-mixed": "float16", "16": "float16"}
# CUDA autocast runs these in fp32 (ATen autocast_mode.h: AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE), by
# their Python names; CPU autocast leaves most of them in the input's dtype.
CUDA_FP32_OPS = frozenset((
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "rms_norm", "group_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum",
))


def autocast_dtype_name(precision: Any) -> str | None:
    """The autocast dtype of a Lightning ``trainer.precision`` (``None``: no autocast, fp32 layers;
    ``*-true`` half precisions are not modelled and predicted as fp32, which overestimates)."""
    return AUTOCAST_DTYPES.get(str(precision)) if precision is not None else None


def _cuda_kernels(dtype: Any) -> Any:
    """A ``TorchFunctionMode``: on fake CPU tensors under CPU autocast, the ops as CUDA runs them."""
    half = (torch.float16, torch.bfloat16)

    def to_fp32(x: Any) -> Any:
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in half else x

    def attention(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False) -> Any:
        if dtype is not None:
            q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
        if attn_mask is None and q.dtype in half and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                       scale=scale)[0]
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill(~attn_mask, float("-inf"))
        elif attn_mask is not None:
            attn_mask = attn_mask.to(q.dtype)
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, True, dropout_p, is_causal,
                                                                       scale=scale)[0]

    class CudaKernels(TorchFunctionMode):
        @override
        def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name == "scaled_dot_product_attention":
                return attention(*args, **kwargs)
            if func is F.dropout:
                x, p, training = _bind(args, kwargs, ("input", "p", "training"), (None, 0.5, True))
                if training and 0.0 < p < 1.0 and x.is_floating_point():
                    return torch.ops.aten.native_dropout(x, p, True)[0]  # CUDA's fused kernel: a bool mask
            elif name in CUDA_FP32_OPS and dtype is not None and torch.is_autocast_enabled("cpu"):
                args, kwargs = tree_map(to_fp32, tuple(args)), tree_map(to_fp32, kwargs)
            return func(*args, **kwargs)

    return CudaKernels()


def _bind(args: Sequence[Any], kwargs: Mapping[str, Any], names: Sequence[str], defaults: Sequence[Any]) -> list[Any]:
    return [args[i] if i < len(args) else kwargs.get(n, d) for i, (n, d) in enumerate(zip(names, defaults))]


class _FakeSaved:
    """Distinct saved storages (by identity), parameters excluded; largest one remembered. Autocast's
    cached casts of the parameters are kept apart (``casts``): one per region, not per micro-batch."""

    def __init__(self, skip: frozenset[int]) -> None:
        self.skip = skip
        self.seen: dict[int, int] = {}
        self.casts: dict[int, int] = {}

    def pack(self, t: Any) -> Any:
        self.add(t)
        return t

    def add(self, t: Any) -> None:
        key = t.untyped_storage()._cdata
        if key in self.skip:
            return
        nbytes = int(t.untyped_storage().nbytes())
        if self._is_weight_cast(t):
            self.casts[key] = nbytes
        else:
            self.seen[key] = max(self.seen.get(key, 0), nbytes)

    def _is_weight_cast(self, t: Any) -> bool:
        fn = (t._base if t._base is not None else t).grad_fn  # a product may keep a view of it (w.t())
        if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
            return False
        source = getattr(fn.next_functions[0][0], "variable", None)  # AccumulateGrad: a leaf
        return source is not None and source.untyped_storage()._cdata in self.skip

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())

    @property
    def largest(self) -> int:
        return max(self.seen.values(), default=0)


def _run(model: Any, first: int, last: int, x: Any, batch: Mapping[str, Any], skip: frozenset[int],
         autocast: Any) -> tuple[Any, _FakeSaved]:
    layers = model.pipeline_layers()
    inp = x.detach().requires_grad_(True) if first > 0 else x
    saved = _FakeSaved(skip)
    with autocast(), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        out = run_layers(layers[first : last + 1], inp, batch)
        if last == len(layers) - 1:
            out = model.pipeline_loss(out, batch)
    saved.add(out)
    return out, saved


def _signature(layer: Any) -> tuple:
    return (type(layer).__name__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()))


def estimate_costs(model_cfg: Any, batch_sizes: Sequence[int] = (1, 2), *, precision: Any = None,
                   device: str = "cpu") -> ModelCosts:
    """Per-layer parameter bytes and activation bytes of the model, from a fake-tensor pass (cached),
    under the Lightning ``precision`` (``bf16-mixed``, ``16-mixed``; ``None``/``32-true``: fp32) as it
    runs on ``device`` (``cpu`` or ``cuda``; CUDA is emulated on fake CPU tensors, no GPU needed)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"estimate_costs predicts for device 'cpu' or 'cuda', not {device!r}")
    cfg = model_config_dict(model_cfg)
    cfg.pop("_target_", None)
    return _estimate(json.dumps(cfg, sort_keys=True, default=str), tuple(sorted(set(batch_sizes))),
                     autocast_dtype_name(precision), device)


def with_run_memory(costs: ModelCosts, model_cfg: Any, *, precision: Any, device: str) -> ModelCosts:
    """Profiled ``costs`` (measured without autocast) with their memory fields (kept and transient
    bytes, messages, autocast's weight copies) taken from the fake-tensor estimate under the run's
    ``precision`` on ``device``: the planner's memory prediction for a ``bf16-mixed`` run. Unchanged
    for an fp32 run, whose profile measured it."""
    if autocast_dtype_name(precision) is None:
        return costs
    est = estimate_costs(model_cfg, costs.batch_sizes or (1, 2), precision=precision, device=device)
    if len(est.layers) != len(costs.layers):
        raise ValueError(f"the estimate of {est.model} has {len(est.layers)} layers, the profile {len(costs.layers)}")
    layers = tuple(replace(mine, stored_alone=e.stored_alone, stored_added=e.stored_added, transient=e.transient,
                           out_bytes=e.out_bytes, cast_bytes=e.cast_bytes) for mine, e in zip(costs.layers, est.layers))
    return replace(costs, layers=layers, meta={**costs.meta, "autocast": est.meta.get("autocast")})


@lru_cache(maxsize=16)
def _loss_transient(model: Any, size: int, dtype: Any) -> int:
    """The chunked LM loss's backward peak (:meth:`~pipeline_recipes.models.base.HFPipelineModel.loss_transient_bytes`):
    one chunk's logits exist only there, so the saved tensors do not show them."""
    if not hasattr(model, "loss_transient_bytes"):
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size() if dtype is not None else 4
    return int(model.loss_transient_bytes(size, itemsize))


@lru_cache(maxsize=16)
def _estimate(cfg_json: str, sizes: tuple[int, ...], dtype_name: str | None, device: str) -> ModelCosts:
    cfg = json.loads(cfg_json)
    dtype = getattr(torch, dtype_name) if dtype_name else None

    def autocast() -> Any:  # one autocast region per run, as one per training step
        stack = contextlib.ExitStack()
        if dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=dtype))
        if device == "cuda":
            stack.enter_context(_cuda_kernels(dtype))
        return stack

    rows: list[list[dict[str, float]]] = []
    model = build_model({**cfg, "init_seed": 0}, device="meta")  # shapes only: no memory, no init work
    with FakeTensorMode(allow_non_fake_inputs=True), torch.random.fork_rng(devices=[]):
        allocate_empty(model.pipeline_layers(), "cpu")  # fake tensors where the meta ones were
        model.train()
        layers = model.pipeline_layers()
        skip = frozenset(p.untyped_storage()._cdata for p in model.parameters())
        signature = [_signature(layer) for layer in layers]
        for size in sizes:
            batch = make_batch(model, size)
            x = model.pipeline_input(batch)
            prev = None
            per_layer: list[dict[str, float]] = []
            seen: dict[tuple, tuple[dict[str, float], Any]] = {}  # identical blocks run once
            for i in range(len(layers)):
                last = i == len(layers) - 1
                key = (signature[i - 1] if i else None, signature[i], tuple(x.shape), x.dtype, last)
                if key in seen:
                    row, out = seen[key]
                    per_layer.append(dict(row))
                    prev, x = x, torch.empty(out[0], dtype=out[1])
                    continue
                out, saved = _run(model, i, i, x, batch, skip, autocast)
                added = float(saved.nbytes)
                if prev is not None:
                    added = _run(model, i - 1, i, prev, batch, skip, autocast)[1].nbytes - per_layer[-1]["alone"]
                row = {"alone": float(saved.nbytes), "added": added, "largest": float(saved.largest),
                       "casts": float(sum(saved.casts.values())),
                       "out": 0.0 if last else float(out.numel() * out.element_size())}
                per_layer.append(row)
                if i and signature[i - 1] == signature[i]:
                    seen[key] = (row, (tuple(out.shape), out.dtype))
                prev, x = x, out.detach()
            rows.append(per_layer)
        names = model.layer_names()
        result = []
        for i, layer in enumerate(layers):
            params = {id(p): p for p in layer.parameters()}.values()
            numel = sum(p.numel() for p in params)
            nbytes = sum(p.numel() * p.element_size() for p in params)
            biggest = max((p.numel() * p.element_size() for p in params), default=0)

            def fit(key: str, i: int = i) -> Any:
                return fit_line(sizes, [r[i][key] for r in rows])

            loss = [_loss_transient(model, size, dtype) if i == len(layers) - 1 else 0 for size in sizes]
            transient = fit_line(sizes, [biggest + 2 * r[i]["largest"] + extra for r, extra in zip(rows, loss)])
            result.append(LayerCosts(names[i], int(numel), int(nbytes), stored_alone=fit("alone"),
                                     stored_added=fit("added"), transient=transient, out_bytes=fit("out"),
                                     cast_bytes=int(max(r[i]["casts"] for r in rows))))
        tied = []
        for group in model.tied_parameters():
            idx = sorted({i for i, _ in group})
            if len(idx) >= 2:
                p = layers[group[0][0]].get_parameter(group[0][1])
                tied.append((idx[0], idx[-1], int(p.numel() * p.element_size())))
        layer_costs = list(model.layer_costs("layers"))
    return ModelCosts(str(cfg.get("name", "model")), device, tuple(result), tuple(tied), kind="estimate",
                      batch_sizes=sizes, meta={"layer_costs": layer_costs, "autocast": dtype_name})
