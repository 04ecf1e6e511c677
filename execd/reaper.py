"""Reaping orphans: the zombies execd inherits as a child subreaper, and the children it must not take.

execd is a child subreaper (``execd.marker.set_child_subreaper``): orphaned
descendants are reparented to it and, once dead, stay zombies until it waits
for them. :class:`Reaper` scans execd's children for zombies and reaps those
that no one in execd is waiting for. The children come from
``/proc/self/task/<tid>/children`` (every thread of execd; the kernel
reparents orphans to any live thread), falling back to a scan of all of
``/proc`` for ``PPid == getpid()`` (:func:`execd.procfs.children`). A
zombie's state comes from ``/proc/<pid>/stat``. Each pid is reaped with
``waitpid(pid, WNOHANG)``, never ``waitpid(-1)``, and pids in the tracked set
are skipped, so the status of a child that :func:`execd.spawn.spawn` started
(or that another part of execd registered with :func:`track`) is never
stolen. The scan runs on a periodic timer and soon after any tracked child
exits (:func:`poke_reapers`; its orphans are likely to die with it). A
SIGCHLD handler is deliberately not used: uvloop refuses one (libuv owns that
signal to track its own subprocesses), and the timer costs one small read
per execd thread. Anything in execd that starts processes by other means
must :func:`track` their pids while it waits for them.
"""

from __future__ import annotations

import asyncio
import os

from execd import procfs

POKE_DELAY = 0.05
"""Seconds between a tracked child's exit and the orphan sweep it triggers."""

_tracked: set[int] = set()
_reapers: list[Reaper] = []


def track(pid: int) -> None:
    """Mark ``pid`` as a child someone in execd waits for: the reaper skips it."""
    _tracked.add(pid)


def untrack(pid: int) -> None:
    """Forget ``pid`` after its waiter reaped it."""
    _tracked.discard(pid)


def reap_orphans() -> list[tuple[int, int]]:
    """Reap every zombie child of execd that nobody tracks: ``[(pid, status)]``."""
    reaped: list[tuple[int, int]] = []
    for pid in procfs.children():
        if pid in _tracked:
            continue
        stat = procfs.read_stat(pid)
        if stat is None or stat.state != "Z":
            continue
        # Checked again right before waiting: tracking only changes on the
        # event loop thread, which is this one.
        if pid in _tracked:
            continue
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if got == pid:
            reaped.append((pid, status))
    return reaped


def poke_reapers() -> None:
    """A tracked child exited: every started :class:`Reaper` scans soon."""
    for reaper in _reapers:
        reaper.poke()


class Reaper:
    """Periodically reaps orphaned zombies; see the module docstring.

    ``start()`` needs a running loop. ``poke()`` asks for a scan soon (it is
    called whenever a tracked child exits). ``reaped``
    counts the zombies reaped so far.
    """

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.reaped = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._soon: asyncio.Handle | None = None

    def start(self) -> None:
        """Begin scanning every ``interval`` seconds."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        _reapers.append(self)
        self._schedule()

    def stop(self) -> None:
        """Stop scanning."""
        if self in _reapers:
            _reapers.remove(self)
        for handle in (self._timer, self._soon):
            if handle is not None:
                handle.cancel()
        self._timer = self._soon = None
        self._loop = None

    def _schedule(self) -> None:
        if self._loop is not None:
            self._timer = self._loop.call_later(self.interval, self._tick)

    def _tick(self) -> None:
        self.reap()
        self._schedule()

    def poke(self) -> None:
        """Scan shortly (at most one pending scan): exits in a burst share one sweep."""
        if self._loop is None or self._soon is not None:
            return
        self._soon = self._loop.call_later(POKE_DELAY, self._poked)

    def _poked(self) -> None:
        self._soon = None
        self.reap()

    def reap(self) -> list[tuple[int, int]]:
        """Scan now; returns ``[(pid, status)]`` of what was reaped."""
        reaped = reap_orphans()
        self.reaped += len(reaped)
        return reaped
