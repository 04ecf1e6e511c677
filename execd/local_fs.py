"""Which files are safe to read and write on the event loop: small, regular, on a local filesystem.

A 4 KiB read from the page cache takes microseconds, far less than the trip
to a worker thread that :mod:`execd.workers` gives every blocking unit; but a
file on a network filesystem (or behind FUSE) may block for as long as its
server pleases. So :mod:`execd.files` runs a call's units inline only when

* its directory was seen before on a *local* filesystem (a disk or memory
  filesystem: ext4, xfs, btrfs, tmpfs, overlay...), so even the ``open`` is
  not expected to wait: :meth:`LocalFiles.trusted`;
* the opened file is on a local filesystem (``st_dev``, checked after every
  open, as a symlink may lead elsewhere): :meth:`LocalFiles.note`;
* and it is small (:data:`INLINE_READ_MAX` to read, :data:`INLINE_MAX` to write).

An atomic write also waits for its fsync, which on a local disk takes a few
hundred microseconds and can take far longer when the disk is busy. The trip
to a thread and back costs 0.1-0.3 ms on top of that here (the thread and the
loop each wake from an idle core), so a small atomic write (at most
:data:`SYNC_INLINE_MAX`) commits on the loop too, but only when nothing else
could be held up by it and while fsyncs are quick: the worker pool is idle
(no other file work is in flight: a concurrent large write is what makes a
journal commit slow), and the recent commits on the loop took
:data:`SLOW_SYNC` or less on average (a moving average, each commit weighing
:data:`SYNC_WEIGHT`) with none of them over :data:`STALL_SYNC`
(:meth:`LocalFiles.syncs_inline`). When either is no longer so, commits go
to the thread for :data:`SLOW_SYNC_BACKOFF` seconds and then try the loop
again. A disk that is slow for a while therefore stalls the loop for a few
commits, a very slow commit stalls it once, and an occasional slow fsync
among quick ones (1-1.5% of them take over 2 ms on this machine's disk)
does not send every commit of the next second to the thread.

Anything else keeps the worker thread. A directory is learnt from a call
that ran in a thread and found its file on a local filesystem; the table of
directories is bounded (emptied when full). Filesystem types come from
``/proc/self/mountinfo``, read again when a device is not known yet.
"""

from __future__ import annotations

import os
import time
from typing import Final

INLINE_MAX: Final = 128 * 1024
"""Most bytes a call writes on the event loop (ext4 allocates as it copies: some 40 us here)."""

INLINE_READ_MAX: Final = 1024 * 1024
"""Most bytes a call reads on the event loop: a page-cache copy of 60-100 us here, no more
than the loop spends anyway encoding and sending the same bytes."""

SYNC_INLINE_MAX: Final = 64 * 1024
"""Most bytes an atomic write commits (fsync and rename) on the event loop."""

SLOW_SYNC: Final = 0.002
"""Seconds the recent commits on the loop may take on average before commits go to the thread."""

STALL_SYNC: Final = 0.02
"""Seconds one commit on the loop may take before commits go to the thread at once."""

SYNC_WEIGHT: Final = 0.125
"""Weight of the latest commit in the moving average of commit times."""

SLOW_SYNC_BACKOFF: Final = 1.0
"""Seconds commits stay in the thread once those on the loop turned slow."""

DIRECTORIES_MAX: Final = 4096
"""Most directories remembered as local (the table is emptied when full)."""

LOCAL_TYPES: Final = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "f2fs",
        "jfs",
        "reiserfs",
        "bcachefs",
        "zfs",
        "tmpfs",
        "ramfs",
        "overlay",
        "vfat",
        "exfat",
        "hfsplus",
    }
)
"""Filesystems on a local disk or in memory, whose page-cache I/O does not wait on a network."""

MOUNTINFO: Final = "/proc/self/mountinfo"


def mount_types(mountinfo: str) -> dict[int, str]:
    """``st_dev`` -> filesystem type of every mount in a ``/proc/PID/mountinfo`` text."""
    types: dict[int, str] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        try:
            major, minor = fields[2].split(":")
            fstype = fields[fields.index("-") + 1]
            types[os.makedev(int(major), int(minor))] = fstype
        except (IndexError, ValueError):
            continue
    return types


def _directory(path: str) -> str:
    """``path`` up to its last slash: the key of its directory (``os.path.dirname`` costs more).

    The same directory may get more than one key ("a/b" and "a//b"): such a
    path is only not trusted at once.
    """
    return path[: path.rfind("/") + 1]


class LocalFiles:
    """Directories and devices known to be local (see the module docstring)."""

    def __init__(
        self,
        mountinfo: str = MOUNTINFO,
        *,
        slow_sync: float = SLOW_SYNC,
        stall_sync: float = STALL_SYNC,
        sync_backoff: float = SLOW_SYNC_BACKOFF,
    ) -> None:
        self._mountinfo = mountinfo
        self._slow_sync = slow_sync
        self._stall_sync = stall_sync
        self._sync_backoff = sync_backoff
        #: Moving average of the seconds a commit on the loop took.
        self._typical_sync = 0.0
        self._directories: set[str] = set()
        self._devices: dict[int, bool] = {}
        #: ``time.monotonic()`` before which commits stay off the loop.
        self._sync_in_thread_until = 0.0

    def trusted(self, path: str) -> bool:
        """Whether ``path``'s directory was seen on a local filesystem (open inline)."""
        return _directory(path) in self._directories

    def is_local(self, device: int) -> bool:
        """Whether ``device`` (an ``st_dev``) holds a local filesystem."""
        local = self._devices.get(device)
        if local is None:
            try:
                with open(self._mountinfo, encoding="utf-8", errors="replace") as handle:
                    types = mount_types(handle.read())
            except OSError:
                types = {}
            local = types.get(device) in LOCAL_TYPES
            if len(self._devices) >= DIRECTORIES_MAX:
                self._devices.clear()
            self._devices[device] = local
        return local

    def note(self, path: str, device: int | None, *, trusted: bool = False) -> bool:
        """Record where ``path``'s file turned out to be; whether that is a local filesystem.

        Its directory is trusted from now on if so, and no longer if not.
        ``trusted``: :meth:`trusted` said yes for ``path`` a moment ago, so a
        local device leaves nothing to record.
        """
        if trusted and device is not None and self.is_local(device):
            return True
        directory = _directory(path)
        if device is not None and self.is_local(device):
            if directory not in self._directories:
                if len(self._directories) >= DIRECTORIES_MAX:
                    self._directories.clear()
                self._directories.add(directory)
            return True
        self._directories.discard(directory)
        return False

    def syncs_inline(self) -> bool:
        """Whether a small commit may wait for its fsync on the loop (see the module docstring)."""
        return time.monotonic() >= self._sync_in_thread_until

    def synced(self, seconds: float) -> None:
        """Record how long a commit on the loop took (see the module docstring).

        Commits go to the thread for a while once the average of the recent
        ones is over the slow mark, or this one alone was over the stall
        mark; the average then restarts from the slow mark, so after the
        backoff one quick commit keeps them on the loop and one slow one
        sends them back.
        """
        typical = self._typical_sync + (seconds - self._typical_sync) * SYNC_WEIGHT
        if typical > self._slow_sync or seconds > self._stall_sync:
            self._sync_in_thread_until = time.monotonic() + self._sync_backoff
            typical = self._slow_sync
        self._typical_sync = typical
