"""Test grids read from the schedule registry (:mod:`pipeline_recipes.strategies.schedules.registry`).

A schedule registered with its :class:`ScheduleSpec` (and ``conf/strategy/<name>.yaml``) reaches the NCCL
replay, the runtime equivalence tests, the viewer and the planner tests through these functions, with no
list of names in a test file. Sizes come from the spec: its fields (``asynchronous``, ``chunks``,
``pipelines``, ``concat``, ``fixed_micro_batches``) and its rules, asked through the registry's
:func:`check`; options a user may choose are swept where the spec lets them be chosen (Chimera §3.5's
concatenation methods, §3.6's pipeline counts, interleaved chunks).
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline_recipes.strategies.schedules.registry import ScheduleError, ScheduleSpec, check, specs

CONCATS = ("direct", "forward_doubling", "backward_halving")  # Chimera §3.5 (auto resolves to one of them)
PIPELINES = (2, 4)  # the pipeline counts swept where a spec lets the user choose them
MAX_STAGES = 12  # a second chunk count is swept while v·D stays at most this (a toy model's layers)


def valid(spec: ScheduleSpec, D: int, N: int | None, **options: object) -> bool:
    """Whether the registry's rules accept ``spec`` at D stages (workers), N micro-batches and ``options``."""
    try:
        check(spec.name, D, N, **options)
    except ScheduleError:
        return False
    return True


def synchronous() -> tuple[ScheduleSpec, ...]:
    return tuple(s for s in specs() if not s.asynchronous)


def asynchronous() -> tuple[ScheduleSpec, ...]:
    return tuple(s for s in specs() if s.asynchronous)


def variants(spec: ScheduleSpec, D: int) -> list[dict[str, object]]:
    """The options a user may choose for ``spec`` at D, each valid combination once: ``pipelines`` from
    :data:`PIPELINES` where the spec offers choices, every concatenation method where it concatenates,
    chunks ``minimum`` and, while v·D ≤ :data:`MAX_STAGES`, ``minimum + 1`` where chunks are choosable; ``[{}]``
    (the defaults) for a schedule without choices."""
    choices = spec.pipelines.choices
    pipes: list[int | None] = [p for p in PIPELINES if p in tuple(choices(D))] if choices is not None else [None]
    concats: list[str | None] = list(CONCATS) if spec.concat else [None]
    chunks: list[int | None] = [None]
    if spec.chunks.choosable:
        least = spec.chunks.minimum
        chunks = [least, least + 1] if (least + 1) * D <= MAX_STAGES else [least]
    out = []
    for p in pipes:
        for c in concats:
            for v in chunks:
                options = {k: x for k, x in (("pipelines", p), ("concat", c), ("chunks", v)) if x is not None}
                if valid(spec, D, None, **options):
                    out.append(options)
    return out


def micro_batches(spec: ScheduleSpec, D: int, candidates: Iterable[int], **options: object) -> list[int]:
    """The valid values among ``candidates`` (sorted, once each); the spec's fixed N if it fixes one."""
    if spec.fixed_micro_batches:
        return [spec.fixed_micro_batches] if valid(spec, D, spec.fixed_micro_batches, **options) else []
    return [n for n in sorted(set(candidates)) if n >= 1 and valid(spec, D, n, **options)]


def smallest_valid_size(spec: ScheduleSpec, at_least: int = 2) -> tuple[int, int]:
    """(D, N): the least D ≥ ``at_least`` the spec accepts and its least valid N ≥ D (the spec's fixed N
    if it fixes one)."""
    for D in range(at_least, at_least + 16):
        ns = micro_batches(spec, D, range(D, 4 * D + 2)) if valid(spec, D, None) else []
        if ns:
            return D, ns[0]
    raise ValueError(f"{spec.name}: no valid size with D ≥ {at_least}")


# -- the grids ------------------------------------------------------------------------------------------

def replay_cases() -> list[tuple[str, int, int, dict[str, object]]]:
    """NCCL replay, synchronous schedules: D ∈ {2, 3, 4, 8}, N below, at and above D, every variant."""
    cases = []
    for spec in synchronous():
        for D in (2, 3, 4, 8):
            for options in variants(spec, D):
                for N in micro_batches(spec, D, (max(D // 2, 1), D, 2 * D + 1), **options):
                    cases.append((spec.name, D, N, options))
    return cases


def replica_cases() -> list[dict[str, object]]:
    """Synchronous schedules with replicas: D = 2, the least valid N ≥ D (W and options set by the test)."""
    cases = []
    for spec in synchronous():
        D, N = smallest_valid_size(spec, at_least=2)
        cases.append({"schedule": spec.name, "D": D, "N": N})
    return cases


def async_replay_cases() -> list[tuple[str, int, int]]:
    """NCCL replay, asynchronous schedules: D ∈ {2, 4}, N ∈ {1, D, D + 1} where the rules accept it."""
    return [(spec.name, D, N) for spec in asynchronous() for D in (2, 4)
            for N in micro_batches(spec, D, (1, D, D + 1))]


def equivalence_cases(world: int, D: int, candidates: Iterable[int]) -> list[dict[str, object]]:
    """Synchronous schedules against single-process SGD on ``world`` ranks at D stages (W = world / D
    replicas), default options, each N of ``candidates`` the rules accept; a schedule that accepts none of
    them runs at its least valid N ≥ D (DualPipeV's N ≥ 2D)."""
    candidates = tuple(candidates)
    cases = []
    for spec in synchronous():
        if world % D or not valid(spec, D, None):
            continue
        ns = micro_batches(spec, D, candidates) or micro_batches(spec, D, range(D, 4 * D + 2))[:1]
        cases += [{"schedule": spec.name, "D": D, "N": N} for N in ns]
    return cases


def async_equivalence_cases(steps: int = 8) -> list[dict[str, object]]:
    """Asynchronous schedules against their update rule on 4 ranks, ``steps`` steps (past the warm-up):
    W = 1 × D = 4 at the least valid N ≥ D, W = 2 × D = 2 at the least valid N > D (the spec's fixed N
    where it fixes one)."""
    cases = []
    for spec in asynchronous():
        for D, least in ((4, 4), (2, 3)):
            ns = micro_batches(spec, D, range(least, 4 * D + 2))
            if ns:
                cases.append({"schedule": spec.name, "D": D, "N": ns[0], "steps": steps})
    return cases


def viewer_cases() -> list[tuple[str, int, int, dict[str, object]]]:
    """The schedule viewer: every schedule at its least valid (D ≥ 3, N ≥ D) and each of its variants."""
    cases = []
    for spec in specs():
        D, N = smallest_valid_size(spec, at_least=3)
        for options in variants(spec, D):
            ns = micro_batches(spec, D, range(max(N, D), 4 * D + 2), **options)
            if ns:
                cases.append((spec.name, D, ns[0], options))
    return cases


def default_planner_schedules() -> set[str]:
    """The schedules the planner compares unless told otherwise: every one that is mini-batch SGD."""
    return {spec.name for spec in synchronous()}
