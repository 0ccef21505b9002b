"""Torch's pipeline classes the benchmarks compare with, and the stages each rank holds under each: the
placement our schedule of the same name uses (``scripts/bench.py``'s engine rows and ``scripts/bench_e2e.py``'s
end-to-end rows read this one table). It imports nothing heavy: ``bench.py``'s spawned ranks import it.
"""

from __future__ import annotations

from collections.abc import Callable

TORCH_STAGES: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    # torch.distributed.pipelining's class -> the stage indices rank r of P holds (the placement of ours)
    "ScheduleGPipe": lambda r, P: (r,),
    "Schedule1F1B": lambda r, P: (r,),
    "ScheduleInterleaved1F1B": lambda r, P: (r, r + P),  # loop placement, v = 2
    "ScheduleInterleavedZeroBubble": lambda r, P: (r,),  # ZB-H1 with one stage per rank
    "ScheduleZBVZeroBubble": lambda r, P: (r, 2 * P - 1 - r),  # V placement
    "ScheduleDualPipeV": lambda r, P: (r, 2 * P - 1 - r),
}
