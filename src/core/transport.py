"""How a transport error says that the peer's connection closed (it exited or was killed), as opposed to
the peer staying silent until the timeout: gloo's words for it."""

from __future__ import annotations

CLOSED_CONNECTION_WORDS = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused",
                           "closed by peer", "ECONNRESET", "EPIPE")


def connection_closed(err: BaseException) -> bool:
    """Whether ``err`` (a transport's error) says the peer's connection closed."""
    return any(word in str(err) for word in CLOSED_CONNECTION_WORDS)
