"""One registry of pipeline schedules: every schedule is described once, by a :class:`ScheduleSpec`.

A spec names the schedule, its generator (sizes → :class:`~pipeline_recipes.strategies.schedules.actions.Schedule`,
a pure function that imports no registry), its layout rules (:mod:`pipeline_recipes.strategies.schedules.rules`),
whether it is asynchronous, how many stages a worker holds (``chunks``), how many pipelines it runs and
whether it concatenates units of micro-batches (Chimera §3.5), which gives the planner's variants.
:func:`build_schedule` checks the rules before it calls the generator and validates what it produces
(:func:`~pipeline_recipes.strategies.schedules.validate.validate`). Everything that lists schedules or
checks a layout reads this table: :func:`build_schedule`, the layout's derivation
(:func:`pipeline_recipes.strategies.schedules.derivation.derive_layout`, which the Hydra layout check of
:mod:`pipeline_recipes.recipe.check.settings` and the planner's candidates of :mod:`pipeline_recipes.planner.predict` call),
the viewer's choices (``scripts/schedule.py``) and the engine
(:class:`pipeline_recipes.strategies.runtime.engine.PipelineConfig`).

Adding a schedule: add its :class:`ScheduleSpec` to :data:`SCHEDULES` (with any rule of its own) and
``conf/strategy/<name>.yaml`` (``schedule: <name>`` on the shared base); the test grids follow the registry.
A 1F1B variant needs no new loop: its generator is a call of
:func:`~pipeline_recipes.strategies.schedules.one_f_one_b.one_f_one_b` with its own parameters.

Schedules:

* GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism", 2019);
* DAPPLE, 1F1B with a flush per step (Fan et al., "DAPPLE: A Pipelined Data Parallel Approach for Training
  Large Models", 2021);
* GEMS and Chimera with its 2f pipelines and concatenation methods (Li & Hoefler, "Chimera: Efficiently
  Training Large-Scale Neural Networks with Bidirectional Pipelines", 2021);
* interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", 2021);
* ZB-H1, ZB-H2 and ZBV (Qi et al., "Zero Bubble Pipeline Parallelism", 2024), and Chimera + zero bubble
  (Chimera's pipelines with the zero-bubble split backward);
* DualPipeV (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024);
* PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021) and PipeDream
  (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", 2019), asynchronous.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from pipeline_recipes.strategies.schedules.actions import Schedule
from pipeline_recipes.strategies.schedules.asynchronous import run as async_run
from pipeline_recipes.strategies.schedules.dualpipe import dualpipev
from pipeline_recipes.strategies.schedules.generators import best_concat, chimera, concat_choices, dapple, gems, gpipe
from pipeline_recipes.strategies.schedules.interleaved import interleaved_1f1b
from pipeline_recipes.core.errors import did_you_mean

from pipeline_recipes.strategies.schedules.rules import (
    API, AUTO_CONCAT, BIDIRECTIONAL, CHIMERA_PIPELINES, COMMON_RULES, OPPOSITE_REPLICAS, TWO_VERSIONS, V_STAGES, Naming,
    Pipelines, Rule, Settings, equal_rounds, even_stages, micro_batches_at_least_stages,
    micro_batches_at_least_twice_stages,
)
from pipeline_recipes.strategies.schedules.validate import validate
from pipeline_recipes.strategies.schedules.zero_bubble import chimera_zb, zb_h1, zb_h2, zbv

ASYNC_VIEW_STEPS = 3  # steps of an asynchronous schedule that build_schedule returns (then the drain)


class ScheduleError(ValueError):
    """A schedule name or layout that the registry's rules refuse; the message says which rule and the fix."""


@dataclass(frozen=True)
class Chunks:
    """Stages per worker (v): ``default``, and whether the user may choose it (interleaved schedules)."""

    default: int = 1
    choosable: bool = False
    minimum: int = 1


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule, described once.

    ``generator(stages, micro_batches, **options)`` builds it; the options it takes follow from the
    spec: ``pipelines`` when the user may choose them, ``concat`` when it concatenates units,
    ``chunks`` when chunks are choosable, ``steps`` when asynchronous. ``rules`` are its own layout
    rules (checked before :data:`~pipeline_recipes.strategies.schedules.rules.COMMON_RULES`). ``fixed_micro_batches``:
    N per update when the schedule fixes it (PipeDream: 1). ``calibrates``: the planner's runtime calibration
    (:mod:`pipeline_recipes.planner.comm_profile`) runs it: GPipe's critical path has few messages, DAPPLE's one per
    micro-batch and Chimera's one before nearly every action, which together separate the executor's cost
    per action from its latency per message. ``torch_class``: the class of ``torch.distributed.pipelining``
    that runs the same schedule on the same stage placement (``ScheduleGPipe``, ...), which the benchmarks
    (``scripts/bench.py``, ``scripts/bench_e2e.py``) compare it with; ``None`` where torch has none.
    """

    name: str
    generator: Callable[..., Schedule]
    description: str
    rules: tuple[Rule, ...] = ()
    asynchronous: bool = False
    chunks: Chunks = field(default_factory=Chunks)
    pipelines: Pipelines = field(default_factory=Pipelines)
    concat: bool = False
    fixed_micro_batches: int | None = None
    aliases: tuple[str, ...] = ()
    calibrates: bool = False
    torch_class: str | None = None

    def errors(self, settings: Settings) -> list[str]:
        """Every rule's message for ``settings`` (empty: the layout is valid)."""
        settings = replace(settings, schedule=self.name, registered=specs())
        out = []
        for rule in (COMMON_RULES[0], *self.rules, *COMMON_RULES[1:]):  # sizes first, then its own rules
            message = rule(self, settings)
            if message is not None:
                out.append(message)
        return out

    def check(self, settings: Settings) -> None:
        """Raise :class:`ScheduleError` with the first rule that ``settings`` break."""
        errors = self.errors(settings)
        if errors:
            raise ScheduleError(errors[0])

    def build(self, settings: Settings) -> Schedule:
        """The schedule of a valid layout (``concat=auto`` resolved by :func:`best_concat`), checked by
        :func:`~pipeline_recipes.strategies.schedules.validate.validate` before anyone runs it."""
        self.check(settings)
        options: dict[str, object] = {}
        pipelines = self.pipelines.default if settings.pipelines is None else settings.pipelines
        if self.pipelines.choices is not None:
            options["pipelines"] = pipelines
        if self.concat:
            options["concat"] = resolve_concat(self.name, settings.stages, settings.micro_batches, pipelines,
                                               settings.micro_batch_size, settings.concat or "direct")
        if self.chunks.choosable:
            options["chunks"] = self.chunks.default if settings.chunks is None else settings.chunks
        if self.asynchronous:
            options["steps"] = ASYNC_VIEW_STEPS if settings.steps is None else settings.steps
        return validate(self.generator(settings.stages, settings.micro_batches, **options))

    def planner_variants(self, stages: int, micro_batches: int,
                         micro_batch_size: int | None) -> tuple[tuple[int, str], ...]:
        """(pipelines, concat) pairs the planner compares for a layout: every valid pipeline count and
        every concatenation method ``strategy.concat=auto`` would compare (:func:`concat_choices`)."""
        choices = self.pipelines.choices
        pipes = tuple(choices(stages)) if choices is not None else (self.pipelines.default,)
        methods = concat_choices(stages, micro_batches, micro_batch_size) if self.concat else ("direct",)
        return tuple((p, c) for p in pipes for c in methods)

    def smallest_micro_batches(self, stages: int) -> int:
        """The least N ≥ D its rules accept: it shows the schedule's whole placement."""
        if self.fixed_micro_batches:
            return self.fixed_micro_batches
        return next((n for n in range(max(stages, 1), 4 * max(stages, 1) + 2)
                     if not self.errors(Settings(self.name, stages, n))), max(stages, 1))

    def total_stages(self, workers: int, chunks: int | None = None) -> int:
        """S = v·P: the stages one pipeline is split into on ``workers`` workers (``chunks`` v, default the spec's)."""
        return workers * (self.chunks.default if chunks is None else chunks)


SCHEDULES: dict[str, ScheduleSpec] = {}
"""Every schedule by name, in the order they are listed to users."""


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add ``spec`` to :data:`SCHEDULES` (its name and aliases must be new)."""
    taken = {n for s in SCHEDULES.values() for n in (s.name, *s.aliases)}
    clash = sorted({spec.name, *spec.aliases} & taken)
    if clash:
        raise ValueError(f"schedule name(s) {clash} are already registered; pick another name")
    SCHEDULES[spec.name] = spec
    return spec


def specs() -> tuple[ScheduleSpec, ...]:
    return tuple(SCHEDULES.values())


def names(*, aliases: bool = False) -> tuple[str, ...]:
    """Registered schedule names (with ``aliases``: also the alternative names, e.g. ``1f1b``)."""
    return tuple(n for s in SCHEDULES.values() for n in ((s.name, *s.aliases) if aliases else (s.name,)))


def describe_names() -> str:
    return ", ".join(s.name + (f" (alias {', '.join(s.aliases)})" if s.aliases else "") for s in SCHEDULES.values())


def get_spec(name: str) -> ScheduleSpec:
    """The spec of ``name`` (or of an alias); :class:`ScheduleError` listing the valid names otherwise."""
    spec = SCHEDULES.get(name)
    if spec is not None:
        return spec
    for spec in SCHEDULES.values():
        if name in spec.aliases:
            return spec
    close = did_you_mean(name, names(aliases=True))
    raise ScheduleError(f"unknown schedule {name!r}; choose one of {describe_names()}"
                        + (f"; did you mean {close!r}?" if close else ""))


def check(name: str, stages: int, micro_batches: int | None = None, *, naming: Naming = API,
          **settings: object) -> None:
    """Raise :class:`ScheduleError` if ``name`` with these settings breaks one of its rules."""
    get_spec(name).check(Settings(name, stages, micro_batches, naming=naming, **settings))  # type: ignore[arg-type]


def build_schedule(
    name: str, stages: int, micro_batches: int, pipelines: int | None = None, concat: str | None = "direct", *,
    chunks: int | None = None, steps: int | None = None, micro_batch_size: int | None = None, naming: Naming = API,
) -> Schedule:
    """Build a schedule by name after checking its rules (messages spelled as ``naming`` says).

    ``pipelines``/``concat`` apply where the spec lets the user choose them (Chimera); ``concat=auto``
    is resolved by :func:`best_concat` at ``micro_batch_size`` (``None``: any). An asynchronous
    schedule comes as ``steps`` (default ``ASYNC_VIEW_STEPS``) steps of N micro-batches without
    flushes plus the final drain; the runtime runs it window by window
    (:mod:`pipeline_recipes.strategies.schedules.asynchronous`)."""
    return get_spec(name).build(Settings(name, stages, micro_batches, micro_batch_size, pipelines, concat, chunks,
                                         steps, naming=naming))


def resolve_concat(
    name: str, stages: int, micro_batches: int | None, pipelines: int | None, micro_batch_size: int | None, concat: str
) -> str:
    """``concat`` with ``auto`` replaced by :func:`best_concat`'s choice (``direct`` for schedules without
    units to concatenate)."""
    if concat != AUTO_CONCAT:
        return concat
    spec = get_spec(name)
    if not spec.concat or micro_batches is None:
        return "direct"
    return best_concat(stages, micro_batches, spec.pipelines.default if pipelines is None else pipelines,
                       micro_batch_size, generator=spec.generator)


register(ScheduleSpec("gpipe", gpipe, "GPipe: all forwards, then all backwards, a flush per step", calibrates=True,
                      torch_class="ScheduleGPipe"))
DEFAULT_SCHEDULE = "gpipe"
"""The schedule of a strategy or engine config that names none, and the one the planner runs a single stage with
(every schedule is plain gradient accumulation there); ``conf/pipeline_strategy.yaml`` makes each strategy config
name its own."""
register(ScheduleSpec("dapple", dapple, "DAPPLE: 1F1B with a flush per step", aliases=("1f1b",), calibrates=True,
                      torch_class="Schedule1F1B"))
register(ScheduleSpec(
    "gems", gems, "GEMS: two opposite replicas, one micro-batch at a time per worker (Chimera §2)",
    rules=(even_stages(OPPOSITE_REPLICAS),),
    pipelines=Pipelines(2, what="exactly 2 pipelines (two opposite replicas)"),
))
register(ScheduleSpec(
    "chimera", chimera, "Chimera: 2f bidirectional pipelines, units of D micro-batches concatenated (Chimera §3)",
    rules=(even_stages(BIDIRECTIONAL),), pipelines=CHIMERA_PIPELINES, concat=True, calibrates=True,
))
register(ScheduleSpec(
    "pipedream_2bw", partial(async_run, "pipedream_2bw"),
    "PipeDream-2BW: asynchronous 1F1B without flushes, two weight versions, N ≥ D per update",
    rules=(micro_batches_at_least_stages(TWO_VERSIONS),), asynchronous=True,
))
register(ScheduleSpec(
    "pipedream", partial(async_run, "pipedream"),
    "PipeDream: asynchronous 1F1B without flushes, an update per micro-batch, up to D weight versions",
    asynchronous=True, fixed_micro_batches=1,
))
register(ScheduleSpec(
    "interleaved_1f1b", lambda stages, micro_batches, chunks: interleaved_1f1b(stages, chunks, micro_batches),
    "Interleaved 1F1B: v chunks per worker in a loop, 1/v of 1F1B's bubble (Megatron-LM, Narayanan et al. 2021)",
    rules=(equal_rounds,), chunks=Chunks(2, choosable=True, minimum=2), torch_class="ScheduleInterleaved1F1B",
))
register(ScheduleSpec(
    "zb_h1", zb_h1, "ZB-H1: 1F1B with backwards split into input and weight gradients, 1F1B's memory "
    "(Zero Bubble Pipeline Parallelism, Qi et al. 2024)", torch_class="ScheduleInterleavedZeroBubble",
))
register(ScheduleSpec(
    "zb_h2", zb_h2, "ZB-H2: zero bubble in the steady state at twice 1F1B's activations (Zero Bubble Pipeline "
    "Parallelism)",
))
register(ScheduleSpec(
    "zbv", zbv, "ZBV: two chunks per worker in a V, split backwards, near-zero bubble at 1F1B's memory "
    "(Zero Bubble Pipeline Parallelism)", chunks=Chunks(2), torch_class="ScheduleZBVZeroBubble",
))
register(ScheduleSpec(
    "dualpipev", dualpipev, "DualPipeV: two chunks per worker in a V, overlapped forward/backward pairs "
    "(DeepSeek-V3 technical report)", rules=(micro_batches_at_least_twice_stages(V_STAGES),),
    chunks=Chunks(2), torch_class="ScheduleDualPipeV",
))
register(ScheduleSpec(
    "chimera_zb", chimera_zb, "Chimera + zero bubble: Chimera's bidirectional pipelines, bubbles filled by "
    "deferred weight gradients", rules=(even_stages(BIDIRECTIONAL),), pipelines=CHIMERA_PIPELINES, concat=True,
))
