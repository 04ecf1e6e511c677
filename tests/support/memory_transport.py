"""An in-memory transport pair: the asyncio glue of both ends, tested without sockets.

Modelled on httpcore's mock stream: each end is an ``asyncio.Transport`` whose
writes reach the other end's protocol on a later turn of the loop, through
the same ``get_buffer``/``buffer_updated`` calls a socket transport makes, in
pieces of at most ``piece`` bytes (so frames arrive split as they do over
TCP). Bytes written and not yet delivered count against a high-water mark:
past it the writer's protocol is paused, below the low-water mark it is
resumed, exactly as a socket transport's write buffer drives
``pause_writing``/``resume_writing``.
"""

from __future__ import annotations

import asyncio
from typing import Any


class MemoryTransport(asyncio.Transport):
    """One end of the pair; create both with :func:`connect_pair`."""

    def __init__(
        self, protocol: asyncio.BufferedProtocol, *, high: int, piece: int, name: str
    ) -> None:
        super().__init__()
        self._protocol = protocol
        self._peer: MemoryTransport | None = None
        self._loop = asyncio.get_running_loop()
        self._pending: list[bytes] = []
        self._buffered = 0
        self._high = high
        self._low = high // 4
        self._piece = piece
        self._paused = False
        self._closing = False
        self._lost = False
        self._name = name
        #: How many times the writer was told to pause.
        self.pauses = 0

    # -- asyncio.Transport ------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        chunk = bytes(data)
        if not self._pending:
            self._loop.call_soon(self._deliver)
        self._pending.append(chunk)
        self._buffered += len(chunk)
        if not self._paused and self._buffered > self._high:
            self._paused = True
            self.pauses += 1
            self._protocol.pause_writing()

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Deliver what was written, then end both sides (as a TCP close does)."""
        if self._closing:
            return
        self._closing = True
        if not self._pending:
            self._loop.call_soon(self._hang_up)

    def abort(self) -> None:
        self._pending.clear()
        self._closing = True
        self._loop.call_soon(self._hang_up)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": (self._name, 0), "sockname": (self._name, 0)}.get(name, default)

    def get_write_buffer_size(self) -> int:
        return self._buffered

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return not self._closing

    # -- moving bytes -----------------------------------------------------------

    def _deliver(self) -> None:
        peer = self._peer
        assert peer is not None
        pending, self._pending = self._pending, []
        for chunk in pending:
            view = memoryview(chunk)
            while view and not peer._lost:
                # get_buffer is typed as a read-only Buffer; the protocol hands out writable memory.
                buf = memoryview(peer._protocol.get_buffer(len(view)))
                size = min(len(buf), len(view), self._piece)
                buf[:size] = view[:size]
                view = view[size:]
                peer._protocol.buffer_updated(size)
            self._buffered -= len(chunk)
        if self._paused and self._buffered <= self._low:
            self._paused = False
            self._protocol.resume_writing()
        if self._closing:
            self._hang_up()

    def _hang_up(self) -> None:
        for end in (self, self._peer):
            if end is not None and not end._lost:
                end._lost = True
                end._closing = True
                end._protocol.connection_lost(None)


def connect_pair(
    client: asyncio.BufferedProtocol,
    server: asyncio.BufferedProtocol,
    *,
    high: int = 256 * 1024,
    piece: int = 16 * 1024,
) -> tuple[MemoryTransport, MemoryTransport]:
    """Join two protocols by memory and call ``connection_made`` on both (server first)."""
    to_server = MemoryTransport(client, high=high, piece=piece, name="client")
    to_client = MemoryTransport(server, high=high, piece=piece, name="server")
    to_server._peer, to_client._peer = to_client, to_server
    server.connection_made(to_client)
    client.connection_made(to_server)
    return to_server, to_client
