"""An in-process CallContext for exercising one handler without a socket.

It records what the handler sends (chunks per stream, pushed events) and feeds
it client chunks from queues. Integration tests drive the real daemon over
real sockets instead; this exists for handler-level unit tests.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

_END = object()


class LocalContext:
    """A CallContext that keeps everything in memory."""

    _next_connection = 0

    def __init__(self, call_id: int = 1, max_chunk: int = 64 * 1024) -> None:
        LocalContext._next_connection += 1
        self.call_id = call_id
        self.connection_id = LocalContext._next_connection
        self.max_chunk = max_chunk
        self.sent: dict[str, list[bytes]] = defaultdict(list)
        self.ended: set[str] = set()
        self.events: list[tuple[int, str, Any]] = []
        self.event_queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
        self._incoming: dict[str, asyncio.Queue[object]] = defaultdict(asyncio.Queue)
        self._on_close: list[Callable[[], Awaitable[None] | None]] = []

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        for start in range(0, len(data), self.max_chunk):
            self.sent[stream].append(bytes(data[start : start + self.max_chunk]))
        if end:
            self.ended.add(stream)
        await asyncio.sleep(0)

    def received(self, stream: str) -> bytes:
        """All bytes the handler sent on ``stream`` so far."""
        return b"".join(self.sent[stream])

    def feed(self, stream: str, data: bytes, *, end: bool = False) -> None:
        """Deliver client bytes on ``stream`` to the handler."""
        if data:
            self._incoming[stream].put_nowait(data)
        if end:
            self._incoming[stream].put_nowait(_END)

    async def receive(self, stream: str) -> AsyncIterator[bytes]:
        queue = self._incoming[stream]
        while True:
            item = await queue.get()
            if item is _END:
                return
            assert isinstance(item, bytes)
            yield item

    async def push_event(self, topic: int, name: str, data: Any) -> None:
        self.events.append((topic, name, data))
        self.event_queue.put_nowait((topic, name, data))

    def on_close(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        self._on_close.append(callback)

    async def close(self) -> None:
        """Simulate the connection closing: run the registered callbacks."""
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            result = callback()
            if inspect.isawaitable(result):
                await result
