"""A pipeline's layout derived from its settings, once: W replicas, B samples per micro-batch, N micro-batches per
step and S stages from the processes, D and the global batch (Chimera Table 1: B̂ = W·B·N), then the schedule's
rules (:mod:`pipeline_recipes.strategies.schedules.registry`) and the schedule built and validated, whose placement
the workers run (Chimera §3.3).

:func:`derive_layout` is the only place these are worked out. The launcher calls it through
:func:`pipeline_recipes.recipe.check.settings.resolve_layout` (which turns a refusal into candidate fixes of the config),
the planner enumerates its candidates with it (``validate=False``: the arithmetic and the rules, no schedule built,
:func:`pipeline_recipes.planner.predict.candidates`), and a direct user of the engine gets the same checks from it.
The runtime only reads the :class:`~pipeline_recipes.core.layout.Layout` it returns. A refusal is a
:class:`LayoutRefusal`: the message (spelled as the config's settings, :data:`~.rules.CONFIG`) and which kind of
setting may fix it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

from pipeline_recipes.core.layout import Layout
from pipeline_recipes.strategies.schedules.actions import Schedule
from pipeline_recipes.strategies.schedules.registry import (
    ScheduleError, ScheduleSpec, build_schedule, get_spec, resolve_concat,
)
from pipeline_recipes.strategies.schedules.rules import (
    CONFIG, DEFAULT_GRAD_SYNC, DEFAULT_RECOMPUTE, GRAD_SYNC_MODES, RECOMPUTE_MODES, Naming, Refusal, Settings,
    shard_optimizer_error,
)

__all__ = ["LayoutRefusal", "derive_layout", "derive_sizes", "layout_of", "variant_of"]

ScheduleRule = Callable[[Schedule], "str | None"]
"""A further rule on the built schedule (a refusal's message or None), e.g. what CUDA graphs cannot capture."""


class LayoutRefusal(ScheduleError):
    """The settings make no layout. ``kind`` says which settings may fix it: ``stages`` (D does not divide the
    processes), ``replicas`` (W·D is not the processes), ``fixed_batch`` (the global batch is no multiple of W·N for a
    schedule that fixes N), ``layers`` (more stages than layers), ``batch`` (N = B̂/(W·B) is not whole), ``rule`` (a
    rule of the schedule: ``problem`` is its :class:`~.rules.Refusal`), ``schedule`` (the schedule cannot be built),
    ``halving`` (backward halving with an odd B). ``W``, ``B``: the replicas and micro-batch size derived so far."""

    def __init__(self, problem: str, kind: str, W: int, B: int) -> None:
        super().__init__(str(problem))
        self.problem, self.kind, self.W, self.B = problem, kind, W, B


def derive_sizes(spec: ScheduleSpec, world: int, D: int, global_batch_size: int, *, B: int | None,
                 W: int | None = None, chunks: int | None = None, num_layers: int | None = None
                 ) -> tuple[int, int, int, int]:
    """The arithmetic of a layout, ``(W, B, N, S)``: W = ``world`` / D (or ``W`` as given), N = B̂ / (W·B),
    S = v·D (``chunks`` v; ``num_layers``: the pipeline layers, at least one per stage, None: not checked). ``B``
    None: the schedule fixes N (PipeDream) and B is B̂ / (W·N). Cheap: no rule of the schedule, nothing built;
    :class:`LayoutRefusal` where the numbers do not divide."""
    fixed_n = spec.fixed_micro_batches
    one_per_update = fixed_n is not None and B is None
    B = 1 if one_per_update else B
    w_set = W is not None
    W = W or (world // D if world % D == 0 else 1)
    if world % D:
        raise LayoutRefusal(f"strategy.D = {D} does not divide the {world} processes (trainer.devices × "
                            "trainer.num_nodes)", "stages", W, B)
    if W * D != world:
        raise LayoutRefusal(f"W·D = {W}·{D} = {W * D} but trainer.devices × trainer.num_nodes = {world}", "replicas",
                            W, B)
    if one_per_update:
        if global_batch_size % (W * fixed_n):
            raise LayoutRefusal(f"data.global_batch_size = {global_batch_size} is not divisible by W·N = "
                                f"{W}·{fixed_n} (strategy={spec.name} takes B = global batch / (W·N), N = {fixed_n}), "
                                f"so it must be a multiple of {W * fixed_n}", "fixed_batch", W, B)
        B = global_batch_size // (W * fixed_n)
    S = spec.total_stages(D, chunks)
    if num_layers is not None and S > num_layers:
        per = S // D
        raise LayoutRefusal(f"strategy.D = {D}" + (f" with {per} stages per worker (S = {S})" if per > 1 else " stages")
                            + f" but the model has only {num_layers} pipeline layers (at least one per stage)",
                            "layers", W, B)
    if global_batch_size % (W * B):
        raise LayoutRefusal(_batch_problem(global_batch_size, W, B, world, D, w_set), "batch", W, B)
    return W, B, global_batch_size // (W * B), S


def derive_layout(spec: ScheduleSpec | str, world: int, D: int, global_batch_size: int, *, B: int | None,
                  W: int | None = None, pipelines: int | None = None, concat: str | None = None,
                  chunks: int | None = None, grad_sync: str = DEFAULT_GRAD_SYNC, recompute: str = DEFAULT_RECOMPUTE,
                  cuda_graphs: bool = False, num_layers: int | None = None, precision: str | None = None,
                  shard_optimizer: bool = False, schedule_rules: Sequence[ScheduleRule] = (), naming: Naming = CONFIG,
                  validate: bool = True) -> Layout:
    """The layout of schedule ``spec`` on ``world`` processes with pipelines of ``D`` workers and a global batch of
    ``global_batch_size`` (the other settings as the strategy config names them; None: the schedule's default):
    :func:`derive_sizes`, then every rule of the schedule (its registry spec, messages spelled as ``naming``), then
    the schedule built and validated (``concat=auto`` resolved to the fastest method, Chimera §3.5) and
    ``schedule_rules`` on it; the layout carries the schedule's placement. ``validate=False``: the arithmetic and the
    rules only, no schedule built (no placement, ``concat`` as given): what the planner enumerates.
    :class:`LayoutRefusal` names the first rule broken; ``spec``: the schedule's spec or name."""
    spec = get_spec(spec) if isinstance(spec, str) else spec
    for name, value, choices in ((naming.grad_sync, grad_sync, GRAD_SYNC_MODES),
                                 (naming.recompute, recompute, RECOMPUTE_MODES)):
        if value not in choices:
            kind = "grad_sync" if choices is GRAD_SYNC_MODES else "recompute"
            raise LayoutRefusal(Refusal(f"{name} must be one of {', '.join(choices)}, got {value!r}",
                                        f"use {choices[0]}", (kind,)), "rule", W or 1, B or 1)
    W, B, N, _ = derive_sizes(spec, world, D, global_batch_size, B=B, W=W, chunks=chunks, num_layers=num_layers)
    settings = Settings(spec.name, D, N, B, pipelines, concat, chunks, grad_sync=grad_sync, recompute=recompute,
                        naming=naming)
    errors = spec.errors(settings)
    if errors:
        raise LayoutRefusal(errors[0], "rule", W, B)
    pipes = spec.pipelines.default if pipelines is None else pipelines
    refusal = shard_optimizer_error(spec.name, W, pipes, shard_optimizer, spec.asynchronous, naming)
    if refusal is not None:
        raise LayoutRefusal(refusal, "rule", W, B)
    requested = str(concat or "direct") if spec.concat else "direct"
    if not validate:
        return layout_of(spec, W, D, B, N, pipes, requested, chunks=chunks, grad_sync=grad_sync,
                         recompute=recompute, cuda_graphs=cuda_graphs, precision=precision,
                         shard_optimizer=shard_optimizer)
    method = _resolved_concat(spec.name, D, N, pipes, B, requested)
    schedule = _checked_schedule(spec, D, W, B, N, pipes, method, chunks)
    for rule in schedule_rules:
        refusal = rule(schedule)
        if refusal is not None:
            raise LayoutRefusal(refusal, "rule", W, B)
    return layout_of(spec, W, D, B, N, pipes, method, chunks=chunks, grad_sync=grad_sync,
                     recompute=recompute, cuda_graphs=cuda_graphs, precision=precision,
                     concat_auto=requested == "auto", placement=schedule.placement, shard_optimizer=shard_optimizer)


def layout_of(spec: ScheduleSpec, W: int, D: int, B: int, N: int, pipelines: int, concat: str = "direct", *,
              chunks: int | None = None, grad_sync: str = DEFAULT_GRAD_SYNC, recompute: str = DEFAULT_RECOMPUTE,
              cuda_graphs: bool = False, precision: str | None = None, concat_auto: bool = False,
              placement: tuple[tuple[int, ...], ...] = (), shard_optimizer: bool = False) -> Layout:
    """The :class:`~pipeline_recipes.core.layout.Layout` of these sizes and settings, as given (checked by
    :func:`derive_layout`, or by whoever names them: the planner's own layouts): its processes W·D, global batch
    W·B·N, stages v·D, variant (:func:`variant_of`)."""
    S = spec.total_stages(D, chunks)
    return Layout(spec.name, W * D, W, D, B, N, W * B * N, pipelines,
                  variant_of(spec, pipelines, concat, chunks, grad_sync, recompute, shard_optimizer), concat,
                  concat_auto, S if S != D else None, cuda_graphs, chunks=chunks, grad_sync=grad_sync,
                  recompute=recompute, placement=placement, precision=precision, shard_optimizer=shard_optimizer)


def variant_of(spec: ScheduleSpec, pipelines: int, concat: str = "direct", chunks: int | None = None,
               grad_sync: str = DEFAULT_GRAD_SYNC, recompute: str = DEFAULT_RECOMPUTE,
               shard_optimizer: bool = False) -> str:
    """Settings beyond the schedule's defaults: concatenation method, pipelines, chunks, gradient sync,
    recomputation, sharded optimizer state (e.g. ``forward_doubling+sync_eager+shard_optim``)."""
    parts = []
    if spec.concat and concat != "direct":
        parts.append(concat)
    if spec.pipelines.choices is not None and pipelines != spec.pipelines.default:
        parts.append(f"{pipelines}pipes")
    if spec.chunks.choosable and chunks not in (None, spec.chunks.default):
        parts.append(f"v{chunks}")
    if grad_sync != DEFAULT_GRAD_SYNC:
        parts.append(f"sync_{grad_sync}")
    if recompute != DEFAULT_RECOMPUTE:
        parts.append(f"recompute_{recompute}")
    if shard_optimizer:
        parts.append("shard_optim")
    return "+".join(parts)


@lru_cache(maxsize=1024)
def _resolved_concat(name: str, D: int, N: int, pipelines: int, B: int, requested: str) -> str:
    """:func:`~.registry.resolve_concat`, once per layout (``auto`` simulates every method)."""
    return resolve_concat(name, D, N, pipelines, B, requested)


@lru_cache(maxsize=1024)
def _built(name: str, D: int, N: int, pipelines: int, concat: str, chunks: int | None, B: int) -> Schedule:
    """The validated schedule of a layout, built once (a refusal's candidate fixes check the same ones again)."""
    return build_schedule(name, D, N, pipelines, concat, chunks=chunks, micro_batch_size=B)


def _checked_schedule(spec: ScheduleSpec, D: int, W: int, B: int, N: int, pipelines: int, concat: str,
                      chunks: int | None) -> Schedule:
    """Build (and validate) the schedule the workers will run, so a bad combination stops here."""
    try:
        schedule = _built(spec.name, D, N, pipelines, concat, chunks, B)
    except ValueError as err:
        extra = f", concat = {concat}" if spec.concat else ""
        raise LayoutRefusal(f"strategy={spec.name} with D = {D}, N = {N} micro-batches{extra}: {err}",
                            "schedule", W, B) from err
    halved = any(a.half is not None for acts in schedule.workers for a in acts)
    if halved and B % 2:
        raise LayoutRefusal(f"concat = backward_halving splits micro-batches in two halves, but "
                            f"strategy.micro_batch_size = {B} is odd", "halving", W, B)
    return schedule


def _batch_problem(global_batch_size: int, W: int, B: int, world: int, D: int, w_set: bool) -> str:
    """N = B̂ / (W·B) must be whole: name both settings and where W comes from."""
    step = W * B
    origin = (f"strategy.W = {W}" if w_set else
              f"{W} replicas: trainer.devices × trainer.num_nodes = {world} processes / strategy.D = {D}")
    head = (f"data.global_batch_size = {global_batch_size} is not divisible by W·B = {W}·{B} = {step} "
            f"(W = {origin}; B = strategy.micro_batch_size = {B}): N = data.global_batch_size / (W·B) "
            f"micro-batches per step must be whole, so data.global_batch_size must be a multiple of {step}")
    if global_batch_size % W:
        return head + f", and no strategy.micro_batch_size helps while it is not a multiple of W = {W}"
    return head + f" or strategy.micro_batch_size a divisor of data.global_batch_size / W = {global_batch_size // W}"
