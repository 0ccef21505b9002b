"""Point-to-point transport of activations and activation gradients, one round at a time.

:mod:`pipeline_recipes.strategies.schedules.comm` decides which messages go out together around each action; this
module moves them. Each round's sends and receives are issued as one ``dist.batch_isend_irecv`` on
a process group that carries nothing but this pipeline replica's p2p traffic (torch.distributed.pipelining
and Megatron do the same), so under NCCL both directions of a round progress together and no
collective queues behind a receive.

Messages carry no tags: NCCL ignores them and matches each ordered pair first in, first out, and
the rounds post every pair's messages in that order, so gloo (on CPU) matches exactly as NCCL
does and the CPU tests exercise the GPU's matching rules.

A receiver must know a message's shape and dtype before posting it. The executor learns them once
per micro-batch shape, before the step's first round (a no-grad forward of one micro-batch through
the stages, whose output shapes travel in small headers over a separate gloo group, on the host:
:meth:`PipeComm.announce` and :meth:`PipeComm.learn`); activation gradients have their activations'
shapes. Rounds themselves never wait on the host.

Waiting: on a GPU a receive is waited stream-ordered (the compute stream waits for it; the host
does not block), and the process group's timeout is the hang guard; :meth:`PipeComm.finish` ends
each step by waiting for every transfer with the same timeout on the host, naming the peer that
stopped answering. On CPU (gloo) waits block the host, bounded by the group's timeout. With CUDA
tensors on a gloo group (several ranks sharing one GPU, for testing) messages are staged through
the host.

Idle host time: where a host wait would block (gloo, the receive not complete yet), the rank has
nothing to compute until the peer delivers, a pipeline bubble (GPipe §2): :meth:`PipeComm.would_block`
tells the executor, which runs host work there (the next step's batch, :mod:`pipeline_recipes.strategies.runtime.fetch_ahead`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from pipeline_recipes.core.transport import PeerClosedError, PeerError, PeerTimeoutError, peer_lost
from torch import Tensor

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER_LEN = 10  # dtype code, ndim, up to 8 dims
_POLL_S = 0.001


__all__ = ["Incoming", "Outgoing", "PeerClosedError", "PeerError", "PeerTimeoutError", "PipeComm", "PostedRound",
           "replica_groups"]  # the peer errors are said once, for every transport (pipeline_recipes.core.transport)


@dataclass
class Outgoing:
    """A tensor to send to global rank ``peer``."""

    peer: int
    tensor: Tensor
    label: Hashable = None  # what the message is (error messages, recordings)


@dataclass
class Incoming:
    """A receive from global rank ``peer``; ``buffer`` holds the tensor once its round is waited."""

    peer: int
    shape: torch.Size
    dtype: torch.dtype
    label: Hashable = None
    buffer: Tensor | None = None
    round: PostedRound | None = None


@dataclass
class PostedRound:
    """The works of one round, the tensors they must keep alive, and who is on the other side."""

    works: list[dist.Work]
    peers: tuple[int, ...]
    recv_peers: tuple[int, ...]
    sends: int = 0  # the first ``sends`` works are the sends (when there is one work per op)
    keep_alive: list[Tensor] = field(default_factory=list)
    staged: list[tuple[Incoming, Tensor]] = field(default_factory=list)  # host buffer → device buffer
    ops: int = 0
    step: int = 0  # which step (finish() call) posted it
    received: bool = False  # the receives were waited (on gloo a second wait would wait for another message)
    waited: bool = False  # every work was waited

    def receive_works(self, ops: int) -> list[dist.Work]:
        """The works to wait for the receives: their own, or all when the backend coalesced the batch."""
        return self.works[self.sends:] if len(self.works) == ops else self.works


class PipeComm:
    """One rank's p2p transport: rounds on the data group, shape headers on the host group."""

    def __init__(self, device: torch.device, timeout: timedelta, data_group: dist.ProcessGroup | None,
                 header_group: dist.ProcessGroup | None) -> None:
        self.device = device
        self.timeout = timeout
        self.data_group = data_group
        self.header_group = header_group
        backend = dist.get_backend(data_group)
        self.stream_ordered = backend == "nccl"  # waits enqueue on the device; the host goes on
        self.staged = device.type != "cpu" and backend == "gloo"
        self._posted: list[PostedRound] = []
        self._step = 0
        self._header_sends: list[tuple[dist.Work, Tensor, int]] = []

    # -- rounds ---------------------------------------------------------------------------------

    def post(self, sends: Sequence[Outgoing], recvs: Sequence[Incoming]) -> PostedRound | None:
        """Post one round: every send and receive in one batch."""
        if not sends and not recvs:
            return None
        ops: list[dist.P2POp] = []
        posted = PostedRound([], tuple(sorted({o.peer for o in sends} | {i.peer for i in recvs})),
                             tuple(sorted({i.peer for i in recvs})))
        for out in sends:
            tensor = out.tensor.detach().contiguous()
            if self.staged:
                tensor = tensor.cpu()
            posted.keep_alive.append(tensor)
            ops.append(dist.P2POp(dist.isend, tensor, out.peer, group=self.data_group))
        for inc in recvs:
            buffer = torch.empty(inc.shape, dtype=inc.dtype, device="cpu" if self.staged else self.device)
            if self.staged:
                posted.staged.append((inc, buffer))
            else:
                inc.buffer = buffer
            inc.round = posted
            ops.append(dist.P2POp(dist.irecv, buffer, inc.peer, group=self.data_group))
        posted.sends, posted.step = len(sends), self._step
        posted.works = dist.batch_isend_irecv(ops)
        posted.ops = len(ops)
        self._posted.append(posted)
        return posted

    def wait(self, inc: Incoming) -> Tensor:
        """The received tensor; waits for its round (stream-ordered on NCCL, on the host on gloo)."""
        posted = inc.round
        if posted is None:
            raise RuntimeError(f"receive from rank {inc.peer} was never posted")
        self._receive(posted)
        if inc.buffer is None:
            raise RuntimeError(f"receive from rank {inc.peer} has no buffer after its round")
        return inc.buffer

    def would_block(self, inc: Incoming) -> bool:
        """Whether :meth:`wait` would block the host now: gloo, and the receive has not completed yet."""
        posted = inc.round
        return (posted is not None and not posted.received and not self.stream_ordered
                and not all(work.is_completed() for work in posted.receive_works(posted.ops)))

    def finish(self, keep_open: bool = False) -> None:
        """End a step: wait until every posted round has completed, at most the timeout. With
        ``keep_open`` (an asynchronous window) this step's rounds stay open and the previous step's
        are waited instead: its last sends complete only when the neighbours reach the end of their
        windows, and waiting for them now would line the stages up again."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        settle = [p for p in self._posted if not keep_open or p.step < self._step]
        for posted in settle:
            if self.stream_ordered:  # poll the events: no device-wide synchronisation, a bounded wait
                while not all(work.is_completed() for work in posted.works):
                    if time.monotonic() > deadline:
                        self._peer_failed(posted.peers, "its pipeline messages of this step",
                                          self.timeout.total_seconds())
                    time.sleep(_POLL_S)
            self._complete(posted, posted.peers)
        self._posted = [p for p in self._posted if p not in settle]
        self._step += 1
        for work, _, peer in self._header_sends:
            self._wait_work(work, (peer,))
        self._header_sends.clear()

    # -- shapes (host side) ------------------------------------------------------------------------

    def announce(self, peer: int, shape: torch.Size, dtype: torch.dtype, what: str) -> None:
        """Tell ``peer`` a shape and dtype (gloo, never blocking: waited in :meth:`finish`)."""
        if len(shape) > _HEADER_LEN - 2:
            raise ValueError(f"cannot send a {len(shape)}-d tensor (at most {_HEADER_LEN - 2} dims)")
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(dtype), len(shape)
        header[2: 2 + len(shape)] = torch.tensor(list(shape), dtype=torch.int64)
        self._header_sends.append((dist.isend(header, peer, group=self.header_group), header, peer))

    def learn(self, peer: int, what: str) -> tuple[torch.Size, torch.dtype]:
        """The shape and dtype ``peer`` announces next (blocks the host, at most the timeout)."""
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        since = time.monotonic()
        try:
            dist.irecv(header, peer, group=self.header_group).wait()
        except RuntimeError as err:  # gloo: the group's timeout, or a closed connection
            self._peer_failed((peer,), f"the shape of {what}", time.monotonic() - since, err)
        code, ndim, *dims = header.tolist()
        return torch.Size(dims[:ndim]), _DTYPES[code]

    # -- waiting ----------------------------------------------------------------------------------

    def _receive(self, posted: PostedRound) -> None:
        """Wait for a round's receives once; its sends complete on their own (waited in :meth:`finish`),
        so a rank never waits for a peer to take what it sent before computing on what it got."""
        if posted.received:
            return
        for work in posted.receive_works(posted.ops):
            self._wait_work(work, posted.recv_peers or posted.peers)
        for inc, host_buffer in posted.staged:
            inc.buffer = host_buffer.to(self.device)
        posted.received = True

    def _complete(self, posted: PostedRound, peers: Sequence[int]) -> None:
        """Wait for every work of a round once: the receives (if not yet), then the sends."""
        if posted.waited:
            return
        coalesced = len(posted.works) != posted.ops
        if not posted.received:
            self._receive(posted)
        if not coalesced:
            for work in posted.works[: posted.sends]:
                self._wait_work(work, peers)
        posted.waited = True

    def _wait_work(self, work: dist.Work, peers: Sequence[int]) -> None:
        since = time.monotonic()
        try:
            work.wait()  # NCCL: stream-ordered; gloo: blocks the host up to the group's timeout
        except RuntimeError as err:
            self._peer_failed(peers, "a pipeline message", time.monotonic() - since, err)

    def _peer_failed(self, peers: Sequence[int], what: str, waited_s: float, err: BaseException | None = None) -> None:
        """Raise :class:`PeerClosedError` (the connection closed: the peer exited or was killed) or
        :class:`PeerTimeoutError` (nothing came within the timeout), saying after how long
        (:func:`pipeline_recipes.core.transport.peer_lost`, the words every transport uses)."""
        raise peer_lost(peers, dist.get_rank(), what, waited_s, self.timeout.total_seconds(), err) from err



def replica_groups(replica_ranks: Sequence[Sequence[int]], rank: int, timeout: timedelta
                   ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's (data, header) p2p groups: one pair per pipeline replica, created in the same
    order on every rank. Headers always go over gloo (host-side shape exchange)."""
    backend = dist.get_backend()
    header_backend = None if backend in ("gloo", "fake") else "gloo"
    mine: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)
    for ranks in replica_ranks:
        data = dist.new_group(list(ranks), timeout=timeout)
        header = dist.new_group(list(ranks), timeout=timeout, backend=header_backend)
        if rank in ranks:
            mine = (data, header)
    return mine
