"""Memory pre-flight: refuse a layout whose predicted peak per rank cannot fit, before launching.

:func:`preflight` is cheap (no profiling, no process): it estimates the model's per-layer bytes on fake
tensors under the run's precision and for the run's device (:mod:`pipeline_recipes.planner.estimate`), predicts each
rank's peak for the configured layout (:mod:`pipeline_recipes.planner.memory`: weights, gradients, AdamW state,
autocast's weight copies, activations in flight under the schedule, recomputation) and compares it
with the device budget (free host RAM shared by the CPU ranks of a node, or one GPU's memory per
rank). When it does not fit it raises :class:`PreflightError` with the numbers and the layouts of the
same devices and global batch that would fit, as fixes (Hydra overrides; :mod:`pipeline_recipes.core.fixes`),
which the launcher checks against every other rule of the command. :func:`predict_layout` gives the prediction alone
(``preflight=report``), also for GPUs on a machine without any.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache, partial
from typing import Any

from pipeline_recipes.core.fixes import ConfigError, Fix, Proposal
from pipeline_recipes.core.layout import Layout
from pipeline_recipes.core.layout import BASELINES
from pipeline_recipes.core.node import GPU_NAMES
from pipeline_recipes.strategies.compute.cuda_graph_rules import cuda_graphs_error
from pipeline_recipes.strategies.schedules import DEFAULT_SCHEDULE, get_spec

from .costs import format_bytes
from .estimate import estimate_costs
from .memory import Budget, MemoryPrediction, device_budget, predict_memory
from .model_costs import ADAMW_STATES, ModelCosts
from .parallel import map_grouped, workers_for
from .predict import Candidate, candidates, runtime_partition

REPORT = "report"  # preflight=report: print the prediction as one JSON line, launch nothing


EAGER = {"strategy.cuda_graphs": "false"}  # the fix that drops the CUDA graphs' pools


class PreflightError(ConfigError):
    """The configured layout is predicted not to fit in memory (the message says by how much); its fixes are the
    layouts predicted to fit (``peaks``: the peak each is predicted at, by its overrides), rendered one a line."""

    def __init__(self, problem: str, proposals: Sequence[Proposal], peaks: Mapping[tuple, int],
                 nothing: str, alternatives: Callable[[], Sequence[Proposal]] | None = None) -> None:
        self.peaks, self.nothing = dict(peaks), nothing
        super().__init__(problem, proposals, alternatives=alternatives or ())

    def render(self) -> str:
        lines, fixes = [self.problem], self.fixes
        layouts = [f for f in fixes if "strategy.cuda_graphs" not in f]
        eager = [f for f in fixes if f.get("strategy.cuda_graphs") == "false" and f != EAGER]
        if layouts:
            lines.append("layouts of the same devices and global batch predicted to fit (Hydra overrides):")
            lines += [self._line(f) for f in layouts]
        elif self.nothing:
            lines.append(self.nothing.format(checked=" and passes the other checks" if self.vetted else ""))
        if EAGER in fixes:
            lines.append(f"without CUDA graphs this layout is predicted to fit (peak "
                         f"{format_bytes(self.peaks[_key(EAGER)])}/rank): strategy.cuda_graphs=false")
        elif eager:
            lines.append("without CUDA graphs, layouts predicted to fit:")
            lines += [self._line(f) for f in eager]
        return "\n".join(lines)

    def _line(self, fix: Fix) -> str:
        overrides = " ".join(f"{k}={v}" for k, v in fix.items() if k != "strategy.cuda_graphs")
        eager = " strategy.cuda_graphs=false" if "strategy.cuda_graphs" in fix else ""
        return f"  {overrides}{eager}   # peak {format_bytes(self.peaks[_key(fix)])}/rank"


def _key(fix: Mapping[str, str]) -> tuple:
    return tuple(sorted(fix.items()))


def _fix(cand: Candidate, *extra: str) -> Fix:
    """A layout's overrides (:meth:`Candidate.overrides`) as a fix."""
    return dict(item.split("=", 1) for item in (*cand.overrides(), *extra))


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def candidate_of(layout: Layout) -> Candidate:
    """The :class:`Candidate` of the layout the launcher resolved
    (:func:`pipeline_recipes.recipe.check.settings.resolve_layout`):
    its W, D, B, N, pipelines, concatenation method (``auto`` resolved), recomputation, gradient sync, chunks and CUDA
    graphs, as the layout has them. Baselines are one stage: ``ddp``/``single`` = D 1, N 1."""
    if layout.strategy in BASELINES:
        return Candidate.of(DEFAULT_SCHEDULE, layout.W, 1, layout.B, layout.N, 1, "direct", "none", "end")
    return Candidate(layout)


def run_precision(trainer: Mapping[str, Any]) -> tuple[str, str]:
    """``(device, precision)`` the ranks run with: ``cuda`` for a GPU accelerator, else ``cpu``, and
    ``trainer.precision`` (``auto``, which the launcher resolves first: ``bf16-mixed`` on a GPU, as on
    every GPU with native bf16, else ``32-true``)."""
    device = "cuda" if str(trainer.get("accelerator", "cpu")) in GPU_NAMES else "cpu"
    precision = trainer.get("precision")
    if precision in (None, "auto"):
        precision = "bf16-mixed" if device == "cuda" else "32-true"
    return device, str(precision)


def _setup(cfg_dict: Mapping[str, Any], layout: Layout) -> tuple[ModelCosts, Candidate, int, bool, str]:
    trainer = dict(_get(cfg_dict, "trainer", {}) or {})
    device, precision = run_precision(trainer)
    costs = estimate_costs(_get(cfg_dict, "model"), precision=precision, device=device)
    cand = candidate_of(layout)
    per_node = min(int(trainer.get("devices", cand.world_size) or cand.world_size), cand.world_size)
    return costs, cand, per_node, device == "cpu", precision  # gloo keeps sent tensors until the step ends


def predict_layout(cfg_dict: Mapping[str, Any], layout: Layout, *, budget_bytes: int | None = None) -> dict[str, Any]:
    """The layout's prediction as a JSON-ready record (``preflight=report``): the peak bytes of every
    rank (``predicted_peak_bytes_per_rank``, rank ``r`` = worker ``r % D`` of replica ``r // D``) and
    of what it consists on the largest rank; ``budget_bytes``/``fits`` where this machine runs the
    layout's device (``null`` otherwise, e.g. a GPU layout predicted on a machine without CUDA)."""
    costs, cand, per_node, keep_sends, precision = _setup(cfg_dict, layout)
    mem = predict_memory(costs, cand, keep_sends=keep_sends)
    worst = max(mem.workers, key=lambda w: w.peak)
    budget = _budget_or_none(costs.device, budget_bytes)
    fits = None if budget is None else budget.fits(mem.per_rank, per_node)
    return {"predicted_peak_bytes_per_rank": mem.per_rank, "model": costs.model, "device": costs.device,
            "precision": precision, "strategy": layout.strategy,
            "W": cand.W, "D": cand.D, "B": cand.B, "N": cand.N, "shard_optimizer": cand.shard_optimizer,
            "states_bytes": int(worst.states), "autocast_weight_copies_bytes": int(worst.casts),
            "activations_bytes": int(worst.activations), "cuda_graph_pools_bytes": int(worst.graph_pools),
            "ranks_per_node": per_node,
            "budget_bytes": None if budget is None else budget.limit(), "fits": fits}


def _budget_or_none(device: str, budget_bytes: int | None) -> Budget | None:
    try:
        return device_budget("gpu" if device == "cuda" else "cpu", override=budget_bytes)
    except ValueError:  # no CUDA device here to measure
        return None


def preflight(cfg_dict: Mapping[str, Any], layout: Layout, *, budget_bytes: int | None = None,
              budget: Budget | None = None, max_options: int = 5) -> None:
    """Raise :class:`PreflightError` if the layout's predicted peak memory per rank exceeds the device
    memory; return ``None`` otherwise.

    ``cfg_dict``: the resolved Hydra config (``OmegaConf.to_container(cfg, resolve=True)``);
    ``layout``: :func:`pipeline_recipes.recipe.check.settings.resolve_layout`'s result. ``budget_bytes`` overrides the
    measured budget (per rank on GPU, per node on CPU); ``budget`` replaces it entirely. ``max_options``: the
    fitting layouts to search for and propose (0: none, the refusal alone).
    """
    costs, cand, per_node, keep_sends, _ = _setup(cfg_dict, layout)
    if budget is None:
        budget = device_budget("gpu" if costs.device == "cuda" else "cpu", override=budget_bytes)
    mem = predict_memory(costs, cand, keep_sends=keep_sends)
    short = budget.shortfall(mem.per_rank, per_node)
    if short <= 0:
        return None
    peaks = mem.per_rank
    worst = max(range(len(peaks)), key=lambda r: peaks[r])
    w = mem.workers[worst % cand.D]
    casts = f" + {format_bytes(w.casts)} autocast weight copies" if w.casts else ""
    pools = f" + {format_bytes(w.graph_pools)} CUDA graph pools (strategy.cuda_graphs)" if w.graph_pools else ""
    lines = [
        f"predicted memory does not fit: {cand.label()} W={cand.W} D={cand.D} B={cand.B} N={cand.N} of model "
        f"{costs.model} needs {format_bytes(budget.need(peaks, per_node))} against {budget.describe()} "
        f"(short by {format_bytes(short)}).",
        f"largest rank {worst}: {format_bytes(w.peak)} = {format_bytes(w.states)} weights+gradients+AdamW state"
        f"{' (sharded across its copies)' if cand.shard_optimizer else ''}"
        f"{casts} + {format_bytes(w.activations)} activations and buffers{pools}; per rank: "
        + ", ".join(format_bytes(p) for p in peaks[: min(len(peaks), 8)]) + (" ..." if len(peaks) > 8 else ""),
    ]
    options = _fitting_options(costs, cand, budget, per_node, keep_sends, max_options) if max_options else []
    fits = [(_fix(c), peak) for c, peak in options]
    searched = partial(_searched, costs, cand, budget, per_node, keep_sends)  # asked for only where needed
    if cand.cuda_graphs and max_options:
        fits += _without_graphs(costs, cand, budget, per_node, keep_sends, max_options if not options else 0)
    graphs = " with strategy.cuda_graphs=true" if cand.cuda_graphs else ""
    nothing = (f"no layout of {cand.world_size} processes with global batch {cand.global_batch_size}{graphs} "
               "is predicted to fit{checked}: add devices, lower data.global_batch_size or use a smaller model."
               if max_options else "")
    raise PreflightError("\n".join(lines), [Proposal(tuple(fix for fix, _ in fits))] if fits else [],
                         {_key(fix): peak for fix, peak in fits}, nothing, None if max_options else searched)


SEARCHED = 5  # fitting layouts a refusal made without its search offers once asked (vetting a fix of another rule)


def _searched(costs: ModelCosts, cand: Candidate, budget: Budget, per_node: int, keep_sends: bool) -> list[Proposal]:
    """The fitting layouts of a refusal that did not search for them (:func:`preflight` with ``max_options=0``),
    as alternatives: the same search for every layout of one schedule, devices and batch (:func:`_walked`)."""
    key = (cand.strategy, cand.world_size, cand.global_batch_size, cand.recompute, cand.grad_sync, cand.cuda_graphs,
           cand.shard_optimizer)
    return [Proposal(tuple(_fix(c) for c, _ in _walked(costs, key, budget, per_node, keep_sends)))]


@lru_cache(maxsize=32)
def _walked(costs: ModelCosts, key: tuple, budget: Budget, per_node: int, keep_sends: bool) -> tuple:
    """:func:`_fitting_options` once per ``key``: what the search reads of the refused layout (its schedule, its
    processes and global batch, its gradient sync, CUDA graphs and optimizer sharding), whatever its D and B."""
    strategy, world, batch, recompute, grad_sync, cuda_graphs, shard = key
    like = Candidate.of(strategy, 1, world, 1, batch, recompute=recompute, grad_sync=grad_sync, cuda_graphs=cuda_graphs,
                        shard_optimizer=shard)
    return tuple(_fitting_options(costs, like, budget, per_node, keep_sends, SEARCHED))


def _without_graphs(costs: ModelCosts, cand: Candidate, budget: Budget, per_node: int, keep_sends: bool,
                    limit: int) -> list[tuple[Fix, int]]:
    """What ``strategy.cuda_graphs=false`` would fit, so that a refusal never leaves the graphs' pools an
    unstated way out: this layout, if only its pools do not fit; else up to ``limit`` layouts without them
    (each fix with its predicted peak)."""
    eager = cand.replace(cuda_graphs=False)
    mem = predict_memory(costs, eager, keep_sends=keep_sends)
    if budget.fits(mem.per_rank, per_node):
        return [(dict(EAGER), mem.max_rank)]
    options = _fitting_options(costs, eager, budget, per_node, keep_sends, limit) if limit else []
    return [(_fix(c, "strategy.cuda_graphs=false"), peak) for c, peak in options]


def _states_bound(costs: ModelCosts, cand: Candidate, budget: Budget, per_node: int) -> float:
    """A lower bound of what ``budget`` compares for ``cand``, from the model states alone: every
    replica's ``D`` ranks hold each weight with its gradient and AdamW moments at least once, so the
    largest rank holds at least ``1/D`` of them and a node's ``k`` largest ranks ``k/D``. With
    ``strategy.shard_optimizer`` the AdamW moments of each weight are split over its copies, so all
    ``W·D`` ranks together hold them once: ``1/(W·D)`` of them on average."""
    if budget.per_rank is None and budget.host is None:
        return 0.0
    weights = sum(layer.param_bytes for layer in costs.layers) - sum(b for *_, b in costs.tied)
    states = weights * (2 + ADAMW_STATES / (cand.W if cand.shard_optimizer else 1))
    if budget.per_rank is not None:
        return states / cand.D
    k = min(per_node, cand.world_size)
    return k * states / cand.D + budget.process_bytes * k


def _peaks(costs: ModelCosts, keep_sends: bool, partitions: Mapping[int, list[range]],
           cands: Sequence[Candidate]) -> list[MemoryPrediction]:
    return [predict_memory(costs, c, partitions[c.S], keep_sends=keep_sends) for c in cands]


def _fitting_options(costs: ModelCosts, cand: Candidate, budget: Budget, per_node: int, keep_sends: bool,
                     limit: int, workers: int | None = None) -> list[tuple[Candidate, int]]:
    """Fitting layouts, closest first: same schedule, then the largest B (fewest micro-batches), then
    the smallest peak. Layouts whose model states alone cannot fit are not walked. In one process the
    walk stops once ``limit`` layouts fit and no later one can precede them in that order; spread over
    processes (:mod:`pipeline_recipes.planner.parallel`) every layout is predicted, those on one schedule
    in the same process (each builds the schedule once), and the same order picks them."""

    def rank(c: Candidate) -> tuple:
        return (c.strategy != cand.strategy, c.recompute != "none", c.shard_optimizer != cand.shard_optimizer, -c.B)

    walk = [c for c in sorted(candidates(cand.world_size, cand.global_batch_size, costs.num_layers,
                                         grad_sync=cand.grad_sync), key=rank)
            if _states_bound(costs, c, budget, per_node) <= budget.limit()]
    if cand.cuda_graphs:  # the user's strategy.cuda_graphs=true holds for the suggestions: those it can run, pools counted
        walk = [c.replace(cuda_graphs=True) for c in walk
                if cuda_graphs_error(True, get_spec(c.strategy), c.recompute, c.schedule()) is None]
    partitions = {S: runtime_partition(costs, S) for S in {c.S for c in walk}}  # the split ignores the schedule
    peaks = partial(_peaks, costs, keep_sends, partitions)
    workers = workers_for(len(walk), workers)
    predicted = dict(enumerate(map_grouped(peaks, walk, Candidate.schedule_key, workers))) if workers > 1 else {}
    found: list[tuple[Candidate, int]] = []
    for k, c in enumerate(walk):
        if len(found) >= limit and rank(c) > rank(found[limit - 1][0]):
            break
        mem = predicted[k] if k in predicted else peaks([c])[0]
        if budget.fits(mem.per_rank, per_node):
            found.append((c, mem.max_rank))
            found.sort(key=lambda x: (*rank(x[0]), x[1]))
    return found[:limit]
