"""Memory costs of a model without running it: parameter counts and the bytes autograd would keep.

For the pre-flight check (:func:`planner.preflight.preflight`) there is no time to profile, so the
model is built on the meta device and given fake tensors (``FakeTensorMode``: no memory is allocated
and nothing is initialised, even for the paper's 1.39 B GPT-2), and every layer runs forward on fake
tensors at two micro-batch sizes, counting the distinct non-parameter tensors saved for backward
exactly as :class:`strategies.recompute.SavedBytes` does on a real device: CAPTURE's M_i (a layer
alone, output included) and M_a (what it adds after the previous layer), fitted with a line in ``B``
(CAPTURE §III-A2). The backward transient, which fake tensors cannot show, is estimated as the
layer's largest parameter (a freshly computed weight gradient before accumulation) plus twice its
largest saved tensor (gradients of the same shape).
Times are left at zero: this is a memory estimate only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import json
from functools import lru_cache
from typing import Any

from .costs import fit_line
from .model_costs import LayerCosts, ModelCosts
from .profile import model_config_dict


class _FakeSaved:
    """Distinct saved storages (by identity), parameters excluded; largest one remembered."""

    def __init__(self, skip: frozenset[int]) -> None:
        self.skip = skip
        self.seen: dict[int, int] = {}

    def pack(self, t: Any) -> Any:
        self.add(t)
        return t

    def add(self, t: Any) -> None:
        key = t.untyped_storage()._cdata
        if key not in self.skip:
            self.seen[key] = max(self.seen.get(key, 0), int(t.untyped_storage().nbytes()))

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())

    @property
    def largest(self) -> int:
        return max(self.seen.values(), default=0)


def _run(model: Any, first: int, last: int, x: Any, batch: Mapping[str, Any], skip: frozenset[int]) -> tuple[Any, _FakeSaved]:
    import torch

    from pipeline_recipes.strategies.pipeline_model import run_layers

    layers = model.pipeline_layers()
    inp = x.detach().requires_grad_(True) if first > 0 else x
    saved = _FakeSaved(skip)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        out = run_layers(layers[first : last + 1], inp, batch)
        if last == len(layers) - 1:
            out = model.pipeline_loss(out, batch)
    saved.add(out)
    return out, saved


def _signature(layer: Any) -> tuple:
    return (type(layer).__name__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()))


def estimate_costs(model_cfg: Any, batch_sizes: Sequence[int] = (1, 2)) -> ModelCosts:
    """Per-layer parameter bytes and activation bytes of the model, from a fake-tensor pass (cached)."""
    cfg = model_config_dict(model_cfg)
    cfg.pop("_target_", None)
    return _estimate(json.dumps(cfg, sort_keys=True, default=str), tuple(sorted(set(batch_sizes))))


@lru_cache(maxsize=16)
def _estimate(cfg_json: str, sizes: tuple[int, ...]) -> ModelCosts:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipeline_recipes.models import build_model
    from pipeline_recipes.models.materialize import allocate_empty

    from .profile import make_batch

    cfg = json.loads(cfg_json)
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
                key = (signature[i - 1] if i else None, signature[i], tuple(x.shape), last)
                if key in seen:
                    row, out = seen[key]
                    per_layer.append(dict(row))
                    prev, x = x, torch.empty(out[0], dtype=out[1])
                    continue
                out, saved = _run(model, i, i, x, batch, skip)
                added = float(saved.nbytes)
                if prev is not None:
                    added = _run(model, i - 1, i, prev, batch, skip)[1].nbytes - per_layer[-1]["alone"]
                row = {"alone": float(saved.nbytes), "added": added, "largest": float(saved.largest),
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

            transient = fit_line(sizes, [biggest + 2 * r[i]["largest"] for r in rows])
            result.append(LayerCosts(names[i], int(numel), int(nbytes), stored_alone=fit("alone"),
                                     stored_added=fit("added"), transient=transient, out_bytes=fit("out")))
        tied = []
        for group in model.tied_parameters():
            idx = sorted({i for i, _ in group})
            if len(idx) >= 2:
                p = layers[group[0][0]].get_parameter(group[0][1])
                tied.append((idx[0], idx[-1], int(p.numel() * p.element_size())))
        layer_costs = list(model.layer_costs("layers"))
    return ModelCosts(str(cfg.get("name", "model")), "estimate", tuple(result), tuple(tied), kind="estimate",
                      batch_sizes=sizes, meta={"layer_costs": layer_costs})
