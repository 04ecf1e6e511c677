"""What the kit talks to: a target that opens links, a link that carries bytes.

A :class:`Target` is a server to test: :class:`protocol.fuzz.live.SocketTarget`
(any implementation of PROTOCOL.md over TCP) or
:class:`protocol.fuzz.loopback.LoopbackTarget` (the sans-I/O
:class:`~protocol.connection.ServerConnection`, in this process). A
:class:`Link` is one connection to it. Everything above this module (the probe,
the cases, the state machine) is written against these two interfaces only.
"""

from __future__ import annotations

from typing import Protocol


class LinkClosed(Exception):
    """The peer is gone: a write could not be delivered."""


class Link(Protocol):
    """One connection: bytes in, bytes out."""

    def send(self, data: bytes) -> None:
        """Write ``data``; raises :class:`LinkClosed` when the peer has gone."""
        ...

    def recv(self, timeout: float) -> bytes | None:
        """Bytes received within ``timeout`` seconds: ``b""`` at end of stream, None if none came."""
        ...

    def close(self, reset: bool = False) -> None:
        """Close the connection (``reset``: abortively, so the peer sees a reset)."""
        ...


class Target(Protocol):
    """A server under test."""

    #: How reports name the target (``127.0.0.1:7001``, ``loopback``).
    name: str

    def connect(self) -> Link:
        """A new connection; raises ``OSError`` when the server cannot be reached."""
        ...
