"""Non-blocking, tagged point-to-point transfers of activations and activation gradients.

Sends are posted with ``isend`` and never block compute; a receive is posted when the data is
needed and waited with a timeout, so a schedule that validates cannot deadlock on gloo (which
deadlocks on blocking send-before-recv) and a dead peer ends the wait with an error instead of
a hang. Every message carries a tag unique within the step (gloo honours tags, so receives of
different sizes never match out of order). A tensor's shape travels in a small header only the
first time a (message kind, stage boundary, micro-batch shape) is seen; both sides key that
cache identically because every rank of a replica reads the same micro-batches.
"""

from __future__ import annotations

from collections.abc import Hashable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER_LEN = 10  # dtype code, ndim, up to 8 dims


class PeerTimeoutError(RuntimeError):
    """A peer did not deliver within the timeout: it crashed, hung or was killed."""


class Messenger:
    def __init__(self, device: torch.device, timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        self.device = device
        self.timeout = timeout
        self.group = group
        self._pending: list[dist.Work] = []
        self._keep_alive: list[Tensor] = []
        self._sent_shapes: set[Hashable] = set()
        self._known_shapes: dict[Hashable, tuple[torch.Size, torch.dtype]] = {}

    def send(self, tensor: Tensor, dst: int, tag: int, shape_key: Hashable) -> None:
        tensor = tensor.detach().contiguous()
        if shape_key not in self._sent_shapes:
            if tensor.dim() > _HEADER_LEN - 2:
                raise ValueError(f"cannot send a {tensor.dim()}-d tensor (at most {_HEADER_LEN - 2} dims)")
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
            header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
            header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            self._post_send(header, dst, 2 * tag + 1)
            self._sent_shapes.add(shape_key)
        self._post_send(tensor, dst, 2 * tag)

    def recv(self, src: int, tag: int, shape_key: Hashable) -> Tensor:
        if shape_key not in self._known_shapes:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            self._wait(dist.irecv(header, src, group=self.group, tag=2 * tag + 1), f"shape header from rank {src}")
            code, ndim, *dims = header.tolist()
            self._known_shapes[shape_key] = (torch.Size(dims[:ndim]), _DTYPES[code])
        shape, dtype = self._known_shapes[shape_key]
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(dist.irecv(buffer, src, group=self.group, tag=2 * tag), f"tensor (tag {tag}) from rank {src}")
        return buffer

    def flush(self) -> None:
        """Wait until every posted send has completed (end of step)."""
        for work in self._pending:
            self._wait(work, "a send to complete")
        self._pending.clear()
        self._keep_alive.clear()

    def _post_send(self, tensor: Tensor, dst: int, tag: int) -> None:
        self._keep_alive.append(tensor)
        self._pending.append(dist.isend(tensor, dst, group=self.group, tag=tag))

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            completed = work.wait(self.timeout)
        except RuntimeError as err:  # gloo raises on timeout or on a closed peer connection
            raise PeerTimeoutError(
                f"rank {dist.get_rank()} waited for {what} longer than {self.timeout.total_seconds():.0f}s "
                f"or the peer failed: {err}"
            ) from err
        if completed is False:
            raise PeerTimeoutError(f"rank {dist.get_rank()} timed out waiting for {what}")
