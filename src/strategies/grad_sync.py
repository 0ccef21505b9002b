"""Gradient synchronisation across stage copies (Chimera §3.2–3.3).

After the last backward, the gradients of every stage are summed over all its copies (the W
replicas, and for Chimera also the 2f pipelines) with one flat, non-blocking all-reduce per
stage, launched for all local stages before any is waited on (blocking all-reduces on
different groups could wait on each other). Losses are normalised over the whole mini-batch,
so the sum is the mini-batch gradient. Tied parameters (shared by the first and the last
stage) are summed over the tied group instead, so they get the gradient of both uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


class GradientSynchronizer:
    def __init__(
        self,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        stage_groups: Mapping[int, dist.ProcessGroup | None],
        tied_params: Sequence[nn.Parameter],
        tied_group: dist.ProcessGroup | None,
        timeout: timedelta,
    ) -> None:
        tied_ids = {id(p) for p in tied_params}
        self.buckets = {s: [p for p in ps if id(p) not in tied_ids] for s, ps in stage_params.items()}
        self.stage_groups = stage_groups
        self.tied_params = list(tied_params)
        self.tied_group = tied_group
        self.timeout = timeout

    def sync(self) -> None:
        launched: list[tuple[dist.Work, torch.Tensor, Sequence[nn.Parameter]]] = []
        for stage in sorted(self.buckets):
            group = self.stage_groups.get(stage)
            if group is not None and self.buckets[stage]:
                launched.append(self._launch(self.buckets[stage], group))
        if self.tied_group is not None and self.tied_params:
            launched.append(self._launch(self.tied_params, self.tied_group))
        for work, flat, params in launched:
            work.wait(self.timeout)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))
                offset += n

    @staticmethod
    def _launch(params: Sequence[nn.Parameter], group: dist.ProcessGroup):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), flat, params
