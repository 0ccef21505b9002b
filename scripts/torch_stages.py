"""Torch's pipeline classes the benchmarks compare with, read from the schedule registry
(``ScheduleSpec.torch_class``), and the stages each rank holds under each: the placement of our schedule
that names the class (``scripts/bench.py``'s engine rows and ``scripts/bench_e2e.py``'s end-to-end rows read
this module). It imports nothing heavy (the registry is pure Python): ``bench.py``'s spawned ranks import it.
"""

from __future__ import annotations

from pipeline_recipes.strategies.schedules import build_schedule, get_spec, specs


def same_schedule() -> dict[str, str]:
    """Our schedule -> the ``torch.distributed.pipelining`` class that runs it, in registry order."""
    return {spec.name: spec.torch_class for spec in specs() if spec.torch_class is not None}


def torch_classes() -> tuple[str, ...]:
    """The torch classes the registry names, in registry order."""
    return tuple(same_schedule().values())


def stages_held(torch_class: str, rank: int, world: int) -> tuple[int, ...]:
    """The stage indices ``rank`` of ``world`` holds under ``torch_class``: those our schedule of the same
    class gives it (a loop for interleaved 1F1B, a V for ZBV and DualPipeV, one stage otherwise)."""
    name = {cls: ours for ours, cls in same_schedule().items()}[torch_class]
    spec = get_spec(name)
    schedule = build_schedule(name, world, 2 * world, chunks=spec.chunks.default if spec.chunks.choosable else None)
    placement = schedule.placement[0]
    return tuple(stage for stage in range(len(placement)) if placement[stage] == rank)
