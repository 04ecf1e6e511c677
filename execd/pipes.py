"""The parent ends of a child's pipes: reading them as the event loop reports data, writing to them.

:class:`PipeReader` watches the nonblocking read end of a pipe through
:class:`Readiness` (one epoll instance per event loop, which the loop
watches, for the descriptors of children that come and go: a child's pipes
and its pidfd) and either hands each chunk to a synchronous sink or
queues it for an ``await read()`` consumer. A queueing reader stops watching
its descriptor while more than ``high_water`` bytes wait, so a slow consumer
blocks the child's writes instead of growing memory. :func:`write_all`
writes to a nonblocking pipe, waiting for room with ``loop.add_writer``.
"""

from __future__ import annotations

import asyncio
import os
import select
import weakref
from collections import deque
from collections.abc import Callable

READ_SIZE = 64 * 1024
"""Bytes asked of ``os.read`` per readable event."""

HIGH_WATER = 256 * 1024
"""Bytes a queueing :class:`PipeReader` holds before it stops reading."""


class Readiness:
    """Descriptors watched for reading through one epoll instance that the event loop watches.

    A child's pipes and pidfd each come and go within one command; an event
    loop's own ``add_reader``/``remove_reader`` costs uvloop about 10 us and
    eight system calls per descriptor (a poll handle made and closed each
    time), this one ``epoll_ctl`` each way. Level-triggered like the loop's
    readers: a callback runs on every loop iteration while its descriptor is
    readable. Use :func:`readiness` for the running loop's instance.
    """

    __slots__ = ("__weakref__", "_callbacks", "_epoll", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weakly: the loop's table of instances holds this one, which must not hold the
        # loop alive (its epoll closes once the loop is collected).
        self._loop = weakref.ref(loop)
        self._epoll = select.epoll()
        self._callbacks: dict[int, Callable[[], None]] = {}
        loop.add_reader(self._epoll.fileno(), self._dispatch)
        weakref.finalize(loop, self._epoll.close)

    def add(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever ``fd`` is readable (or hung up), until :meth:`remove`."""
        self._epoll.register(fd, select.EPOLLIN)
        self._callbacks[fd] = callback

    def remove(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed)."""
        if self._callbacks.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    def _dispatch(self) -> None:
        for fd, _ in self._epoll.poll(0, 64):
            # A callback earlier in this batch may have removed this one.
            callback = self._callbacks.get(fd)
            if callback is None:
                continue
            try:
                callback()
            except Exception as exc:
                loop = self._loop()
                if loop is not None:
                    loop.call_exception_handler(
                        {"message": f"callback for descriptor {fd} failed", "exception": exc}
                    )


_last: tuple[weakref.ref[asyncio.AbstractEventLoop], Readiness] | None = None


def readiness(loop: asyncio.AbstractEventLoop | None = None) -> Readiness:
    """The :class:`Readiness` of ``loop`` (the running one by default), made on first use.

    Passing the loop spares a ``getpid()``: Python 3.11 makes one in every
    ``asyncio.get_running_loop()``.
    """
    global _last
    if loop is None:
        loop = asyncio.get_running_loop()
    if _last is not None and _last[0]() is loop:
        return _last[1]
    found = _instances.get(loop)
    if found is None:
        found = _instances[loop] = Readiness(loop)
    _last = (weakref.ref(loop), found)
    return found


_instances: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Readiness] = (
    weakref.WeakKeyDictionary()
)


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
        "_readiness",
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
        self._readiness = readiness(self._loop)
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
            self._readiness.add(self._fd, self._on_readable)
            self._watching = True

    def _unwatch(self) -> None:
        if self._watching:
            self._readiness.remove(self._fd)
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
