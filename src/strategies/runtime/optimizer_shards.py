"""Optimizer state sharded across every copy of a stage (``strategy.shard_optimizer``).

ZeRO's first stage ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", Rajbhandari et al.,
§5.1, P_os) applied to a pipeline's stage copies: every stage exists on the W replicas and, in Chimera, on its 2f
pipelines (Chimera §3.3), and each copy used to step a full optimizer. Here each gradient bucket of the synchroniser
(:mod:`pipeline_recipes.strategies.runtime.grad_sync`: a stage's parameters, or a Chimera worker's fused stages) has
one :class:`BucketShard`. Its parameters become views of one flat buffer, padded to a multiple of the group's size G;
rank i of the group owns the i-th of G equal slices. Per step:

1. the bucket's gradient is summed over the group into the owner's slice (a reduce-scatter), started where the
   all-reduce starts without sharding, under each ``grad_sync`` mode;
2. the optimizer holds, per parameter and rank, one *segment*: the part of the parameter inside the rank's slice, a
   ``Parameter`` that is a view of the flat buffer. It steps only those, so its state is 1/G of the bucket's plus
   the padding (less than G elements);
3. the slices are gathered into the flat buffer right after the optimizer step (an optimizer post-step hook), so
   every reader of the parameters (the next forward, evaluation, a checkpoint) sees the updated values.

Why flat buffers rather than what torch offers: ``ZeroRedundancyOptimizer`` partitions whole parameters (GPT-2's
tied embedding alone is a third of the model, so four copies cannot get under a third each) and expects gradients
all-reduced first; ``fully_shard`` (FSDP2) turns a stage's parameters into DTensors gathered around forwards, which
the executor's weight stashing and CUDA graphs do not expect. The synchroniser already keeps each bucket's gradients
in one flat buffer (gradient as bucket view), and Megatron's distributed optimizer shards the same way.

The collectives: NCCL runs the real ones, in place (``reduce_scatter_single`` into the rank's slice of the gradient
buffer, ``all_gather_single`` from the rank's slice of the parameter buffer). On gloo, torch 2.13's reduce-scatter
and all-gather took 1.7× the time of an all-reduce of the whole buffer (30 M floats, 2 ranks on a 2-core machine:
0.23 s and 0.24 s against 0.135 s), so gloo computes the same results another way: the gradient is summed whole
by an all-reduce (each rank reads its slice, bit for bit what an unsharded run steps on) and each rank's slice of
the parameters is broadcast from it (one broadcast per rank, all in flight together: 0.06 s for the same 30 M
floats).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def _reduce_scatter(*args: Any, **kwargs: Any) -> dist.Work:
    """``reduce_scatter_single``, torch 2.13's name for ``reduce_scatter_tensor`` (torch 2.11 has only the latter);
    looked up per call, so that a recording harness sees it."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def _all_gather(*args: Any, **kwargs: Any) -> dist.Work:
    """``all_gather_single`` (torch 2.13) or ``all_gather_into_tensor`` (earlier), looked up per call."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


@dataclass(frozen=True)
class Segment:
    """The part of ``param`` in this rank's slice: elements ``[start, stop)`` of the bucket's flat buffer; the
    optimizer steps ``shard`` (a view of those elements) instead of ``param``. ``offset``: where the segment starts
    inside the flattened parameter."""

    param: nn.Parameter
    shard: nn.Parameter
    start: int
    stop: int
    offset: int


class BucketShard:
    """One gradient bucket's parameters in a flat buffer sharded across ``group`` (see the module docstring).

    Constructing it moves the parameters into the buffer (each ``param.data`` becomes a view of it): do it before
    anything keeps their storage (the optimizer, compiled blocks, CUDA graphs)."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
        self.group, self.params = group, tuple(params)
        self.size, self.index = dist.get_world_size(group), dist.get_rank(group)
        self.gloo = dist.get_backend(group) == "gloo"
        numel = sum(p.numel() for p in params)
        self.padded = -(-numel // self.size) * self.size
        per = self.padded // self.size
        self.start, self.stop = self.index * per, (self.index + 1) * per
        first = params[0]
        self.flat = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        segments, offset = [], 0
        with torch.no_grad():
            for p in params:
                view = self.flat[offset: offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                lo, hi = max(offset, self.start), min(offset + p.numel(), self.stop)
                if lo < hi:
                    segments.append(Segment(p, nn.Parameter(self.flat[lo:hi]), lo, hi, lo - offset))
                offset += p.numel()
        self.segments: tuple[Segment, ...] = tuple(segments)

    def reduce(self, grads: Tensor) -> dist.Work:
        """Start summing the bucket's flat gradient ``grads`` over the group into this rank's slice."""
        if self.gloo:
            return dist.all_reduce(grads, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _reduce_scatter(grads[self.start: self.stop], grads, op=dist.ReduceOp.SUM, group=self.group,
                               async_op=True)

    def hand_over(self, grads: Tensor) -> None:
        """After :meth:`reduce`: each segment's gradient is its slice of ``grads``; a parameter that had no gradient
        this step leaves its segment without one (no update, as for an unsharded parameter)."""
        for s in self.segments:
            s.shard.grad = grads[s.start: s.stop] if s.param.grad is not None else None

    def drop_gradients(self) -> None:
        """No segment has a gradient (before a step, or a step whose update is skipped)."""
        for s in self.segments:
            s.shard.grad = None

    def gather(self) -> list[dist.Work]:
        """Start gathering every rank's slice of the parameters into the flat buffer (after the optimizer step)."""
        if self.gloo:  # each rank's slice broadcast from it, in place
            per = self.padded // self.size
            return [dist.broadcast(self.flat[i * per: (i + 1) * per], src=dist.get_global_rank(self.group, i),
                                   group=self.group, async_op=True) for i in range(self.size)]
        return [_all_gather(self.flat, self.flat[self.start: self.stop], group=self.group, async_op=True)]


def sharded_ids(shards: Sequence[BucketShard]) -> set[int]:
    """``id`` of every parameter whose optimizer state ``shards`` split (the rest are stepped whole)."""
    return {id(p) for shard in shards for p in shard.params}


def optimizer_groups(groups: Iterable[dict], shards: Sequence[BucketShard]) -> list[dict]:
    """Parameter groups for the optimizer of a sharded rank: each sharded parameter replaced by its segment on this
    rank (dropped where the rank holds none of it), every other parameter (a stage with a single copy) as it is.
    Every group is kept, also where it ends up empty, so that group indices line up across ranks and layouts."""
    segment_of = {id(s.param): s.shard for shard in shards for s in shard.segments}
    sharded = sharded_ids(shards)
    out = []
    for group in groups:
        params = [segment_of[id(p)] if id(p) in segment_of else p
                  for p in group["params"] if id(p) in segment_of or id(p) not in sharded]
        out.append({**group, "params": params})
    return out
