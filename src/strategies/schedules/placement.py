"""Stage → worker placements for schedules with several stages (chunks) per worker.

* Loop placement (interleaved 1F1B; Narayanan et al., "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", §2.2): ``S = v·P`` stages, stage ``s`` on worker
  ``s mod P``, so a micro-batch loops ``v`` times through the ``P`` workers.
* V placement (ZB-V; Qi et al., "Zero Bubble Pipeline Parallelism", §6, and DualPipeV; DeepSeek-V3
  Technical Report, §3.2.1): ``S = 2P`` stages, worker ``w`` holds stages ``w`` and ``2P − 1 − w``, so
  the first and the last stage share worker 0 and stages ``P − 1`` and ``P`` share worker
  ``P − 1`` (their messages stay local).
"""

from __future__ import annotations


def loop_placement(workers: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    """One pipeline of ``chunks·workers`` stages, stage ``s`` on worker ``s mod workers``."""
    return (tuple(s % workers for s in range(chunks * workers)),)


def v_placement(workers: int) -> tuple[tuple[int, ...], ...]:
    """One pipeline of ``2·workers`` stages in a V: worker ``w`` holds stages ``w`` and ``2P − 1 − w``."""
    return (tuple(s if s < workers else 2 * workers - 1 - s for s in range(2 * workers)),)
