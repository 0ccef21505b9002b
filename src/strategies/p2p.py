"""Non-blocking, tagged point-to-point transfers of activations and activation gradients.

Sends are posted with ``isend`` and never block compute (where the backend reports completion,
as NCCL does, completed sends are released as new ones are posted; gloo's stay until the end of
the step). Receives can be posted ahead of need (:meth:`Messenger.post_recv`: the executor
pre-posts the inputs of its next actions) and are waited with a timeout when the data is needed,
so transfers overlap compute, a schedule that validates cannot deadlock on gloo (which deadlocks
on blocking send-before-recv) and a dead peer ends the wait with an error instead of a hang.

Every message carries a tag unique within the step (gloo honours tags, so receives of different
sizes never match out of order). A tensor's shape travels in a small header only the first time
a (message kind, stage boundary, micro-batch shape) is seen; both sides key that cache
identically because every rank of a replica reads the same micro-batches.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER_LEN = 10  # dtype code, ndim, up to 8 dims


class PeerTimeoutError(RuntimeError):
    """A peer did not deliver within the timeout: it crashed, hung or was killed."""


@dataclass
class PendingRecv:
    """A posted (or, until its shape is known, announced) receive."""

    src: int
    tag: int
    shape_key: Hashable
    header: Tensor | None = None
    header_work: dist.Work | None = None
    buffer: Tensor | None = None
    work: dist.Work | None = None
    received: bool = False  # waited once (gloo: a second wait on the same receive would wait for another)


class Messenger:
    def __init__(self, device: torch.device, timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        self.device = device
        self.timeout = timeout
        self.group = group
        self._pending: list[dist.Work] = []
        self._keep_alive: list[Tensor] = []
        self._sent_shapes: set[Hashable] = set()
        self._known_shapes: dict[Hashable, tuple[torch.Size, torch.dtype]] = {}
        self._header_posted: set[Hashable] = set()

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
        """Receive now (posting the receive if :meth:`post_recv` did not already)."""
        return self.wait_recv(self.post_recv(src, tag, shape_key))

    def post_recv(self, src: int, tag: int, shape_key: Hashable) -> PendingRecv:
        """Post the receive of message ``tag`` from ``src`` now; wait for it with :meth:`wait_recv`.

        With the shape known (every message after the first of its kind) the data receive is
        posted at once; otherwise the header receive is posted (once per shape key) and the data
        receive follows when the header has arrived.
        """
        pending = PendingRecv(src, tag, shape_key)
        if shape_key in self._known_shapes:
            self._post_data(pending)
        elif shape_key not in self._header_posted:
            pending.header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            pending.header_work = dist.irecv(pending.header, src, group=self.group, tag=2 * tag + 1)
            self._header_posted.add(shape_key)
        return pending

    def wait_recv(self, pending: PendingRecv) -> Tensor:
        """The received tensor (waiting again for one already received returns at once)."""
        if not pending.received:
            self.post_data(pending)
            self._wait(pending.work, f"tensor (tag {pending.tag}) from rank {pending.src}")
            pending.received = True
        return pending.buffer

    def post_data(self, pending: PendingRecv) -> None:
        """Make sure the data receive is posted, first waiting for the shape header if it came with
        one (a receive that must be posted before a step ends: its sender completes only then)."""
        if pending.work is not None:
            return
        if pending.header_work is not None:
            self._wait(pending.header_work, f"shape header from rank {pending.src}")
            code, ndim, *dims = pending.header.tolist()  # once per shape key
            self._known_shapes[pending.shape_key] = (torch.Size(dims[:ndim]), _DTYPES[code])
        if pending.shape_key not in self._known_shapes:
            raise RuntimeError(f"shape of {pending.shape_key} unknown: its first message was never waited")
        self._post_data(pending)

    def _post_data(self, pending: PendingRecv) -> None:
        shape, dtype = self._known_shapes[pending.shape_key]
        pending.buffer = torch.empty(shape, dtype=dtype, device=self.device)
        pending.work = dist.irecv(pending.buffer, pending.src, group=self.group, tag=2 * pending.tag)

    def flush(self) -> None:
        """Wait until every posted send has completed (end of step)."""
        for work in self._pending:
            self._wait(work, "a send to complete")
        self._pending.clear()
        self._keep_alive.clear()

    def _post_send(self, tensor: Tensor, dst: int, tag: int) -> None:
        if len(self._pending) >= 4:  # release completed sends and their tensors (gloo reports a send
            # completed only once waited, so there they live until flush; NCCL releases them here)
            still = [i for i, work in enumerate(self._pending) if not work.is_completed()]
            self._pending = [self._pending[i] for i in still]
            self._keep_alive = [self._keep_alive[i] for i in still]
        self._keep_alive.append(tensor)
        self._pending.append(dist.isend(tensor, dst, group=self.group, tag=tag))

    def _wait(self, work: dist.Work, what: str) -> None:
        limit = f"{self.timeout.total_seconds():.0f}s (strategy.timeout_s)"
        hint = "the peer hung, crashed or was killed, or one pipeline action takes longer than the timeout"
        try:
            completed = work.wait(self.timeout)
        except RuntimeError as err:  # gloo raises on timeout or on a closed peer connection
            raise PeerTimeoutError(f"rank {dist.get_rank()} waited for {what} longer than {limit}: {hint} ({err})") from err
        if completed is False:
            raise PeerTimeoutError(f"rank {dist.get_rank()} waited for {what} longer than {limit}: {hint}")
