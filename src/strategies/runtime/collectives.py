"""Waiting for a collective (the gradient all-reduce, the metrics all-gather) and naming the peer it lost.

gloo's error for a failed collective names no rank (``Connection reset by peer``, ``Timed out waiting 4000ms for
recv operation to complete``): every rank of a collective talks to several peers. A rank whose collective failed
so reports it in the job's store (the rendezvous store of the default process group, a TCP store: not the
collective's connections, which may be broken or hold half a message) and waits :data:`CHECK_IN_S` for the other
ranks of the group to report theirs; those that do not are the lost peers (dead, or hung before the collective). If
the store itself is gone before rank 0 reported, so is the process that held it: rank 0, unless torchrun's agent holds
it (a survivor that fails more than :data:`CHECK_IN_S` after rank 0 may find rank 0 gone for that reason alone, and
name it). The error is the p2p path's (:func:`pipeline_recipes.core.transport.peer_lost`): which rank, closed or timed
out, after how long.

A rank reports once per group: after a lost peer the job ends.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from pipeline_recipes.core.transport import PeerError, connection_closed, peer_lost, timed_out

CHECK_IN_S = 3.0  # how long a rank waits for the rest of the group to report the failure (survivors fail together)
_POLL_S = 0.05
_PREFIX = "pipeline_recipes/lost_peer"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # torchrun: its agent, not rank 0, holds the store


def wait_collective(work: dist.Work, group: dist.ProcessGroup | None, what: str, started: float,
                    timeout: timedelta | None = None) -> None:
    """Wait for ``work`` (a collective on ``group``, started at ``time.monotonic()`` = ``started``); a lost peer
    (gloo's words for a closed connection or a timeout) raises :class:`pipeline_recipes.core.transport.PeerError`
    naming it. ``timeout``: the group's (read from the group when None)."""
    try:
        work.wait()
    except RuntimeError as err:
        if not (connection_closed(err) or timed_out(err)):
            raise
        raise lost_in_collective(group, what, time.monotonic() - started, timeout, err) from err


def lost_in_collective(group: dist.ProcessGroup | None, what: str, waited_s: float, timeout: timedelta | None,
                       err: BaseException) -> PeerError:
    """The error for ``err``, a failed collective on ``group`` that this rank waited ``waited_s`` for: the ranks
    that did not report the failure (:func:`missing_peers`), closed or timed out, after how long."""
    limit = (timeout or group_timeout(group)).total_seconds()
    rank = dist.get_rank()
    return peer_lost(missing_peers(group, rank), rank, what, waited_s, limit, err)


def missing_peers(group: dist.ProcessGroup | None, rank: int, wait_s: float = CHECK_IN_S) -> list[int]:
    """The global ranks of ``group`` that did not report a failed collective within ``wait_s`` after this one did
    (module docstring); empty when every rank reported or none could be told apart."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    others = [r for r in ranks if r != rank]
    seen: set[int] = set()
    try:
        # the default group's store: torch keeps no public handle on it
        store = dist.PrefixStore(f"{_PREFIX}/{'-'.join(map(str, ranks))}/",
                                 dist.distributed_c10d._get_default_store())
        store.set(str(rank), "failed")
        deadline = time.monotonic() + wait_s
        while True:
            seen |= {r for r in others if r not in seen and store.check([str(r)])}
            if len(seen) == len(others) or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
    except RuntimeError:  # DistNetworkError (Broken pipe, connection reset): the store's process ended
        host = None if os.environ.get(AGENT_STORE_ENV, "").lower() in ("1", "true") else 0
        if host in others and host not in seen:
            return [host]
    return [r for r in others if r not in seen]


def group_timeout(group: dist.ProcessGroup | None) -> timedelta:
    """The timeout ``group`` was created with (torch keeps it on the group's backend's options), else torch's
    default."""
    try:
        backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout
