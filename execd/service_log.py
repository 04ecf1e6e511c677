"""A service's log file: appended to from its pipes, read back by offset, tailed.

execd owns the read ends of a service's stdout and stderr pipes and appends
every chunk to this file as it arrives (:meth:`LogFile.write`), so memory
stays bounded whatever the service prints. Readers never hold the output in
memory either: ``services.logs`` reads ranges with :meth:`LogFile.pread`,
finds where the last lines begin by reading backwards from the end
(:func:`tail_start`), and followers wait on :meth:`LogFile.changed`, which
resolves at the next write or change of the service's state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat

from execd.errors import NotSupported

log = logging.getLogger(__name__)

LOG_MODE = 0o600
"""Permissions of a log file execd creates."""

READ_BLOCK = 64 * 1024
"""Bytes read per step when searching backwards for line starts."""

FOLLOW_CHUNK = 256 * 1024
"""The most bytes a follower takes from the file at once."""

FOLLOW_POLL = 0.25
"""Seconds a follower waits for a change before it looks at the file's size anyway.

Bytes written to the log by other means (the service opening its own log
path) are seen this way too.
"""

TAIL_LINES = 20
TAIL_BYTES = 8192
"""How much of the log a failed start reports: at most this many lines and bytes."""


class LogFile:
    """A service's log: appended to from its pipes, read back by offset.

    One descriptor, opened ``O_RDWR | O_APPEND``, serves both: writes always
    land at the end, reads use ``pread``. ``changed()`` is a future resolved
    at the next :meth:`notify` (every write, and every change of the
    service's state), shared by every waiter.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
        fd = os.open(path, flags, LOG_MODE)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotSupported(f"a service log must be a regular file: {path}", {"path": path})
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self.error: str | None = None

    @property
    def closed(self) -> bool:
        """Whether the descriptor is closed (reads return nothing)."""
        return self._fd < 0

    def write(self, data: bytes) -> None:
        """Append ``data``; a failing write (disk full) drops it and is remembered."""
        if self._fd < 0:
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            if self.error is None:
                log.warning("cannot write the service log %s: %s", self.path, exc.strerror)
            self.error = exc.strerror or "write failed"
        self.notify()

    def size(self) -> int:
        """The file's current size (0 once closed)."""
        if self._fd < 0:
            return 0
        try:
            return os.fstat(self._fd).st_size
        except OSError:
            return 0

    def pread(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (fewer at the end of the file)."""
        if self._fd < 0 or length <= 0:
            return b""
        try:
            return os.pread(self._fd, length, offset)
        except OSError:
            return b""

    def changed(self) -> asyncio.Future[None]:
        """A future resolved at the next :meth:`notify`."""
        if self._waiter is None:
            self._waiter = self._loop.create_future()
        return self._waiter

    def notify(self) -> None:
        """Wake every waiter of :meth:`changed`."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Close the descriptor and wake waiters."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.notify()


def tail_start(log_file: LogFile, size: int, lines: int, floor: int) -> int:
    """Offset where the last ``lines`` lines of the bytes ``[floor, size)`` begin.

    Reads backwards from ``size`` a block at a time. A newline that is the
    very last byte ends the last line rather than starting an empty one.
    Returns ``floor`` when fewer lines fit between ``floor`` and ``size``.
    """
    if lines <= 0 or size <= floor:
        return size
    found = 0
    pos = size
    while pos > floor:
        low = max(floor, pos - READ_BLOCK)
        block = log_file.pread(low, pos - low)
        end = len(block)
        while True:
            index = block.rfind(b"\n", 0, end)
            if index < 0:
                break
            end = index
            if low + index == size - 1:
                continue
            found += 1
            if found == lines:
                return low + index + 1
        pos = low
    return floor


def tail_text(log_file: LogFile, floor: int) -> str:
    """The log's last lines (:data:`TAIL_LINES`, :data:`TAIL_BYTES`) at or after ``floor``, as text."""
    size = log_file.size()
    start = tail_start(log_file, size, TAIL_LINES, max(floor, size - TAIL_BYTES))
    return log_file.pread(start, size - start).decode("utf-8", "replace")


__all__ = ["LOG_MODE", "LogFile", "tail_start", "tail_text"]
