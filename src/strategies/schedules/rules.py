"""Layout rules of the pipeline schedules, each written once: a function of the settings that returns a
precise error message (the setting, its value, the rule and the fix) or ``None``.

The rules serve every front end: the Hydra layout check (``strategy.D``), the schedule viewer
(``--stages``) and the Python API (``stages``). A :class:`Naming` says how the caller spells each
setting, so one rule names what its user typed. :mod:`pipeline_recipes.strategies.schedules.registry` attaches the
rules to the schedules; the papers behind them are Chimera (Li & Hoefler, §3.1, §3.5, §3.6 and
Table 2), PipeDream (Narayanan et al. 2019) and PipeDream-2BW (Narayanan et al. 2020).

Each rule is one function of :class:`Settings` (``settings.schedule`` names the schedule in the
message); the registry's rules wrap them, and a generator called directly with settings it cannot
build raises a ``ValueError`` with the same message (:func:`check_size`, :func:`raise_if`). This module
imports nothing of the package: the generators and the registry both import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline_recipes.core.errors import did_you_mean

if TYPE_CHECKING:
    from pipeline_recipes.strategies.schedules.registry import ScheduleSpec

CONCAT_METHODS = ("direct", "forward_doubling", "backward_halving")
AUTO_CONCAT = "auto"  # strategy.concat=auto: best_concat picks one of CONCAT_METHODS per layout
CONCAT_RULE = "direct, forward_doubling, backward_halving or auto (the fastest simulated; Chimera §3.5)"


@dataclass(frozen=True)
class Naming:
    """How a front end spells each setting; ``more_micro_batches`` and ``exact_micro_batches`` are its
    fixes that raise N or set it to ``{n}`` (``{times}``: ``n·`` or nothing for 1; N is derived from the
    batch in a config, given in the viewer)."""

    stages: str
    micro_batches: str
    pipelines: str
    concat: str
    chunks: str
    steps: str
    grad_sync: str
    recompute: str
    more_micro_batches: str
    exact_micro_batches: str
    stages_note: str = ""  # appended to a suggested D (a config's D must also divide the processes)
    shard_optimizer: str = "shard_optimizer"


API = Naming("stages", "micro_batches", "pipelines", "concat", "chunks", "steps", "grad_sync", "recompute",
             "raise micro_batches", "pass micro_batches={n}")
CONFIG = Naming(
    "strategy.D", "data.global_batch_size / (W·strategy.micro_batch_size)", "strategy.pipelines",
    "strategy.concat", "strategy.chunks", "steps", "strategy.grad_sync", "strategy.recompute",
    "raise data.global_batch_size or lower strategy.micro_batch_size",
    "set data.global_batch_size = {times}W·strategy.micro_batch_size, or leave strategy.micro_batch_size null "
    "(B = data.global_batch_size / {times}W)",
    stages_note=" (a divisor of trainer.devices × trainer.num_nodes)", shard_optimizer="strategy.shard_optimizer",
)
GENERATOR = Naming("workers (P)", "micro_batches (N)", "pipelines", "concat", "chunks (v)", "steps", "grad_sync",
                   "recompute", "raise micro_batches (N)", "pass micro_batches={n}")
"""A generator's own parameters (called directly, a generator names what its caller passed)."""
CLI = Naming("--stages", "--micro-batches", "--pipelines", "--concat", "--chunks", "--steps", "grad_sync",
             "recompute", "raise --micro-batches", "pass --micro-batches {n}")


GRAD_SYNC_MODES = ("end", "eager", "eager_opt")
"""When a stage's gradients are all-reduced (Chimera §3.2): after the last backward, as each stage's backward
ends, or that and its optimizer step too; the first is the default."""
RECOMPUTE_MODES = ("none", "except_last", "always")
"""Which stage forwards are recomputed in the backward (GPipe §2.3); the first is the default."""
DEFAULT_GRAD_SYNC, DEFAULT_RECOMPUTE = GRAD_SYNC_MODES[0], RECOMPUTE_MODES[0]


@dataclass(frozen=True)
class Settings:
    """One layout of one schedule as a rule sees it. ``None``: not set (the schedule's default), or for
    ``micro_batches`` not known yet (rules about N then pass)."""

    schedule: str
    stages: int
    micro_batches: int | None = None
    micro_batch_size: int | None = None
    pipelines: int | None = None
    concat: str | None = None
    chunks: int | None = None
    steps: int | None = None
    grad_sync: str = DEFAULT_GRAD_SYNC
    recompute: str = DEFAULT_RECOMPUTE
    naming: Naming = API
    registered: tuple[ScheduleSpec, ...] = ()  # every registered schedule (the registry fills it): fixes name them


class Refusal(str):
    """A rule's message (the setting, its value, the rule and the fix) that keeps its parts: ``problem`` (all
    but the fix), ``fix`` (in the front end's words), ``changes`` (the settings, named as :class:`Naming`'s
    fields, whose values may fix it), ``schedules`` (other schedules it names as a way out) and ``guess`` (a
    near miss of the refused value). A front end that proposes checked values of its own (the launcher,
    :mod:`pipeline_recipes.core.fixes`) shows ``problem`` with them instead of ``fix``."""

    problem: str
    fix: str
    changes: tuple[str, ...]
    schedules: tuple[str, ...]
    guess: str | None

    def __new__(cls, problem: str, fix: str, changes: tuple[str, ...] = (), schedules: tuple[str, ...] = (),
                guess: str | None = None) -> Refusal:
        self = super().__new__(cls, f"{problem}; {fix}")
        self.problem, self.fix, self.changes, self.schedules, self.guess = problem, fix, changes, schedules, guess
        return self


Rule = Callable[["ScheduleSpec", Settings], "str | None"]


@dataclass(frozen=True)
class Pipelines:
    """How many pipelines a schedule runs: ``default``, and where the user may choose, the valid counts
    for D stages (``choices``) with the rule in words."""

    default: int = 1
    choices: Callable[[int], Sequence[int]] | None = None
    rule: str = ""
    what: str = "a single pipeline"


def size_error(setting: str, value: object, minimum: int = 1, fix: str = "",
               changes: tuple[str, ...] = ()) -> Refusal | None:
    """The one check of a size: an integer (not a bool) of at least ``minimum``; the message otherwise."""
    if not isinstance(value, bool) and isinstance(value, int) and value >= minimum:
        return None
    rule = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer ≥ {minimum}")
    return Refusal(f"{setting} must be {rule}, got {value!r}", fix or f"use {minimum} or more", changes)


def raise_if(name: str, message: str | None) -> None:
    """A generator's refusal: ``ValueError`` with a rule's message (prefixed by ``name:`` unless it names it)."""
    if message is not None:
        raise ValueError(message if message.startswith(name) else f"{name}: {message}")


def check_size(name: str, setting: str, value: object, minimum: int = 1, fix: str = "") -> None:
    """Raise a ``ValueError`` naming the generator, the setting, its value and the rule (:func:`size_error`)."""
    raise_if(name, size_error(setting, value, minimum, fix))


def check_sizes(name: str, stages: object, micro_batches: object) -> None:
    """``stages`` and ``micro_batches`` are positive integers (a generator's own check)."""
    check_size(name, "stages", stages)
    check_size(name, "micro_batches", micro_batches)


def _even_near(d: int) -> str:
    """The even numbers next to an odd ``d`` (2 for 1)."""
    return " or ".join(str(v) for v in sorted({max(d - 1, 2), d + 1}))


def _names_where(s: Settings, predicate: Callable[[ScheduleSpec], bool]) -> str:
    """The registered schedules that satisfy ``predicate``, for a message's fix ("none" if none)."""
    return ", ".join(sp.name for sp in s.registered if predicate(sp)) or "none"


def _or_use(s: Settings, what: str, predicate: Callable[[ScheduleSpec], bool]) -> str:
    """", or use a schedule with <what> (names)" when one is registered, else nothing."""
    others = _names_where(s, predicate)
    return "" if others == "none" else f", or use a schedule with {what} ({others})"


def _where(s: Settings, predicate: Callable[[ScheduleSpec], bool]) -> tuple[str, ...]:
    """The registered schedules that satisfy ``predicate`` (a refusal's ``schedules``)."""
    return tuple(sp.name for sp in s.registered if predicate(sp))


def positive_sizes(spec: ScheduleSpec, s: Settings) -> str | None:
    """D and N (when known) are positive integers."""
    for name, value, kind in ((s.naming.stages, s.stages, "stages"),
                              (s.naming.micro_batches, s.micro_batches, "micro_batches")):
        error = None if value is None else size_error(name, value, changes=(kind,))
        if error is not None:
            return error
    return None


def stages_even(s: Settings, reason: str) -> str | None:
    """D is even: the schedule places two pipelines in opposite directions on the same workers."""
    if s.stages % 2 == 0:
        return None
    n = s.naming
    return Refusal(f"{s.schedule} needs {n.stages} to be even ({reason}), got {n.stages} = {s.stages}",
                   f"use {n.stages} = {_even_near(s.stages)}{n.stages_note}", ("stages",))


def even_stages(reason: str) -> Rule:
    """A spec's rule: :func:`stages_even` for ``reason``."""

    def rule(spec: ScheduleSpec, s: Settings) -> str | None:
        return stages_even(s, reason)

    return rule


BIDIRECTIONAL = "its down and up pipelines merge without conflict, Chimera §3.1"
"""Why Chimera's D is even (:func:`stages_even`)."""
OPPOSITE_REPLICAS = "each worker holds one stage of each of its two replicas"
"""Why GEMS's D is even (:func:`stages_even`)."""
TWO_VERSIONS = "so that only two weight versions are in flight"
"""Why PipeDream-2BW takes N ≥ D (:func:`at_least_stages`)."""
V_STAGES = "one per stage of the V"
"""Why DualPipeV takes N ≥ 2D (:func:`at_least_twice_stages`)."""


def at_least_stages(s: Settings, reason: str) -> str | None:
    """N ≥ D micro-batches per update."""
    if s.micro_batches is None or s.micro_batches >= s.stages:
        return None
    n = s.naming
    return Refusal(f"{s.schedule} needs N ≥ D micro-batches per update ({reason}), got N = {s.micro_batches} "
                   f"({n.micro_batches}) < D = {s.stages} ({n.stages})",
                   f"{n.more_micro_batches}, or lower {n.stages}", ("micro_batches", "stages"))


def micro_batches_at_least_stages(reason: str) -> Rule:
    """A spec's rule: :func:`at_least_stages` for ``reason``."""

    def rule(spec: ScheduleSpec, s: Settings) -> str | None:
        return at_least_stages(s, reason)

    return rule


def exact_micro_batches(s: Settings, want: int | None) -> str | None:
    """N is exactly ``want`` per update where the schedule fixes it (PipeDream: 1)."""
    if want is None or s.micro_batches is None or s.micro_batches == want:
        return None
    n = s.naming
    per = "after every micro-batch" if want == 1 else f"every {want} micro-batches"
    return Refusal(f"{s.schedule} updates the weights {per}, so N must be {want}, got N = {s.micro_batches} "
                   f"({n.micro_batches})", n.exact_micro_batches.format(n=want, times='' if want == 1 else f'{want}·'),
                   ("micro_batches",))


def fixed_micro_batches(spec: ScheduleSpec, s: Settings) -> str | None:
    """A schedule that takes exactly ``spec.fixed_micro_batches`` micro-batches per update (PipeDream: 1)."""
    return exact_micro_batches(s, spec.fixed_micro_batches)


def pipelines_error(s: Settings, pipelines: Pipelines) -> str | None:
    """``pipelines`` is one the schedule runs: its fixed count, or one of its choices for this D."""
    p, n = s.pipelines, s.naming
    if p is None:
        return None
    if pipelines.choices is None:
        if p == pipelines.default:
            return None
        choosing = lambda sp: sp.pipelines.choices is not None  # noqa: E731
        return Refusal(f"{s.schedule} runs {pipelines.what}, got {n.pipelines} = {p}",
                       f"leave {n.pipelines} unset (or {pipelines.default})"
                       f"{_or_use(s, 'a choice of pipelines', choosing)}", ("pipelines",), _where(s, choosing))
    valid = list(pipelines.choices(s.stages))
    if p in valid:
        return None
    return Refusal(f"{s.schedule}: {n.pipelines} = {p} must be {pipelines.rule}, with {n.stages} = {s.stages}",
                   f"choose one of {valid}", ("pipelines",))


def pipelines_allowed(spec: ScheduleSpec, s: Settings) -> str | None:
    """A spec's rule: :func:`pipelines_error` for its pipelines."""
    return pipelines_error(s, spec.pipelines)


def _suggest(value: object, options: Iterable[object]) -> str:
    close = did_you_mean(value, options)
    return f"; did you mean {close!r}?" if close else ""


def concat_error(s: Settings, concatenates: bool) -> str | None:
    """``concat`` is a Chimera §3.5 method where the schedule has units to concatenate, else unset/direct."""
    c, n = s.concat, s.naming
    if concatenates:
        if c is None or c in (*CONCAT_METHODS, AUTO_CONCAT):
            return None
        return Refusal(f"{s.schedule}: {n.concat} = {c!r} is not a concatenation method ({CONCAT_RULE})",
                       "use one of them" + _suggest(c, (*CONCAT_METHODS, AUTO_CONCAT)), ("concat",),
                       guess=did_you_mean(c, (*CONCAT_METHODS, AUTO_CONCAT)))
    if c in (None, "direct"):
        return None
    others = _names_where(s, lambda sp: sp.concat)
    return Refusal(f"{n.concat} applies to schedules that concatenate units of micro-batches ({others}) only: "
                   f"{s.schedule} has none, got {n.concat} = {c}", f"drop {n.concat}", ("concat",),
                   _where(s, lambda sp: sp.concat))


def concat_allowed(spec: ScheduleSpec, s: Settings) -> str | None:
    """A spec's rule: :func:`concat_error` for whether it concatenates units."""
    return concat_error(s, spec.concat)


def chunks_allowed(spec: ScheduleSpec, s: Settings) -> str | None:
    """``chunks`` (stages per worker) is the schedule's fixed count, or one the user may choose."""
    v, n, spec_v = s.chunks, s.naming, spec.chunks
    if v is None:
        return None
    if not spec_v.choosable:
        if v == spec_v.default:
            return None
        per = "one stage" if spec_v.default == 1 else f"{spec_v.default} stages"
        return Refusal(f"{spec.name} runs {per} per worker, got {n.chunks} = {v}",
                       f"drop {n.chunks}{_or_use(s, 'a choice of chunks per worker', lambda sp: sp.chunks.choosable)}",
                       ("chunks",), _where(s, lambda sp: sp.chunks.choosable))
    if size_error(n.chunks, v, spec_v.minimum) is not None:
        return Refusal(f"{spec.name}: {n.chunks} = {v!r} must be an integer ≥ {spec_v.minimum} (stages per worker)",
                       f"use {n.chunks} = {max(spec_v.default, spec_v.minimum)}", ("chunks",))
    return None


def steps_allowed(spec: ScheduleSpec, s: Settings) -> str | None:
    """``steps`` (windows shown back to back) applies to asynchronous schedules only."""
    if s.steps is None:
        return None
    n = s.naming
    if not spec.asynchronous:
        others = _names_where(s, lambda sp: sp.asynchronous)
        return Refusal(f"{n.steps} applies to asynchronous schedules only ({others}: their "
                       f"windows run without flushes), got {n.steps} = {s.steps} for {spec.name}", f"drop {n.steps}",
                       ("steps",), _where(s, lambda sp: sp.asynchronous))
    if size_error(n.steps, s.steps) is not None:
        return Refusal(f"{spec.name}: {n.steps} must be a positive number of optimizer steps, got {s.steps!r}",
                       "e.g. 3", ("steps",))
    return None


def stashed_versions(spec: ScheduleSpec, s: Settings) -> str | None:
    """An asynchronous schedule stashes weight versions per step: all-reduce at the end, no recomputation."""
    if not spec.asynchronous or (s.grad_sync, s.recompute) == ("end", "none"):
        return None
    n = s.naming
    return Refusal(f"{spec.name} stashes weight versions per step and runs with {n.grad_sync}=end and "
                   f"{n.recompute}=none, got {n.grad_sync}={s.grad_sync} and {n.recompute}={s.recompute}",
                   "drop those settings", ("grad_sync", "recompute"))


def shard_optimizer_error(schedule: str, replicas: int, pipelines: int, shard: object, asynchronous: bool = False,
                          naming: Naming = API) -> Refusal | None:
    """``shard_optimizer`` is a bool and, when set, the schedule is synchronous and some stage has more than one copy
    to shard its optimizer state across: ``replicas`` (W) × ``pipelines`` (Chimera's 2f pipelines each hold a copy of
    every stage, §3.3)."""
    key = naming.shard_optimizer
    if not isinstance(shard, bool):
        return Refusal(f"{key} must be true or false, got {shard!r}", f"use {key}=false or {key}=true",
                       ("shard_optimizer",))
    if not shard:
        return None
    if asynchronous:
        return Refusal(f"{key} = true but {schedule} is asynchronous: it hands each stage the gradient of a stashed "
                       "weight version on the stage's own delay and clips each stage by its own norm, without the "
                       "collectives that a sharded optimizer state needs at every step, so its state stays whole",
                       f"set {key}=false, or use a synchronous schedule", ("shard_optimizer",),
                       schedules=("dapple", "chimera"))
    if replicas * pipelines > 1:
        return None
    return Refusal(f"{key} = true but every stage of {schedule} at W = {replicas} has one copy: there is no "
                   "optimizer state to shard (each stage's state is sharded across its copies: the W replicas, and "
                   "in Chimera its 2f pipelines)",
                   f"set {key}=false, or run W ≥ 2 replicas (twice the devices) or a bidirectional schedule",
                   ("shard_optimizer",), schedules=("chimera",))


def _fits_rounds(micro_batches: int, workers: int) -> bool:
    return micro_batches % max(1, micro_batches // workers) == 0


def rounds(workers: int, micro_batches: int) -> tuple[int, int]:
    """``(rounds, micro-batches per round)`` of interleaved 1F1B: ``rounds = max(1, N // P)`` (torch's rule;
    :func:`equal_rounds` says whether N splits)."""
    count = max(1, micro_batches // workers)
    return count, micro_batches // count


def equal_rounds_error(s: Settings) -> str | None:
    """Interleaved 1F1B runs rounds of equal size on its P workers (``stages``): N a multiple of
    max(1, N // P) (torch's relaxation of Megatron-LM's N mod P = 0;
    :mod:`pipeline_recipes.strategies.schedules.interleaved`)."""
    N, P = s.micro_batches, s.stages
    if N is None or _fits_rounds(N, P):
        return None
    below = next(m for m in range(N - 1, 0, -1) if _fits_rounds(m, P))
    above = next(m for m in range(N + 1, 2 * N + P) if _fits_rounds(m, P))
    n = s.naming
    return Refusal(f"{s.schedule} runs rounds of equal size: N must be a multiple of rounds = max(1, N // P) = "
                   f"{N // P} (Megatron-LM requires N mod P = 0; torch's ScheduleInterleaved1F1B relaxes it to this "
                   f"rule), got N = {N} ({n.micro_batches}) with P = {P} workers ({n.stages})",
                   f"use N = {below} or N = {above}: {n.more_micro_batches}", ("micro_batches", "stages"))


def equal_rounds(spec: ScheduleSpec, s: Settings) -> str | None:
    """A spec's rule: :func:`equal_rounds_error`."""
    return equal_rounds_error(s)


def at_least_twice_stages(s: Settings, reason: str) -> str | None:
    """N ≥ 2D micro-batches per step (DualPipeV: one per stage of its V; the generator's precondition too)."""
    if s.micro_batches is None or s.micro_batches >= 2 * s.stages:
        return None
    n = s.naming
    return Refusal(f"{s.schedule} needs N ≥ 2·D micro-batches per step ({reason}), got N = {s.micro_batches} "
                   f"({n.micro_batches}) < 2·D = {2 * s.stages} ({n.stages} = {s.stages})",
                   f"{n.more_micro_batches}, lower {n.stages}, or use a schedule with no such bound (zbv)",
                   ("micro_batches", "stages"), ("zbv",))


def micro_batches_at_least_twice_stages(reason: str) -> Rule:
    """A spec's rule: :func:`at_least_twice_stages` for ``reason``."""

    def rule(spec: ScheduleSpec, s: Settings) -> str | None:
        return at_least_twice_stages(s, reason)

    return rule


COMMON_RULES: tuple[Rule, ...] = (
    positive_sizes, pipelines_allowed, concat_allowed, chunks_allowed, steps_allowed, fixed_micro_batches,
    stashed_versions,
)
"""The rules every schedule is checked against (after its own), driven by its spec's fields."""


def chimera_pipeline_counts(stages: int) -> tuple[int, ...]:
    """Chimera's valid numbers of pipelines for D stages: 2f for every divisor f of D/2 (§3.6)."""
    half = stages // 2
    return tuple(2 * f for f in range(1, half + 1) if half % f == 0)


CHIMERA_PIPELINES = Pipelines(2, chimera_pipeline_counts, "2f for a divisor f of D/2 (Chimera §3.6)", "2f pipelines")
"""Chimera's (and Chimera + zero bubble's) pipelines: 2f, f a divisor of D/2."""
