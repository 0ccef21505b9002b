"""Lightning's SIGTERM agreement, one step late, never waited for on the step's path.

Before every training step Lightning broadcasts rank 0's "received SIGTERM" flag over the world and
reads it on the host (``_TrainingEpochLoop._broadcast_sigterm_tensor``), so that every rank leaves at
the same step. That is one more blocking world collective per step, plus a device-to-host copy on
GPUs. Under a pipeline schedule the rank that ends every step (the first stage, GPipe §2 and 1F1B in
Chimera §2) pays its whole latency, and a blocking collective lines the stages up once more.

:class:`LateSigtermAgreement` posts the same broadcast without waiting, over a host (gloo) group,
and reads it one step later, when it has long completed: every rank still stops at the same step,
one step after rank 0 was signalled (Lightning then raises ``SIGTERMException`` as before).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException


class LateSigtermAgreement:
    """Callable replacing the epoch loop's per-step SIGTERM broadcast (see the module docstring).

    ``group``: a gloo group over the world (``None``: the default group, which must be gloo)."""

    def __init__(self, trainer: Any, group: dist.ProcessGroup | None = None) -> None:
        self.trainer, self.group = trainer, group
        self._in_flight: tuple[torch.Tensor, dist.Work] | None = None

    def __call__(self) -> None:
        flag = torch.tensor([1 if getattr(self.trainer, "received_sigterm", False) else 0])
        posted = (flag, dist.broadcast(flag, src=0, group=self.group, async_op=True))
        previous, self._in_flight = self._in_flight, posted
        if previous is not None and self._read(previous):
            self.finish()
            with contextlib.suppress(Exception):
                dist.barrier(group=self.group)  # as Lightning: every rank leaves together
            raise SIGTERMException()

    def finish(self) -> bool:
        """Wait for the broadcast in flight (at the end of training: no collective is left behind);
        whether it carried the signal."""
        posted, self._in_flight = self._in_flight, None
        return posted is not None and self._read(posted)

    @staticmethod
    def _read(posted: tuple[torch.Tensor, dist.Work]) -> bool:
        flag, work = posted
        work.wait()  # the group's timeout guards it
        return bool(flag.item())


def install_late_sigterm(trainer: Any) -> LateSigtermAgreement | None:
    """Put :class:`LateSigtermAgreement` in place of ``trainer``'s per-step SIGTERM broadcast; ``None``
    where there is nothing to replace (one process, or a Lightning without that method)."""
    loop = trainer.fit_loop.epoch_loop
    if not (dist.is_initialized() and dist.get_world_size() > 1 and hasattr(loop, "_broadcast_sigterm_tensor")):
        return None
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    agreement = LateSigtermAgreement(trainer, group)
    loop._broadcast_sigterm_tensor = agreement
    return agreement
