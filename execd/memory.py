"""Giving memory back to the system once large buffers are freed.

CPython hands buffers above 512 bytes to the C allocator. glibc serves large
requests with ``mmap`` and unmaps them on free, but each such free raises its
mmap threshold (up to 32 MiB), after which buffers of that size come from the
heap, and a heap keeps what was freed in it. A long-lived execd that once
carried a few 16 MiB frames would hold on to tens of MiB it no longer uses.
Two glibc calls prevent that:

* :func:`tune` fixes the mmap threshold at :data:`MMAP_THRESHOLD` (which also
  stops glibc from raising it): buffers from that size up are mapped and
  returned on free; smaller ones (a 1 MiB file block, a stream chunk) keep
  being recycled from the heap as before. It also fixes the trim threshold
  at twice that, as glibc does when it moves the mmap threshold itself: a
  smaller one would give the top of the heap back after nearly every burst
  and fault it in again on the next.
* :class:`Trimmer` calls ``malloc_trim(0)`` a moment after activity, at most
  once per :data:`TRIM_DELAY` while calls keep coming, when the resident set
  has grown well past what it was at start. That returns the free pages of
  every arena (worker threads allocate from arenas of their own). Under
  sustained load the checks go on, so what a burst freed is given back while
  other calls still run.

Without glibc (musl) both do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
from typing import Final

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
#: Buffers of this size and up are mapped on their own and unmapped when freed.
MMAP_THRESHOLD: Final = 4 * 1024 * 1024
#: Free memory at the top of the heap that free() leaves in place (glibc pairs twice the
#: mmap threshold with it once it adjusts that itself): trimming is the Trimmer's job.
TRIM_THRESHOLD: Final = 2 * MMAP_THRESHOLD
#: Growth of the resident set over its starting size that makes a trim worthwhile.
TRIM_SLACK: Final = 8 * 1024 * 1024
#: Seconds from the first activity after a check to the next check.
TRIM_DELAY: Final = 1.0


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim  # noqa: B018 - probe: glibc only
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC: Final = _libc()


def tune() -> bool:
    """Fix glibc's mmap threshold (see the module docstring); False without glibc."""
    if _LIBC is None:
        return False
    fixed = _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(fixed and _LIBC.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def trim() -> bool:
    """Return free heap memory of every arena to the system; False without glibc."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(0))


def resident_bytes() -> int:
    """This process's resident set size, in bytes (0 if unknown)."""
    try:
        with open("/proc/self/statm", "rb") as handle:
            fields = handle.read().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Trimmer:
    """Trims the heap a moment after large work, and every so often while work goes on.

    :meth:`activity` is cheap and meant to be called often (after every
    call): it arms one timer unless one is pending, so the check runs
    ``delay`` seconds after the first activity since the last check, whether
    or not calls kept coming meanwhile; when the resident set then exceeds
    its size at :meth:`start` by more than :data:`TRIM_SLACK`, the heap is
    trimmed.
    """

    def __init__(self, delay: float = TRIM_DELAY, slack: int = TRIM_SLACK) -> None:
        self._delay = delay
        self._slack = slack
        self._baseline = 0
        self._timer: asyncio.TimerHandle | None = None
        self._enabled = False

    def start(self) -> None:
        """Tune the allocator and remember the resident size to come back to."""
        self._enabled = tune()
        self._baseline = resident_bytes()

    def activity(self) -> None:
        """Something ran that may have allocated large buffers."""
        if self._enabled and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay, self._check)

    def _check(self) -> None:
        self._timer = None
        before = resident_bytes()
        if before <= self._baseline + self._slack:
            return
        trim()
        log.debug("heap trimmed: resident %d -> %d KiB", before >> 10, resident_bytes() >> 10)

    def stop(self) -> None:
        """Cancel a pending check."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
