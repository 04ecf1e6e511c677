"""Linux inotify through ctypes, a pure parser of its records, and a shared-fd hub.

Three layers, each usable alone:

* constants and :func:`parse_events` / :func:`encode_event`: pure functions over
  ``struct inotify_event`` records (``int wd; u32 mask; u32 cookie; u32 len;
  char name[len]``, the name NUL-padded), safe on any bytes;
* :class:`Inotify`: one non-blocking, close-on-exec inotify file descriptor
  (``inotify_init1``, ``inotify_add_watch``, ``inotify_rm_watch``);
* :class:`InotifyHub`: one descriptor shared by many users on an asyncio loop,
  with reference-counted watch descriptors and rename pairing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import struct
from asyncio import AbstractEventLoop, TimerHandle, get_running_loop
from collections.abc import Callable
from typing import Final, NamedTuple, Protocol

log = logging.getLogger(__name__)

# -- event bits (linux/inotify.h) ------------------------------------------------

IN_ACCESS: Final = 0x00000001
IN_MODIFY: Final = 0x00000002
IN_ATTRIB: Final = 0x00000004
IN_CLOSE_WRITE: Final = 0x00000008
IN_CLOSE_NOWRITE: Final = 0x00000010
IN_OPEN: Final = 0x00000020
IN_MOVED_FROM: Final = 0x00000040
IN_MOVED_TO: Final = 0x00000080
IN_CREATE: Final = 0x00000100
IN_DELETE: Final = 0x00000200
IN_DELETE_SELF: Final = 0x00000400
IN_MOVE_SELF: Final = 0x00000800
IN_UNMOUNT: Final = 0x00002000
IN_Q_OVERFLOW: Final = 0x00004000
IN_IGNORED: Final = 0x00008000
IN_ONLYDIR: Final = 0x01000000
IN_DONT_FOLLOW: Final = 0x02000000
IN_EXCL_UNLINK: Final = 0x04000000
IN_MASK_ADD: Final = 0x20000000
IN_ISDIR: Final = 0x40000000
IN_ONESHOT: Final = 0x80000000

IN_NONBLOCK: Final = os.O_NONBLOCK
IN_CLOEXEC: Final = os.O_CLOEXEC

WATCH_MASK: Final = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_EXCL_UNLINK
)
"""The one mask every watch of a hub uses (reads and opens are never watched).

All watches on one descriptor must use the same mask: adding a watch for an
inode that is already watched replaces its mask.
"""

_NAMES: Final = (
    (IN_ACCESS, "ACCESS"),
    (IN_MODIFY, "MODIFY"),
    (IN_ATTRIB, "ATTRIB"),
    (IN_CLOSE_WRITE, "CLOSE_WRITE"),
    (IN_CLOSE_NOWRITE, "CLOSE_NOWRITE"),
    (IN_OPEN, "OPEN"),
    (IN_MOVED_FROM, "MOVED_FROM"),
    (IN_MOVED_TO, "MOVED_TO"),
    (IN_CREATE, "CREATE"),
    (IN_DELETE, "DELETE"),
    (IN_DELETE_SELF, "DELETE_SELF"),
    (IN_MOVE_SELF, "MOVE_SELF"),
    (IN_UNMOUNT, "UNMOUNT"),
    (IN_Q_OVERFLOW, "Q_OVERFLOW"),
    (IN_IGNORED, "IGNORED"),
    (IN_ISDIR, "ISDIR"),
)

HEADER: Final = struct.Struct("=iIII")
"""``struct inotify_event`` without its name: wd, mask, cookie, len (16 bytes)."""

READ_SIZE: Final = 64 * 1024
"""Bytes asked for per read (far above the largest record, 16 + NAME_MAX + 1)."""


class RawEvent(NamedTuple):
    """One decoded ``struct inotify_event``.

    ``name`` is the entry name inside the watched directory (empty for events
    about the watched inode itself), decoded with :func:`os.fsdecode` so that
    any byte sequence round-trips through :func:`os.fsencode`.
    """

    wd: int
    mask: int
    cookie: int
    name: str


def describe(mask: int) -> str:
    """The symbolic names of the bits set in ``mask`` (for logs)."""
    names = [name for bit, name in _NAMES if mask & bit]
    return "|".join(names) if names else "0"


def parse_events(data: bytes | bytearray | memoryview) -> tuple[list[RawEvent], int]:
    """Decode the complete records at the start of ``data``.

    Returns the events and the number of bytes they occupied. A truncated
    trailing record (short header, or a name longer than the bytes left) is not
    consumed: parsing stops there. Never raises on any input.
    """
    view = memoryview(data).cast("B")
    total = len(view)
    events: list[RawEvent] = []
    offset = 0
    size = HEADER.size
    while total - offset >= size:
        wd, mask, cookie, length = HEADER.unpack_from(view, offset)
        end = offset + size + length
        if end > total:
            break
        raw = bytes(view[offset + size : end])
        nul = raw.find(b"\0")
        name = raw if nul < 0 else raw[:nul]
        events.append(RawEvent(wd, mask, cookie, os.fsdecode(name)))
        offset = end
    return events, offset


def encode_event(event: RawEvent, *, padding: int | None = None) -> bytes:
    """Encode ``event`` as the kernel would (the inverse of :func:`parse_events`).

    The name is NUL-terminated and, by default, padded with NULs to a multiple
    of 16 bytes like the kernel does; ``padding`` asks for exactly that many
    NULs after the terminator instead. A nameless event has ``len`` 0 unless
    ``padding`` is given. The name must not contain a NUL character.
    """
    name = os.fsencode(event.name)
    if b"\0" in name:
        raise ValueError("an inotify name cannot contain NUL")
    if padding is None:
        length = 0 if not name else -(-(len(name) + 1) // HEADER.size) * HEADER.size
    else:
        length = len(name) + 1 + padding
    body = name.ljust(length, b"\0")
    return HEADER.pack(event.wd, event.mask, event.cookie, length) + body


# -- the ctypes binding -------------------------------------------------------------


class _Libc:
    """The three inotify entry points of the C library, resolved once."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.inotify_init1  # noqa: B018 - probe: the symbol must resolve
        except (OSError, AttributeError):
            lib = ctypes.CDLL("libc.so.6", use_errno=True)
        self.init1 = lib.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.init1.restype = ctypes.c_int
        self.add_watch = lib.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add_watch.restype = ctypes.c_int
        self.rm_watch = lib.inotify_rm_watch
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        self.rm_watch.restype = ctypes.c_int


@functools.cache
def _lib() -> _Libc:
    """libc's inotify functions, looked up on first use."""
    return _Libc()


def _fail(path: str | None = None) -> OSError:
    code = ctypes.get_errno()
    if path is None:
        return OSError(code, os.strerror(code))
    return OSError(code, os.strerror(code), path)


class Inotify:
    """One inotify instance: a non-blocking, close-on-exec descriptor.

    Raises :class:`OSError` with the C library's errno on failure (ENOSPC from
    :meth:`add_watch` means the per-user watch limit is reached, EMFILE from
    the constructor the per-user instance limit).
    """

    def __init__(self) -> None:
        fd = int(_lib().init1(IN_NONBLOCK | IN_CLOEXEC))
        if fd < 0:
            raise _fail()
        self._fd: int = fd

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._fd < 0

    def fileno(self) -> int:
        """The descriptor (valid until :meth:`close`)."""
        if self._fd < 0:
            raise ValueError("inotify descriptor is closed")
        return self._fd

    def add_watch(self, path: str, mask: int) -> int:
        """Watch ``path`` for ``mask``; returns the watch descriptor.

        The kernel returns the same descriptor for an inode already watched
        through this instance (and replaces its mask unless ``IN_MASK_ADD``).
        """
        encoded = os.fsencode(path)
        if b"\0" in encoded:
            raise OSError(errno.EINVAL, "path contains a NUL byte", path)
        wd = _lib().add_watch(self.fileno(), encoded, mask)
        if wd < 0:
            raise _fail(path)
        return int(wd)

    def rm_watch(self, wd: int) -> None:
        """Remove watch ``wd`` (the kernel then queues ``IN_IGNORED`` for it)."""
        if _lib().rm_watch(self.fileno(), wd) < 0:
            raise _fail()

    def read_raw(self, size: int = READ_SIZE) -> bytes:
        """One ``read`` of the descriptor; ``b""`` when nothing is queued."""
        try:
            return os.read(self.fileno(), size)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        """Close the descriptor; every watch on it goes away. Idempotent."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


# -- the shared descriptor ------------------------------------------------------------


class WatchUser(Protocol):
    """What a hub delivers to the holder of watch descriptors.

    Callbacks run synchronously on the event loop, in queue order, and may
    call :meth:`InotifyHub.acquire` and :meth:`InotifyHub.release`.
    """

    def on_event(self, event: RawEvent) -> None:
        """A non-rename event on a descriptor this user holds."""

    def on_move(self, source: RawEvent | None, target: RawEvent | None) -> None:
        """A rename: each side is given only if this user holds its descriptor."""

    def on_overflow(self) -> None:
        """The kernel queue overflowed: events were lost for every user."""

    def on_ignored(self, wd: int) -> None:
        """The kernel dropped ``wd`` (inode gone, unmounted); it is no longer held."""


class InotifyHub:
    """Shares one inotify descriptor among many users on the running loop.

    Theory of operation. The descriptor is opened on the first
    :meth:`acquire` and closed when no user holds any watch, so an idle hub
    costs nothing. The kernel returns one watch descriptor (wd) per inode, so
    every wd carries the set of users holding it; :meth:`release` removes the
    kernel watch only when the last holder lets go. Every watch uses
    :data:`WATCH_MASK`, so re-adding a watched inode never narrows its mask.

    Reading is edge-free: ``loop.add_reader`` fires, the hub reads until the
    descriptor is empty (or a per-wakeup budget is spent, to keep the loop
    fair) and dispatches each record to the holders of its wd. Renames are
    paired by cookie: an ``IN_MOVED_FROM`` is held back until its
    ``IN_MOVED_TO`` arrives and the pair is delivered once, at the position of
    the ``IN_MOVED_TO``, to every holder of either side. A ``IN_MOVED_FROM``
    still unpaired ``move_grace`` seconds after the read that brought it (the
    target is outside every watch) is delivered alone. ``IN_Q_OVERFLOW`` goes
    to every user; ``IN_IGNORED`` drops the wd and tells its holders.
    Closing while dispatching is deferred until the dispatch returns.
    """

    def __init__(self, *, move_grace: float = 0.02, read_budget: int = 1024 * 1024) -> None:
        self._move_grace = move_grace
        self._read_budget = read_budget
        self._ino: Inotify | None = None
        self._loop: AbstractEventLoop | None = None
        self._holders: dict[int, dict[WatchUser, None]] = {}
        self._held: dict[WatchUser, set[int]] = {}
        self._pending_moves: dict[int, RawEvent] = {}
        self._flush_timer: TimerHandle | None = None
        self._after_drain: list[Callable[[], None]] = []
        self._dispatching = 0

    # -- introspection --

    def fileno(self) -> int | None:
        """The descriptor while open, else ``None``."""
        return None if self._ino is None else self._ino.fileno()

    def holds(self, user: WatchUser, wd: int) -> bool:
        """Whether ``user`` holds ``wd``."""
        return wd in self._held.get(user, ())

    def held_by(self, user: WatchUser) -> frozenset[int]:
        """The wds ``user`` holds."""
        return frozenset(self._held.get(user, ()))

    # -- watches --

    def acquire(
        self, user: WatchUser, path: str, *, follow: bool = True, only_dir: bool = False
    ) -> tuple[int, bool]:
        """Watch ``path`` for ``user``; returns ``(wd, newly_held_by_user)``.

        ``follow=False`` watches a symlink itself; ``only_dir`` fails with
        ENOTDIR unless ``path`` is a directory. Raises :class:`OSError`.
        """
        ino = self._open()
        mask = WATCH_MASK
        if not follow:
            mask |= IN_DONT_FOLLOW
        if only_dir:
            mask |= IN_ONLYDIR
        try:
            wd = ino.add_watch(path, mask)
        except OSError:
            self._close_if_unused()
            raise
        holders = self._holders.setdefault(wd, {})
        fresh = user not in holders
        holders[user] = None
        self._held.setdefault(user, set()).add(wd)
        return wd, fresh

    def release(self, user: WatchUser, wd: int) -> None:
        """Let go of ``wd``; the kernel watch goes when its last holder lets go."""
        holders = self._holders.get(wd)
        if holders is None or user not in holders:
            return
        del holders[user]
        held = self._held[user]
        held.discard(wd)
        if not held:
            del self._held[user]
        if not holders:
            del self._holders[wd]
            if self._ino is not None:
                # EINVAL: the kernel already dropped it (IN_IGNORED not read yet).
                with contextlib.suppress(OSError):
                    self._ino.rm_watch(wd)
        self._close_if_unused()

    def after_drain(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, the next time the descriptor has been read empty.

        Every event queued by the kernel before this call has then been
        dispatched (used to recognise events of entries a scan already saw).
        """
        self._after_drain.append(callback)

    def release_all(self, user: WatchUser) -> None:
        """Let go of every wd ``user`` holds."""
        for wd in list(self._held.get(user, ())):
            self.release(user, wd)

    def close(self) -> None:
        """Close the descriptor and forget every holder (no callbacks)."""
        self._holders.clear()
        self._held.clear()
        self._shutdown()

    # -- descriptor lifecycle --

    def _open(self) -> Inotify:
        if self._ino is None:
            loop = get_running_loop()
            ino = Inotify()
            try:
                loop.add_reader(ino.fileno(), self._on_readable)
            except BaseException:
                ino.close()
                raise
            self._ino, self._loop = ino, loop
        return self._ino

    def _close_if_unused(self) -> None:
        if not self._holders and not self._dispatching:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self._pending_moves.clear()
        self._after_drain.clear()
        ino, self._ino = self._ino, None
        if ino is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(ino.fileno())
            ino.close()

    # -- reading and dispatch --

    def _on_readable(self) -> None:
        ino = self._ino
        if ino is None:
            return
        self._dispatching += 1
        try:
            budget = self._read_budget
            drained = False
            while budget > 0 and self._ino is ino:
                try:
                    data = ino.read_raw()
                except OSError:
                    log.exception("reading the inotify descriptor failed")
                    break
                if not data:
                    drained = True
                    break
                budget -= len(data)
                events, _ = parse_events(data)
                for event in events:
                    self._dispatch(event)
            if drained and self._ino is ino:
                callbacks, self._after_drain = self._after_drain, []
                for callback in callbacks:
                    self._call(callback)
                if self._pending_moves and self._flush_timer is None and self._loop is not None:
                    self._flush_timer = self._loop.call_later(self._move_grace, self._on_flush)
        finally:
            self._dispatching -= 1
            self._close_if_unused()

    def _on_flush(self) -> None:
        self._flush_timer = None
        self._dispatching += 1
        try:
            self._flush_moves()
        finally:
            self._dispatching -= 1
            self._close_if_unused()

    def _dispatch(self, event: RawEvent) -> None:
        mask = event.mask
        if mask & IN_Q_OVERFLOW:
            self._flush_moves()
            for user in list(self._held):
                self._call(user.on_overflow)
            return
        if mask & IN_MOVED_FROM:
            self._pending_moves[event.cookie] = event
            return
        if mask & IN_MOVED_TO:
            self._deliver_move(self._pending_moves.pop(event.cookie, None), event)
            return
        holders = self._holders.get(event.wd)
        if not holders:
            return
        if mask & IN_IGNORED:
            del self._holders[event.wd]
            for user in holders:
                held = self._held.get(user)
                if held is not None:
                    held.discard(event.wd)
                    if not held:
                        del self._held[user]
            for user in holders:
                self._call(user.on_ignored, event.wd)
            return
        for user in list(holders):
            self._call(user.on_event, event)

    def _flush_moves(self) -> None:
        pending, self._pending_moves = self._pending_moves, {}
        for event in pending.values():
            self._deliver_move(event, None)

    def _deliver_move(self, source: RawEvent | None, target: RawEvent | None) -> None:
        users: dict[WatchUser, None] = {}
        for side in (source, target):
            if side is not None:
                users.update(self._holders.get(side.wd, {}))
        for user in users:
            src = source if source is not None and self.holds(user, source.wd) else None
            dst = target if target is not None and self.holds(user, target.wd) else None
            if src is not None or dst is not None:
                self._call(user.on_move, src, dst)

    @staticmethod
    def _call(callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("inotify watch callback failed")
