"""The parent ends of a child's pipes: reading them as the event loop reports data, writing to them.

:class:`PipeReader` watches the nonblocking read end of a pipe with
``loop.add_reader`` and either hands each chunk to a synchronous sink or
queues it for an ``await read()`` consumer. A queueing reader stops watching
its descriptor while more than ``high_water`` bytes wait, so a slow consumer
blocks the child's writes instead of growing memory. :func:`write_all`
writes to a nonblocking pipe, waiting for room with ``loop.add_writer``.
"""

from __future__ import annotations

import asyncio
import os
import select
from collections import deque
from collections.abc import Callable

READ_SIZE = 64 * 1024
"""Bytes asked of ``os.read`` per readable event."""

HIGH_WATER = 256 * 1024
"""Bytes a queueing :class:`PipeReader` holds before it stops reading."""


class PipeReader:
    """The nonblocking read end of a pipe, watched by the event loop.

    With a ``sink``, every chunk is handed to it as it arrives and reading
    never pauses. Without one, chunks queue for :meth:`read`; while more than
    ``high_water`` bytes wait the descriptor is not watched, so the writer
    blocks instead of execd's memory growing.

    ``eof`` resolves when the writer side is closed everywhere (or the reader
    is closed). ``last_data`` is the loop time of the latest chunk.
    """

    __slots__ = (
        "_chunks",
        "_fd",
        "_high_water",
        "_loop",
        "_queued",
        "_sink",
        "_waiter",
        "_watching",
        "eof",
        "last_data",
    )

    def __init__(
        self,
        fd: int,
        *,
        sink: Callable[[bytes], None] | None = None,
        high_water: int = HIGH_WATER,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = fd
        self._sink = sink
        self._high_water = high_water
        self._chunks: deque[bytes] = deque()
        self._queued = 0
        self._waiter: asyncio.Future[None] | None = None
        self.eof: asyncio.Future[None] = self._loop.create_future()
        self.last_data = self._loop.time()
        self._watching = False
        self._watch()

    @property
    def queued(self) -> int:
        """Bytes read from the pipe and not yet taken by :meth:`read`."""
        return self._queued

    def _watch(self) -> None:
        if not self._watching and self._fd >= 0:
            self._loop.add_reader(self._fd, self._on_readable)
            self._watching = True

    def _unwatch(self) -> None:
        if self._watching:
            self._loop.remove_reader(self._fd)
            self._watching = False

    def _on_readable(self) -> None:
        try:
            data = os.read(self._fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        self.last_data = self._loop.time()
        if self._sink is not None:
            self._sink(data)
            return
        self._chunks.append(data)
        self._queued += len(data)
        if self._queued >= self._high_water:
            self._unwatch()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None:
            _resolve(self._waiter)

    async def read(self) -> bytes:
        """Everything queued so far (waiting for some), or ``b""`` at EOF."""
        while not self._chunks:
            if self._fd < 0:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._queued = 0
        self._watch()
        return data

    def writer_gone(self) -> bool:
        """Whether every write end is closed (data may still be unread)."""
        if self._fd < 0:
            return True
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return any(ev & select.POLLHUP for _, ev in poller.poll(0))

    def close(self) -> None:
        """Stop reading and close the descriptor; queued chunks stay readable."""
        if self._fd >= 0:
            self._unwatch()
            os.close(self._fd)
            self._fd = -1
        if not self.eof.done():
            self.eof.set_result(None)
        self._wake()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def write_all(fd: int, data: bytes | memoryview) -> bool:
    """Write ``data`` to the nonblocking pipe ``fd``; False if the reader left."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except (BlockingIOError, InterruptedError):
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_writer(fd, _resolve, ready)
            try:
                await ready
            finally:
                loop.remove_writer(fd)
            continue
        except (BrokenPipeError, ConnectionResetError):
            return False
        view = view[written:]
    return True
