"""Memory pre-flight: refuse a layout whose predicted peak per rank cannot fit, before launching.

:func:`preflight` is cheap (no profiling, no process): it estimates the model's per-layer bytes on fake
tensors (:mod:`planner.estimate`), predicts each rank's peak for the configured layout
(:mod:`planner.memory`: weights, gradients, AdamW state, activations in flight under the schedule,
recomputation) and compares it with the device budget (free host RAM shared by the CPU ranks of a
node, or one GPU's memory per rank). When it does not fit it raises :class:`PreflightError` with the
numbers and the layouts of the same devices and global batch that would fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline_recipes.strategies.schedules import get_spec

from .costs import format_bytes
from .memory import Budget, device_budget, predict_memory
from .predict import Candidate, candidates

BASELINES = ("ddp", "single")


class PreflightError(ValueError):
    """The configured layout is predicted not to fit in memory (the message says by how much)."""


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def candidate_from_config(cfg: Mapping[str, Any], layout: Any) -> Candidate:
    """The :class:`Candidate` of a resolved config and its :class:`recipe.layout.Layout` (or a dict
    with ``strategy, W, D, B, N, pipelines``). Baselines are one stage: ``ddp``/``single`` = D 1, N 1."""
    strategy = dict(_get(cfg, "strategy", {}) or {})
    name = str(_get(layout, "strategy", strategy.get("name", "gpipe")))
    W, D, B, N = (int(_get(layout, k)) for k in ("W", "D", "B", "N"))
    if name in BASELINES:
        return Candidate("gpipe", W, 1, B, N, 1, "direct", "none", "end")
    concat = str(_get(layout, "concat", None) or strategy.get("concat") or "direct")  # the layout's is resolved
    return Candidate(name, W, D, B, N, int(_get(layout, "pipelines", 1) or 1),
                     concat if get_spec(name).concat else "direct",
                     str(strategy.get("recompute") or "none"), str(strategy.get("grad_sync") or "end"),
                     strategy.get("chunks"))


def preflight(cfg_dict: Mapping[str, Any], layout: Any, *, budget_bytes: int | None = None,
              budget: Budget | None = None, max_options: int = 5) -> None:
    """Raise :class:`PreflightError` if the layout's predicted peak memory per rank exceeds the device
    memory; return ``None`` otherwise.

    ``cfg_dict``: the resolved Hydra config (``OmegaConf.to_container(cfg, resolve=True)``);
    ``layout``: :func:`recipe.layout.resolve_layout`'s result. ``budget_bytes`` overrides the
    measured budget (per rank on GPU, per node on CPU); ``budget`` replaces it entirely.
    """
    from .estimate import estimate_costs

    trainer = dict(_get(cfg_dict, "trainer", {}) or {})
    accelerator = str(trainer.get("accelerator", "cpu"))
    costs = estimate_costs(_get(cfg_dict, "model"))
    cand = candidate_from_config(cfg_dict, layout)
    if budget is None:
        budget = device_budget(accelerator, override=budget_bytes)
    keep_sends = accelerator not in ("gpu", "cuda")
    per_node = int(trainer.get("devices", cand.world_size) or cand.world_size)
    per_node = min(per_node, cand.world_size)
    mem = predict_memory(costs, cand, keep_sends=keep_sends)
    short = budget.shortfall(mem.per_rank, per_node)
    if short <= 0:
        return None
    peaks = mem.per_rank
    worst = max(range(len(peaks)), key=lambda r: peaks[r])
    w = mem.workers[worst % cand.D]
    lines = [
        f"predicted memory does not fit: {cand.label()} W={cand.W} D={cand.D} B={cand.B} N={cand.N} of model "
        f"{costs.model} needs {format_bytes(budget.need(peaks, per_node))} against {budget.describe()} "
        f"(short by {format_bytes(short)}).",
        f"largest rank {worst}: {format_bytes(w.peak)} = {format_bytes(w.states)} weights+gradients+AdamW state "
        f"+ {format_bytes(w.activations)} activations and buffers; per rank: "
        + ", ".join(format_bytes(p) for p in peaks[: min(len(peaks), 8)]) + (" ..." if len(peaks) > 8 else ""),
    ]
    options = _fitting_options(costs, cand, budget, per_node, keep_sends, max_options)
    if options:
        lines.append("layouts of the same devices and global batch predicted to fit (Hydra overrides):")
        lines += [f"  {' '.join(c.overrides())}   # peak {format_bytes(peak)}/rank" for c, peak in options]
    else:
        lines.append(f"no layout of {cand.world_size} processes with global batch {cand.global_batch_size} is "
                     "predicted to fit: add devices, lower data.global_batch_size or use a smaller model.")
    raise PreflightError("\n".join(lines))


def _fitting_options(costs: Any, cand: Candidate, budget: Budget, per_node: int, keep_sends: bool,
                     limit: int) -> list[tuple[Candidate, int]]:
    """Fitting layouts, closest first: same schedule, then the largest B (fewest micro-batches)."""
    found = []
    for c in candidates(cand.world_size, cand.global_batch_size, costs.num_layers, grad_sync=cand.grad_sync):
        mem = predict_memory(costs, c, keep_sends=keep_sends)
        if budget.fits(mem.per_rank, per_node):
            found.append((c, mem.max_rank))
    found.sort(key=lambda x: (x[0].strategy != cand.strategy, x[0].recompute != "none", -x[0].B, x[1]))
    return found[:limit]
