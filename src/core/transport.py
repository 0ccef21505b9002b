"""A lost peer, said one way for every transport: which rank, whether its connection closed (it exited, crashed or
was killed) or it stopped answering (nothing came within the timeout), and after how long.

The p2p rounds (:mod:`pipeline_recipes.strategies.runtime.p2p`) and the collectives (the gradient all-reduce, the
metrics all-gather: :mod:`pipeline_recipes.strategies.runtime.collectives`) raise the same errors with the same words
(:func:`peer_lost`); a p2p wait knows its peer, a collective asks which ranks of its group did not report the failure.

How, from gloo's words and the wait (the rule, :func:`lost_how`): gloo says ``Timed out waiting <n>ms for recv
operation to complete`` when the group's timeout ran out, and ``Connection closed by peer`` or ``Read error ...:
Connection reset by peer`` when the peer's process ended. A wait that ended at the timeout (90 % of it or more) is a
timeout even when gloo reports a closed connection: a rank whose own wait times out closes its connections, so its
peers see them close at the limit. An earlier error is a closed connection.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

CLOSED_CONNECTION_WORDS = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused",
                           "closed by peer", "ECONNRESET", "EPIPE")
TIMED_OUT_WORDS = ("Timed out waiting",)  # gloo: "Timed out waiting 4000ms for recv operation to complete"
AT_THE_LIMIT = 0.9  # a wait this close to the timeout was ended by it
TIMEOUT_SETTING = "strategy.timeout_s"
CLOSED, TIMED_OUT = "closed", "timed out"

_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\]\s*")  # gloo's "[.../gloo/transport/tcp/pair.cc:537] "
_ADVICE = ". This is typically caused by"  # gloo's advice after the cause


class PeerError(RuntimeError):
    """A peer could not be heard from: the consequence of its own failure, which the job names instead
    (``consequence``)."""

    consequence = True


class PeerTimeoutError(PeerError):
    """A peer did not deliver within the timeout: it hung, or one action takes longer than the timeout."""


class PeerClosedError(PeerError):
    """A peer's connection closed before it delivered: it exited, crashed or was killed."""


def connection_closed(err: BaseException) -> bool:
    """Whether ``err`` (a transport's error) says the peer's connection closed."""
    return any(word in str(err) for word in CLOSED_CONNECTION_WORDS)


def timed_out(err: BaseException) -> bool:
    """Whether ``err`` (a transport's error) says its wait ran out of time."""
    return any(word in str(err) for word in TIMED_OUT_WORDS)


def lost_how(err: BaseException | None, waited_s: float, limit_s: float) -> str:
    """:data:`CLOSED` or :data:`TIMED_OUT` (module docstring): the transport's words for a timeout, a wait that ended
    at the limit, or no error at all (the caller's own deadline) are a timeout; any other error is a closed
    connection."""
    if err is None or timed_out(err) or waited_s >= AT_THE_LIMIT * limit_s:
        return TIMED_OUT
    return CLOSED


def transport_said(err: BaseException) -> str:
    """The transport's message without gloo's source location and advice: ``Read error [10.0.0.2]:4312: Connection
    reset by peer``."""
    text = _SOURCE_LOCATION.sub("", str(err).strip())
    return text.split(_ADVICE, 1)[0].strip()


def peer_lost(peers: Sequence[int], rank: int, what: str, waited_s: float, limit_s: float,
              err: BaseException | None = None) -> PeerError:
    """The error that says ``rank`` lost ``peers`` (global ranks; empty: unknown) while it waited ``waited_s`` for
    ``what``: :class:`PeerClosedError` or :class:`PeerTimeoutError` by :func:`lost_how`, with the transport's words
    last. The caller raises it ``from err``."""
    names = " or ".join(f"rank {p}" for p in peers) or "a peer"
    detail = f" ({transport_said(err)})" if err is not None else ""
    if lost_how(err, waited_s, limit_s) == CLOSED:
        return PeerClosedError(
            f"the connection to {names} closed after {waited_s:.1f}s while rank {rank} waited for {what}: the peer "
            f"exited, crashed or was killed{detail}")
    return PeerTimeoutError(
        f"{names} stopped answering: rank {rank} waited {waited_s:.0f}s for {what}, the limit of {limit_s:.0f}s "
        f"({TIMEOUT_SETTING}); the peer hung, or one pipeline action takes longer than the timeout{detail}")
