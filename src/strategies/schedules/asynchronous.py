"""Asynchronous schedules: PipeDream (Narayanan et al. 2019) and PipeDream-2BW (2020), Chimera Table 2.

Both run 1F1B *without flushes*: stage ``s`` keeps ``w_s = D - 1 - s`` micro-batches in flight and
the stream of forwards and backwards never drains between optimizer steps. Micro-batches are
numbered globally (step ``t`` owns ``t·N … t·N + N - 1``). Step ``t``'s *window* on a stage is its
stream from the forward of micro-batch ``t·N`` up to the forward of ``(t + 1)·N``: every forward
of step ``t`` and the backwards that interleave with them, some of an earlier step. A run of
``T`` windows plus the final drain is exactly DAPPLE over ``T·N`` micro-batches with no flush: both
are slices of one 1F1B order (:func:`~pipeline_recipes.strategies.schedules.one_f_one_b.one_f_one_b`).
The order is defined for any N; how many micro-batches an update takes (PipeDream: 1, PipeDream-2BW:
N ≥ D) is each schedule's rule in the registry, checked before the runtime asks for a window.

Weight versions (the rule the runtime executes):

* a micro-batch's forward and backward use the weights that were live when its step began
  (version ``t``); the backward reuses the forward's stashed version (weight stashing);
* at the end of step ``t`` stage ``s`` applies the gradient of version ``t - delay(s)``:
  PipeDream-2BW accumulates N ≥ D micro-batches and delays every stage by one step,
  ``w(t+1) = w(t) - ν·∇f(w(t-1))`` (two versions stashed, 2 Mθ); PipeDream updates after every
  micro-batch (N = 1) with the stage's own delay ``D - 1 - s`` (up to D versions, [Mθ, D·Mθ]).
"""

from __future__ import annotations

from pipeline_recipes.strategies.schedules.actions import Action, Schedule
from pipeline_recipes.strategies.schedules.one_f_one_b import numbered, one_f_one_b
from pipeline_recipes.strategies.schedules.rules import check_size, check_sizes
from pipeline_recipes.strategies.schedules.simulate import Cost, simulate


def _check(name: str, stages: int, micro_batches: int, step: int = 0) -> None:
    check_sizes(name, stages, micro_batches)
    check_size(name, "step", step, 0)


def _stream(stage: int, stages: int, micro_batches: int, *, drain: bool) -> list[Action]:
    """Stage ``stage``'s 1F1B stream over micro-batches ``0 … micro_batches − 1`` with warm-up
    w = D − 1 − s: F(0) … F(w − 1), then F(m), B(m − w) for every m ≥ w, then (``drain``) the rest."""
    def on_stage(_: int) -> int:
        return stage

    return one_f_one_b(numbered("F", on_stage, micro_batches, 0), numbered("B", on_stage, micro_batches, 0),
                       warmup=stages - 1 - stage, cool_down=drain)


def _window_of_stage(stage: int, stages: int, first: int, end: int) -> list[Action]:
    """Stage ``stage``'s no-flush 1F1B stream from the forward of ``first`` up to that of ``end``."""
    stream = _stream(stage, stages, end, drain=False)
    return stream[stream.index(Action("F", 0, stage, (first,))):]


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
    check_size(name, "steps", steps)
    total = steps * micro_batches
    workers = [tuple(_stream(s, stages, total, drain=True)) for s in range(stages)]
    return Schedule(name, stages, total, (tuple(range(stages)),), tuple(workers),
                    meta={"steps": steps, "micro_batches_per_step": micro_batches})


def weight_delay(name: str, stage: int, stages: int) -> int:
    """Steps between a version's forwards and the update that applies its gradient."""
    if name == "pipedream_2bw":
        return 1
    if name == "pipedream":
        return stages - 1 - stage
    raise ValueError(f"unknown asynchronous schedule {name!r}; choose pipedream_2bw or pipedream (the registry's "
                     "asynchronous schedules)")


def version_of(micro_batch: int, micro_batches: int) -> int:
    """The weight version (step) a micro-batch's forward and backward use."""
    return micro_batch // micro_batches


def stashed_versions(name: str, stages: int, micro_batches: int, steps: int = 8) -> tuple[int, ...]:
    """Per stage, the most weight versions alive at once over ``steps`` steady steps: the live
    weights plus every older version an in-flight micro-batch still needs (Table 2's weight memory)."""
    _check(name, stages, micro_batches)
    check_size(name, "steps", steps)
    peaks = []
    for s in range(stages):  # the windows of steps 0 … steps − 1 are one stream, cut at each step's first forward
        in_flight: set[int] = set()
        peak, step = 1, 0
        for a in _stream(s, stages, steps * micro_batches, drain=False):
            if a.kind == "F":
                step = version_of(a.mb, micro_batches)
                in_flight.add(a.mb)
            else:
                in_flight.discard(a.mb)
            peak = max(peak, len({version_of(m, micro_batches) for m in in_flight} | {step}))
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
