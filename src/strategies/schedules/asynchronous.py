"""Asynchronous schedules: PipeDream (Narayanan et al. 2019) and PipeDream-2BW (2020), Chimera Table 2.

Both run 1F1B *without flushes*: stage ``s`` keeps ``w_s = D - 1 - s`` micro-batches in flight and
the stream of forwards and backwards never drains between optimizer steps. Micro-batches are
numbered globally (step ``t`` owns ``t·N … t·N + N - 1``). Step ``t``'s *window* on a stage is its
stream from the forward of micro-batch ``t·N`` up to the forward of ``(t + 1)·N``: every forward
of step ``t`` and the backwards that interleave with them, some of an earlier step. A run of
``T`` windows plus the final drain is exactly DAPPLE over ``T·N`` micro-batches with no flush.

Weight versions (the rule the runtime executes):

* a micro-batch's forward and backward use the weights that were live when its step began
  (version ``t``); the backward reuses the forward's stashed version (weight stashing);
* at the end of step ``t`` stage ``s`` applies the gradient of version ``t - delay(s)``:
  PipeDream-2BW accumulates N ≥ D micro-batches and delays every stage by one step,
  ``w(t+1) = w(t) - ν·∇f(w(t-1))`` (two versions stashed, 2 Mθ); PipeDream updates after every
  micro-batch (N = 1) with the stage's own delay ``D - 1 - s`` (up to D versions, [Mθ, D·Mθ]).
"""

from __future__ import annotations

from .actions import Action, Schedule
from .simulate import Cost, simulate

ASYNC_SCHEDULES = ("pipedream_2bw", "pipedream")


def _check(name: str, stages: int, micro_batches: int, step: int = 0) -> None:
    for setting, value in (("stages", stages), ("micro_batches", micro_batches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {setting} must be a positive integer, got {value!r}; use 1 or more")
    if name in ASYNC_SCHEDULES:  # N per update: the schedule's rules, as its registry spec states them
        from .registry import check

        check(name, stages, micro_batches)
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"{name}: step must be a non-negative integer, got {step!r}")


def _window_of_stage(stage: int, stages: int, first: int, end: int) -> list[Action]:
    """Stage ``stage``'s no-flush 1F1B stream from the forward of ``first`` up to that of ``end``:
    the stream is F(0) … F(w-1) (warm-up, w = D - 1 - s), then F(m), B(m - w) for every m ≥ w."""
    warmup = stages - 1 - stage
    out: list[Action] = []
    for m in range(first, end):
        out.append(Action("F", 0, stage, (m,)))
        if m >= warmup:
            out.append(Action("B", 0, stage, (m - warmup,)))
    return out


def window(name: str, stages: int, micro_batches: int, step: int) -> Schedule:
    """The actions of optimizer step ``step`` on every stage (global micro-batch indices)."""
    _check(name, stages, micro_batches, step)
    first, end = step * micro_batches, (step + 1) * micro_batches
    workers = tuple(tuple(_window_of_stage(s, stages, first, end)) for s in range(stages))
    return Schedule(name, stages, micro_batches, (tuple(range(stages)),), workers,
                    meta={"step": step, "first_mb": first})


def run(name: str, stages: int, micro_batches: int, steps: int) -> Schedule:
    """``steps`` windows back to back plus the drain: one valid, finite schedule (to validate,
    simulate and draw); ``micro_batches`` of the result counts all ``steps·N`` micro-batches."""
    _check(name, stages, micro_batches)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{name}: steps must be a positive integer, got {steps!r}")
    total = steps * micro_batches
    workers = []
    for s in range(stages):
        stream = _window_of_stage(s, stages, 0, total)
        done = {a.mb for a in stream if a.kind == "B"}
        workers.append(tuple(stream) + tuple(Action("B", 0, s, (m,)) for m in range(total) if m not in done))
    return Schedule(name, stages, total, (tuple(range(stages)),), tuple(workers),
                    meta={"steps": steps, "micro_batches_per_step": micro_batches})


def weight_delay(name: str, stage: int, stages: int) -> int:
    """Steps between a version's forwards and the update that applies its gradient."""
    if name == "pipedream_2bw":
        return 1
    if name == "pipedream":
        return stages - 1 - stage
    raise ValueError(f"unknown asynchronous schedule {name!r}; choose one of {', '.join(ASYNC_SCHEDULES)}")


def version_of(micro_batch: int, micro_batches: int) -> int:
    """The weight version (step) a micro-batch's forward and backward use."""
    return micro_batch // micro_batches


def stashed_versions(name: str, stages: int, micro_batches: int, steps: int = 8) -> tuple[int, ...]:
    """Per stage, the most weight versions alive at once over ``steps`` steady steps: the live
    weights plus every older version an in-flight micro-batch still needs (Table 2's weight memory)."""
    peaks = []
    for s in range(stages):
        in_flight: set[int] = set()
        peak = 1
        for t in range(steps):
            for a in window(name, stages, micro_batches, t).workers[s]:
                if a.kind == "F":
                    in_flight.add(a.mb)
                else:
                    in_flight.discard(a.mb)
                versions = {version_of(m, micro_batches) for m in in_flight} | {t}
                peak = max(peak, len(versions))
        peaks.append(peak)
    return tuple(peaks)


def steady_step(name: str, stages: int, micro_batches: int) -> int:
    """The first step whose window looks like every later one (the fill is over)."""
    return -(-(stages - 1) // micro_batches) + 1


def steady_step_makespan(name: str, stages: int, micro_batches: int, t_f: Cost, t_b: Cost, *,
                         t_comm: float = 0.0) -> float:
    """Time one more step adds to the no-flush stream in steady state (one iteration's time)."""
    k = steady_step(name, stages, micro_batches)
    after = simulate(run(name, stages, micro_batches, k + 1), t_f, t_b, t_comm=t_comm).makespan
    return after - simulate(run(name, stages, micro_batches, k), t_f, t_b, t_comm=t_comm).makespan
