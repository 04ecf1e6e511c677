"""A TCP proxy that delays every byte by a fixed time in each direction: a simulated LAN.

Theory of operation
-------------------
Each accepted connection gets a :class:`_Side` for the client and one for the
upstream connection; each side forwards what it receives to its peer after
``delay`` seconds. A side keeps a FIFO of ``(due time, bytes)``; one timer
per side fires at the due time of the oldest entry, writes every entry that is
due, and rearms for the next. Order is kept because entries are appended in
arrival order and the delay is constant. Memory is bounded: when more than
``max_queued`` bytes wait in one direction, the proxy stops reading that
direction until the queue falls below half of it; when the peer's transport
asks to pause writing, the same happens. Closing either end closes the other
once its queue has been delivered.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import KW_ONLY, dataclass, field
from typing import Final, cast

DEFAULT_MAX_QUEUED: Final = 64 * 1024 * 1024


class _Side(asyncio.Protocol):
    """One end of a proxied connection: forwards its input, delayed, to ``peer``."""

    def __init__(self, delay: float, max_queued: int) -> None:
        self.delay = delay
        self.max_queued = max_queued
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._queued = 0
        self._timer: asyncio.TimerHandle | None = None
        self._eof = False
        self._reading_paused = False
        self._peer_blocked = False
        self._pending_input: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def attach(self, peer: _Side) -> None:
        """Start forwarding to ``peer`` (input that arrived earlier is delayed from now)."""
        self.peer = peer
        pending, self._pending_input = self._pending_input, []
        for data in pending:
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self._pending_input.append(data)
            return
        loop = asyncio.get_running_loop()
        self._queue.append((loop.time() + self.delay, data))
        self._queued += len(data)
        if self._timer is None:
            self._timer = loop.call_at(self._queue[0][0], self._flush)
        self._throttle()

    def eof_received(self) -> bool | None:
        self._eof = True
        if not self._queue:
            self._forward_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        if not self._queue:
            self._forward_eof()

    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer._peer_blocked = True
            self.peer._throttle()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer._peer_blocked = False
            self.peer._throttle()

    def _throttle(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        should_pause = self._peer_blocked or self._queued > self.max_queued
        if should_pause and not self._reading_paused:
            transport.pause_reading()
            self._reading_paused = True
        elif not should_pause and self._reading_paused and self._queued <= self.max_queued // 2:
            transport.resume_reading()
            self._reading_paused = False

    def _flush(self) -> None:
        self._timer = None
        peer = self.peer
        assert peer is not None
        loop = asyncio.get_running_loop()
        now = loop.time()
        out: list[bytes] = []
        while self._queue and self._queue[0][0] <= now:
            _, data = self._queue.popleft()
            self._queued -= len(data)
            out.append(data)
        if out and peer.transport is not None and not peer.transport.is_closing():
            peer.transport.write(b"".join(out))
        if self._queue:
            self._timer = loop.call_at(self._queue[0][0], self._flush)
        elif self._eof:
            self._forward_eof()
        self._throttle()

    def _forward_eof(self) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.transport.is_closing():
            peer.transport.close()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def close(self) -> None:
        """Drop the connection now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.close()


@dataclass(eq=False)
class DelayProxy:
    """Listens on ``host``, forwards to ``target``, delaying each direction by ``delay``."""

    target: tuple[str, int]
    delay: float
    _: KW_ONLY
    max_queued: int = DEFAULT_MAX_QUEUED
    _server: asyncio.Server | None = field(default=None, init=False, repr=False)
    _sides: set[_Side] = field(default_factory=set, init=False, repr=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start listening; return the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    def _accept(self) -> _Side:
        side = _Side(self.delay, self.max_queued)
        self._sides.add(side)
        task = asyncio.get_running_loop().create_task(self._connect_upstream(side))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return side

    async def _connect_upstream(self, client: _Side) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(
                lambda: _Side(self.delay, self.max_queued), *self.target
            )
        except OSError:
            client.close()
            self._sides.discard(client)
            return
        self._sides.add(upstream)
        upstream.attach(client)
        client.attach(upstream)

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        for task in list(self._tasks):
            task.cancel()
        for side in list(self._sides):
            side.close()
        self._sides.clear()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
