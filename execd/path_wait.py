"""``watch.wait_for_path``: wait until a path exists, is gone, is a file, a dir, or is not empty.

Theory of operation. :class:`PathWaiter` checks the condition, then watches
what the condition depends on (:meth:`PathWaiter.arm`): every existing
directory on the way to the path, and on the way to its resolved form when
symlinks lead elsewhere, each interested only in the entry that leads toward
the path; for ``nonempty``, the path itself once it exists. It checks again
after arming (a change before the watches were in place is not lost) and then
after every relevant event, re-arming each time because the way to the path
may have changed. A far ancestor that cannot be watched is skipped (best
effort); the nearest existing directory must be watchable.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
from typing import Final

from execd.errors import OperationTimeout, ShuttingDown, from_oserror
from execd.inotify import InotifyHub, RawEvent
from execd.watch_tree import GONE_ERRNOS, watch_error

_ABSENT_ERRNOS: Final = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})


class PathWaiter:
    """One ``watch.wait_for_path`` call: its watches and the flag they raise."""

    def __init__(self, hub: InotifyHub, path: str, condition: str) -> None:
        self._hub = hub
        self._path = path
        self._condition = condition
        self._interest: dict[int, frozenset[str] | None] = {}
        self.changed = asyncio.Event()
        self.abandoned = False

    def abandon(self) -> None:
        """Make the waiting call fail with SHUTTING_DOWN."""
        self.abandoned = True
        self.changed.set()

    async def wait(self, timeout: float) -> float:
        """Return the seconds waited once the condition holds.

        Raises OperationTimeout after ``timeout`` seconds, ShuttingDown once
        abandoned, and a typed error when the path cannot be examined.
        """
        path, condition = self._path, self._condition
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout
        try:
            while True:
                if condition_met(path, condition):
                    return loop.time() - start
                if self.abandoned:
                    raise ShuttingDown("execd is shutting down")
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise OperationTimeout(
                        f"{path}: not {condition} after {timeout:g}s",
                        {"path": path, "condition": condition, "timeout": timeout},
                    )
                self.changed.clear()
                self.arm()
                if condition_met(path, condition):
                    return loop.time() - start
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self.changed.wait()
        finally:
            self.disarm()

    def _relevant(self, event: RawEvent) -> bool:
        if event.wd not in self._interest:
            return False
        names = self._interest[event.wd]
        return names is None or not event.name or event.name in names

    def on_event(self, event: RawEvent) -> None:
        if self._relevant(event):
            self.changed.set()

    def on_move(self, source: RawEvent | None, target: RawEvent | None) -> None:
        if any(side is not None and self._relevant(side) for side in (source, target)):
            self.changed.set()

    def on_overflow(self) -> None:
        self.changed.set()

    def on_ignored(self, wd: int) -> None:
        self._interest.pop(wd, None)
        self.changed.set()

    def arm(self) -> None:
        """Watch what the condition depends on now; release what it no longer does."""
        wanted: dict[str, set[str] | None] = {}
        mandatory: set[str] = set()
        for index, target in enumerate(dict.fromkeys((self._path, os.path.realpath(self._path)))):
            for number, (directory, name) in enumerate(_existing_ancestry(target)):
                if index == 0 and number == 0:
                    mandatory.add(directory)
                names = wanted.setdefault(directory, set())
                if names is not None:
                    names.add(name)
        if self._condition == "nonempty" and os.path.exists(self._path):
            wanted[self._path] = None
            mandatory.add(self._path)
        interest: dict[int, frozenset[str] | None] = {}
        for directory, names in wanted.items():
            try:
                wd, _ = self._hub.acquire(self, directory)
            except OSError as exc:
                if exc.errno in GONE_ERRNOS:
                    self.changed.set()  # changed under us: check again
                    continue
                if exc.errno in (errno.ENOSPC, errno.EMFILE) or directory in mandatory:
                    raise watch_error(exc, directory) from None
                continue  # an unreadable far ancestor: best effort
            if wd in interest:
                previous = interest[wd]
                merged = None if previous is None or names is None else previous | names
                interest[wd] = merged
            else:
                interest[wd] = None if names is None else frozenset(names)
        for wd in self._hub.held_by(self) - interest.keys():
            self._hub.release(self, wd)
        self._interest = interest

    def disarm(self) -> None:
        """Release every watch."""
        self._hub.release_all(self)
        self._interest = {}


def _existing_ancestry(path: str) -> list[tuple[str, str]]:
    """``(directory, entry toward path)`` for each existing ancestor, nearest first."""
    found: list[tuple[str, str]] = []
    child, parent = path, os.path.dirname(path)
    while parent != child:
        if os.path.isdir(parent):
            found.append((parent, os.path.basename(child)))
        child, parent = parent, os.path.dirname(parent)
    return found


def condition_met(path: str, condition: str) -> bool:
    """Whether ``condition`` holds for ``path`` now (symlinks followed).

    Raises a typed error when the path cannot be examined (for example, a
    parent directory is not searchable).
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno in _ABSENT_ERRNOS:
            return condition == "absent"
        raise from_oserror(exc, path) from None
    if condition == "exists":
        return True
    if condition == "absent":
        return False
    if condition == "file":
        return stat.S_ISREG(st.st_mode)
    if condition == "dir":
        return stat.S_ISDIR(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        try:
            with os.scandir(path) as entries:
                return next(entries, None) is not None
        except OSError:
            return False
    return st.st_size > 0
