"""Layout rules of the pipeline schedules, each written once: a function of the settings that returns a
precise error message (the setting, its value, the rule and the fix) or ``None``.

The rules serve every front end: the Hydra layout check (``strategy.D``), the schedule viewer
(``--stages``) and the Python API (``stages``). A :class:`Naming` says how the caller spells each
setting, so one rule names what its user typed. :mod:`strategies.schedules.registry` attaches the
rules to the schedules; the papers behind them are Chimera (Li & Hoefler, §3.1, §3.5, §3.6 and
Table 2), PipeDream (Narayanan et al. 2019) and PipeDream-2BW (Narayanan et al. 2020).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .registry import ScheduleSpec

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


API = Naming("stages", "micro_batches", "pipelines", "concat", "chunks", "steps", "grad_sync", "recompute",
             "raise micro_batches", "pass micro_batches={n}")
CONFIG = Naming(
    "strategy.D", "data.global_batch_size / (W·strategy.micro_batch_size)", "strategy.pipelines",
    "strategy.concat", "strategy.chunks", "steps", "strategy.grad_sync", "strategy.recompute",
    "raise data.global_batch_size or lower strategy.micro_batch_size",
    "set data.global_batch_size = {times}W·strategy.micro_batch_size, or leave strategy.micro_batch_size null "
    "(B = data.global_batch_size / {times}W)",
    stages_note=" (a divisor of trainer.devices × trainer.num_nodes)",
)
CLI = Naming("--stages", "--micro-batches", "--pipelines", "--concat", "--chunks", "--steps", "grad_sync",
             "recompute", "raise --micro-batches", "pass --micro-batches {n}")


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
    grad_sync: str = "end"
    recompute: str = "none"
    naming: Naming = API


Rule = Callable[["ScheduleSpec", Settings], "str | None"]


def _even_near(d: int) -> str:
    """The even numbers next to an odd ``d`` (2 for 1)."""
    return " or ".join(str(v) for v in sorted({max(d - 1, 2), d + 1}))


def _names_where(predicate: Callable[[ScheduleSpec], bool]) -> str:
    """The registered schedules that satisfy ``predicate``, for a message's fix ("none" if none)."""
    from .registry import specs

    return ", ".join(sp.name for sp in specs() if predicate(sp)) or "none"


def _or_use(what: str, predicate: Callable[[ScheduleSpec], bool]) -> str:
    """", or use a schedule with <what> (names)" when one is registered, else nothing."""
    others = _names_where(predicate)
    return "" if others == "none" else f", or use a schedule with {what} ({others})"


def positive_sizes(spec: ScheduleSpec, s: Settings) -> str | None:
    """D and N (when known) are positive integers."""
    for name, value in ((s.naming.stages, s.stages), (s.naming.micro_batches, s.micro_batches)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{name} must be a positive integer, got {value!r}; use 1 or more"
    return None


def even_stages(reason: str) -> Rule:
    """The schedule places two pipelines in opposite directions on the same workers: D must be even."""

    def rule(spec: ScheduleSpec, s: Settings) -> str | None:
        if s.stages % 2 == 0:
            return None
        n = s.naming
        return (f"{spec.name} needs {n.stages} to be even ({reason}), got {n.stages} = {s.stages}; "
                f"use {n.stages} = {_even_near(s.stages)}{n.stages_note}")

    return rule


def micro_batches_at_least_stages(reason: str) -> Rule:
    """N ≥ D micro-batches per update."""

    def rule(spec: ScheduleSpec, s: Settings) -> str | None:
        if s.micro_batches is None or s.micro_batches >= s.stages:
            return None
        n = s.naming
        return (f"{spec.name} needs N ≥ D micro-batches per update ({reason}), got N = {s.micro_batches} "
                f"({n.micro_batches}) < D = {s.stages} ({n.stages}); {n.more_micro_batches}, or lower {n.stages}")

    return rule


def fixed_micro_batches(spec: ScheduleSpec, s: Settings) -> str | None:
    """A schedule that takes exactly ``spec.fixed_micro_batches`` micro-batches per update (PipeDream: 1)."""
    want = spec.fixed_micro_batches
    if want is None or s.micro_batches is None or s.micro_batches == want:
        return None
    n = s.naming
    per = "after every micro-batch" if want == 1 else f"every {want} micro-batches"
    return (f"{spec.name} updates the weights {per}, so N must be {want}, got N = {s.micro_batches} "
            f"({n.micro_batches}); "
            f"{n.exact_micro_batches.format(n=want, times='' if want == 1 else f'{want}·')}")


def pipelines_allowed(spec: ScheduleSpec, s: Settings) -> str | None:
    """``pipelines`` is one the schedule runs: its fixed count, or one of its choices for this D."""
    p, n, spec_p = s.pipelines, s.naming, spec.pipelines
    if p is None:
        return None
    if spec_p.choices is None:
        if p == spec_p.default:
            return None
        return (f"{spec.name} runs {spec_p.what}, got {n.pipelines} = {p}; leave {n.pipelines} unset "
                f"(or {spec_p.default}){_or_use('a choice of pipelines', lambda sp: sp.pipelines.choices is not None)}")
    valid = list(spec_p.choices(s.stages))
    if p in valid:
        return None
    return (f"{spec.name}: {n.pipelines} = {p} must be {spec_p.rule}, with {n.stages} = {s.stages}; "
            f"choose one of {valid}")


def concat_allowed(spec: ScheduleSpec, s: Settings) -> str | None:
    """``concat`` is a Chimera §3.5 method where the schedule has units to concatenate, else unset/direct."""
    from .generators import AUTO_CONCAT, CONCAT_METHODS

    c, n = s.concat, s.naming
    if spec.concat:
        if c is None or c in (*CONCAT_METHODS, AUTO_CONCAT):
            return None
        return f"{spec.name}: {n.concat} = {c!r} is not a concatenation method; use {CONCAT_RULE}"
    if c in (None, "direct"):
        return None
    others = _names_where(lambda sp: sp.concat)
    return (f"{n.concat} applies to schedules that concatenate units of micro-batches ({others}) only: "
            f"{spec.name} has none, got {n.concat} = {c}; drop {n.concat}")


def chunks_allowed(spec: ScheduleSpec, s: Settings) -> str | None:
    """``chunks`` (stages per worker) is the schedule's fixed count, or one the user may choose."""
    v, n, spec_v = s.chunks, s.naming, spec.chunks
    if v is None:
        return None
    if not spec_v.choosable:
        if v == spec_v.default:
            return None
        per = "one stage" if spec_v.default == 1 else f"{spec_v.default} stages"
        return (f"{spec.name} runs {per} per worker, got {n.chunks} = {v}; drop {n.chunks}"
                f"{_or_use('a choice of chunks per worker', lambda sp: sp.chunks.choosable)}")
    if isinstance(v, bool) or not isinstance(v, int) or v < spec_v.minimum:
        return (f"{spec.name}: {n.chunks} = {v!r} must be an integer ≥ {spec_v.minimum} (stages per worker); "
                f"use {n.chunks} = {max(spec_v.default, spec_v.minimum)}")
    return None


def steps_allowed(spec: ScheduleSpec, s: Settings) -> str | None:
    """``steps`` (windows shown back to back) applies to asynchronous schedules only."""
    if s.steps is None:
        return None
    n = s.naming
    if not spec.asynchronous:
        return (f"{n.steps} applies to asynchronous schedules only ({_names_where(lambda sp: sp.asynchronous)}: their "
                f"windows run without flushes), got {n.steps} = {s.steps} for {spec.name}; drop {n.steps}")
    if isinstance(s.steps, bool) or not isinstance(s.steps, int) or s.steps < 1:
        return f"{spec.name}: {n.steps} must be a positive number of optimizer steps, got {s.steps!r}; e.g. 3"
    return None


def stashed_versions(spec: ScheduleSpec, s: Settings) -> str | None:
    """An asynchronous schedule stashes weight versions per step: all-reduce at the end, no recomputation."""
    if not spec.asynchronous or (s.grad_sync, s.recompute) == ("end", "none"):
        return None
    n = s.naming
    return (f"{spec.name} stashes weight versions per step and runs with {n.grad_sync}=end and "
            f"{n.recompute}=none, got {n.grad_sync}={s.grad_sync} and {n.recompute}={s.recompute}; "
            "drop those settings")


def equal_rounds(spec: ScheduleSpec, s: Settings) -> str | None:
    """Interleaved 1F1B runs rounds of equal size: N a multiple of max(1, N // D) (torch's relaxation of
    Megatron-LM's N mod D = 0; :mod:`strategies.schedules.interleaved`)."""
    N, D = s.micro_batches, s.stages
    if N is None or N % max(1, N // D) == 0:
        return None

    def fits(m: int) -> bool:
        return m % max(1, m // D) == 0

    below = next(m for m in range(N - 1, 0, -1) if fits(m))
    above = next(m for m in range(N + 1, 2 * N + D) if fits(m))
    n = s.naming
    return (f"{spec.name} runs rounds of equal size: N must be a multiple of max(1, N // D) = {N // D} "
            f"(Megatron-LM: N a multiple of D), got N = {N} ({n.micro_batches}) with D = {D} ({n.stages}); "
            f"use N = {below} or N = {above}: {n.more_micro_batches}")


def micro_batches_at_least_twice_stages(reason: str) -> Rule:
    """N ≥ 2D micro-batches per step."""

    def rule(spec: ScheduleSpec, s: Settings) -> str | None:
        if s.micro_batches is None or s.micro_batches >= 2 * s.stages:
            return None
        n = s.naming
        return (f"{spec.name} needs N ≥ 2·D micro-batches per step ({reason}), got N = {s.micro_batches} "
                f"({n.micro_batches}) < 2·D = {2 * s.stages} ({n.stages} = {s.stages}); {n.more_micro_batches}, "
                f"lower {n.stages}{_or_use('no such bound', lambda sp: sp.name == 'zbv')}")

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
