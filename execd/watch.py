"""The ``watch`` capability: path subscriptions and path waits, on inotify.

One :class:`~execd.inotify.InotifyHub` (one inotify descriptor) serves every
connection; watch descriptors are reference-counted there, so two
subscriptions on one directory share its kernel watch.

Theory of operation of a subscription (:class:`_Subscription`)::

    ACTIVE --root deleted/moved/unmounted--> ENDING  (root_deleted, ended queued
                                                      after everything pending)
    ACTIVE --unsubscribe / shutdown--------> ENDING  (queue discarded, ended queued)
    ENDING --pump pushed ended-------------> ENDED   (forgotten)
    any    --connection closed / push failed> ENDED   (nothing more is pushed)

Only an ACTIVE subscription holds watches and turns kernel events into
queued events. A recursive subscription mirrors the watched directories as a
tree of :class:`_Node` (wd, name, parent), so a renamed directory keeps its
watches and only its node moves. New directories are watched first and
scanned second; entries the scan finds are reported as ``created`` and
remembered until the descriptor is next read empty, so the kernel's own event for
an entry created in that window is not reported twice.

Delivery: a pump task per subscription pushes queued events in order. The
queue holds at most ``Limits.watch_queue`` change events; beyond that events
are dropped and counted until the queue has drained to half, when one
``overflow`` event with the count is queued. Control events (overflow,
root_deleted, ended, watch_limit, watch_failed) are never dropped. With a
debounce window, a change event waits ``debounce`` seconds in the queue and
repeats of its kind for its path merge into it (``count``) until a
structural event (created, deleted, moved) for that path is queued after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import stat
from collections import deque
from collections.abc import Iterator
from typing import Final

from execd.config import Config
from execd.context import CallContext, ConnectionLost, Method
from execd.errors import (
    Cancelled,
    ExecdError,
    InvalidPath,
    LimitExceeded,
    NoSuchWatch,
    OperationTimeout,
    ShuttingDown,
    TooLarge,
    WatchLimit,
    from_oserror,
)
from execd.fit import encoded_size, fit_list, result_budget
from execd.inotify import (
    IN_ATTRIB,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_ISDIR,
    IN_MODIFY,
    IN_MOVE_SELF,
    IN_UNMOUNT,
    InotifyHub,
    RawEvent,
)
from protocol.api.watch import (
    CHANGE_KINDS,
    MAX_UNWATCHED_REPORTED,
    SUBSCRIBE,
    UNSUBSCRIBE,
    WAIT_FOR_PATH,
    SubscribeParams,
    SubscribeResult,
    UnsubscribeParams,
    UnsubscribeResult,
    WaitForPathParams,
    WaitForPathResult,
    WatchEvent,
)

log = logging.getLogger(__name__)

_STRUCTURAL: Final = frozenset({"created", "deleted", "moved"})
_GONE_ERRNOS: Final = frozenset({errno.ENOENT, errno.ENOTDIR})
_ABSENT_ERRNOS: Final = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})
_STOP_GRACE: Final = 5.0
#: Room for the fields of a subscribe result beside its list of unwatched paths.
_RESULT_FIELDS: Final = 64
_WALK_YIELD_EVERY: Final = 64

_ACTIVE: Final = "active"
_ENDING: Final = "ending"
_ENDED: Final = "ended"


def _absolute(path: str) -> str:
    if "\0" in path:
        raise InvalidPath("path contains a NUL character", {"path": path.replace("\0", "\\0")})
    return os.path.abspath(path)


def _watch_error(exc: OSError, path: str) -> ExecdError:
    """The typed error for a failed inotify_init1/inotify_add_watch."""
    if exc.errno == errno.ENOSPC:
        return WatchLimit(
            f"inotify watch limit reached (fs.inotify.max_user_watches): {path}",
            {"errno": "ENOSPC", "path": path},
        )
    if exc.errno == errno.EMFILE:
        return WatchLimit(
            "inotify instance limit reached (fs.inotify.max_user_instances)",
            {"errno": "EMFILE", "path": path},
        )
    return from_oserror(exc, path)


def _entry_is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


class _Node:
    """A watched directory of a subscription (the root has no parent)."""

    __slots__ = ("children", "name", "parent", "wd")

    def __init__(self, wd: int, name: str, parent: _Node | None) -> None:
        self.wd = wd
        self.name = name
        self.parent = parent
        self.children: dict[str, _Node] = {}


class _Item:
    """One queued event; ``keys`` are the paths it is indexed under for debounce."""

    __slots__ = ("event", "keys", "kind", "ready_at")

    def __init__(self, kind: str, event: WatchEvent, ready_at: float, keys: tuple[str, ...]):
        self.kind = kind
        self.event = event
        self.ready_at = ready_at
        self.keys = keys


class _Subscription:
    """One ``watch.subscribe``: its watches, its queue and its pump task."""

    def __init__(
        self,
        owner: WatchCapability,
        watch_id: int,
        ctx: CallContext,
        root: str,
        params: SubscribeParams,
    ) -> None:
        self._owner = owner
        self._hub = owner.hub
        self.watch_id = watch_id
        self.connection_id = ctx.connection_id
        self._ctx = ctx
        self.root = root
        self.recursive = params.recursive
        kinds = params.events if params.events is not None else CHANGE_KINDS
        self._kinds: frozenset[str] = frozenset(kinds)
        self._debounce = params.debounce
        self._limit = max(1, owner.limits.watch_queue)
        self._loop = asyncio.get_running_loop()
        self.state = _ACTIVE
        self._root_node: _Node | None = None
        self._root_is_dir = False
        self._nodes: dict[int, _Node] = {}
        self._synthesized: set[str] = set()
        self._drain_requested = False
        self._queue: deque[_Item] = deque()
        self._by_path: dict[str, deque[_Item]] = {}
        self._dropping = False
        self._dropped = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._setting_up = True
        self._limit_hit = False
        self.unwatched: list[str] = []
        self.unwatched_count = 0

    # -- lifecycle --

    @property
    def watched(self) -> int:
        """How many inotify watches the subscription holds."""
        return len(self._nodes)

    async def setup(self, follow: bool) -> None:
        """Watch the root (and, if recursive, the tree below it)."""
        try:
            st = os.stat(self.root) if follow else os.lstat(self.root)
        except OSError as exc:
            raise from_oserror(exc, self.root) from None
        try:
            wd, _ = self._hub.acquire(self, self.root, follow=follow)
        except OSError as exc:
            raise _watch_error(exc, self.root) from None
        self._root_is_dir = stat.S_ISDIR(st.st_mode)
        self._root_node = _Node(wd, "", None)
        self._nodes[wd] = self._root_node
        if self.recursive and self._root_is_dir:
            for steps, _ in enumerate(self._walk(self._root_node, self.root, synthesize=False), 1):
                if self._limit_hit or self.state != _ACTIVE:
                    break
                if steps % _WALK_YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        if self._limit_hit:
            raise WatchLimit(
                f"inotify watch limit reached (fs.inotify.max_user_watches) under {self.root}",
                {"errno": "ENOSPC", "path": self.root},
            )
        self._setting_up = False

    def start(self) -> None:
        """Start pushing queued events."""
        self._task = self._loop.create_task(self._pump(), name=f"watch-{self.watch_id}")

    async def stop(self, reason: str, grace: float = _STOP_GRACE) -> None:
        """End the subscription: discard what is queued, push ``ended``."""
        if self.state == _ACTIVE:
            self.state = _ENDING
            self._hub.release_all(self)
            self._queue.clear()
            self._by_path.clear()
            self._dropping, self._dropped = False, 0
            self._synthesized.clear()
            self._control("ended", reason=reason)
        task = self._task
        if task is None:
            self.abort()
            return
        done, _ = await asyncio.wait({task}, timeout=grace)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def abort(self) -> None:
        """End at once without pushing anything (the connection is gone)."""
        self.state = _ENDED
        self._hub.release_all(self)
        self._queue.clear()
        self._by_path.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._owner.forget(self)

    def _finish_root_gone(self, reason: str) -> None:
        if self.state != _ACTIVE:
            return
        self.state = _ENDING
        self._hub.release_all(self)
        self._by_path.clear()
        for item in self._queue:
            item.ready_at = 0.0
        if self._dropping:
            self._resume_after_drop()
        self._control("root_deleted", reason=reason)
        self._control("ended", reason="root_deleted")

    # -- WatchUser callbacks --

    def on_event(self, event: RawEvent) -> None:
        """Translate one kernel event on a watched directory (or the root)."""
        if self.state != _ACTIVE:
            return
        node = self._nodes.get(event.wd)
        if node is None:
            return
        mask = event.mask
        if not event.name:
            if node is not self._root_node:
                return  # the parent directory reports it by name
            if mask & IN_DELETE_SELF:
                self._finish_root_gone("deleted")
                return
            if mask & IN_MOVE_SELF:
                self._finish_root_gone("moved")
                return
            if mask & IN_UNMOUNT:
                self._finish_root_gone("unmounted")
                return
            path, is_dir = self.root, self._root_is_dir
        else:
            path, is_dir = os.path.join(self._path_of(node), event.name), bool(mask & IN_ISDIR)
        if mask & IN_CREATE:
            if path in self._synthesized:
                self._synthesized.discard(path)
                return
            self._emit("created", path, is_dir)
            if is_dir and self.recursive:
                child, fresh = self._add_dir(node, event.name, path)
                if child is not None and fresh:
                    self._exhaust(self._walk(child, path, synthesize=True))
        elif mask & IN_DELETE:
            self._synthesized.discard(path)
            self._emit("deleted", path, is_dir)
            if is_dir and self.recursive:
                gone = node.children.pop(event.name, None)
                if gone is not None:
                    self._release_subtree(gone)
        elif mask & IN_MODIFY:
            self._emit("modified", path, is_dir)
        elif mask & IN_CLOSE_WRITE:
            self._emit("closed_write", path, is_dir)
        elif mask & IN_ATTRIB:
            self._emit("attrib", path, is_dir)

    def on_move(self, source: RawEvent | None, target: RawEvent | None) -> None:
        """A rename, with the sides inside this subscription's watches."""
        if self.state != _ACTIVE:
            return
        src_node = self._nodes.get(source.wd) if source is not None else None
        dst_node = self._nodes.get(target.wd) if target is not None else None
        src_path = dst_path = None
        if source is not None and src_node is not None:
            src_path = os.path.join(self._path_of(src_node), source.name)
            self._synthesized.discard(src_path)
        if target is not None and dst_node is not None:
            dst_path = os.path.join(self._path_of(dst_node), target.name)
            if dst_path in self._synthesized:
                self._synthesized.discard(dst_path)
                if src_path is None:
                    return  # a scan already reported it as created
        if src_path is None and dst_path is None:
            return
        sample = source if source is not None else target
        is_dir = sample is not None and bool(sample.mask & IN_ISDIR)
        self._emit(
            "moved",
            dst_path if dst_path is not None else str(src_path),
            is_dir,
            from_path=src_path,
            to_path=dst_path,
        )
        if not (is_dir and self.recursive):
            return
        if src_node is not None and source is not None:
            moving = src_node.children.pop(source.name, None)
            if dst_node is None or target is None:
                if moving is not None:
                    self._release_subtree(moving)
                return
            if moving is not None and not self._is_within(dst_node, moving):
                self._attach(moving, dst_node, target.name)
                return
            if moving is not None:
                self._release_subtree(moving)
        if dst_node is not None and target is not None and dst_path is not None:
            child, fresh = self._add_dir(dst_node, target.name, dst_path)
            if child is not None and fresh:
                self._exhaust(self._walk(child, dst_path, synthesize=src_path is None))

    def on_overflow(self) -> None:
        """The kernel queue overflowed: say so, and re-learn the tree."""
        if self.state != _ACTIVE:
            return
        last = self._queue[-1] if self._queue else None
        if last is None or last.kind != "overflow" or last.event.source != "kernel":
            self._control("overflow", source="kernel")
        if self.recursive and self._root_is_dir:
            self._resync()

    def on_ignored(self, wd: int) -> None:
        """The kernel dropped ``wd``: the directory is gone."""
        node = self._nodes.get(wd)
        if node is None or self.state != _ACTIVE:
            return
        if node is self._root_node:
            self._finish_root_gone("deleted")
            return
        self._detach(node)
        self._release_subtree(node)

    def _on_drained(self) -> None:
        """Every kernel event of the scans so far has been seen."""
        self._drain_requested = False
        self._synthesized.clear()

    # -- the directory tree --

    def _path_of(self, node: _Node) -> str:
        names: list[str] = []
        current: _Node | None = node
        while current is not None and current.parent is not None:
            names.append(current.name)
            current = current.parent
        if not names:
            return self.root
        return os.path.join(self.root, *reversed(names))

    @staticmethod
    def _is_within(node: _Node, ancestor: _Node) -> bool:
        current: _Node | None = node
        while current is not None:
            if current is ancestor:
                return True
            current = current.parent
        return False

    def _attach(self, node: _Node, parent: _Node, name: str) -> None:
        self._detach(node)
        old = parent.children.get(name)
        if old is not None and old is not node:
            self._release_subtree(old)
        node.parent, node.name = parent, name
        parent.children[name] = node

    @staticmethod
    def _detach(node: _Node) -> None:
        parent = node.parent
        if parent is not None and parent.children.get(node.name) is node:
            del parent.children[node.name]

    def _release_subtree(self, node: _Node) -> None:
        stack = [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            current.children.clear()
            if self._nodes.get(current.wd) is current:
                del self._nodes[current.wd]
                self._hub.release(self, current.wd)

    def _add_dir(self, parent: _Node, name: str, path: str) -> tuple[_Node | None, bool]:
        """Watch directory ``path`` (entry ``name`` of ``parent``).

        Returns the node and whether it is new; an inode already watched by
        this subscription is moved to its new place instead (``None`` if that
        would make a cycle, as through a bind mount of an ancestor).
        """
        try:
            wd, _ = self._hub.acquire(self, path, follow=False, only_dir=True)
        except OSError as exc:
            self._unwatchable(path, exc)
            return None, False
        node = self._nodes.get(wd)
        if node is not None:
            if self._is_within(parent, node):
                return None, False
            self._attach(node, parent, name)
            return node, False
        node = _Node(wd, name, parent)
        self._nodes[wd] = node
        self._attach(node, parent, name)
        return node, True

    def _unwatchable(self, path: str, exc: OSError) -> None:
        if exc.errno in _GONE_ERRNOS:
            return  # gone or replaced already: its own event follows
        if exc.errno == errno.ENOSPC:
            if self._setting_up:
                self._limit_hit = True
            else:
                self._control("watch_limit", path=path, is_dir=True, reason="ENOSPC")
            return
        reason = errno.errorcode.get(exc.errno or 0, "EIO")
        if self._setting_up:
            self.unwatched_count += 1
            if len(self.unwatched) < MAX_UNWATCHED_REPORTED:
                self.unwatched.append(path)
        else:
            self._control("watch_failed", path=path, is_dir=True, reason=reason)

    def _walk(self, node: _Node, path: str, *, synthesize: bool) -> Iterator[None]:
        """Watch every directory below ``node``; yields after each directory.

        With ``synthesize``, every entry found is reported as ``created``.
        """
        stack = [(node, path)]
        while stack:
            parent, parent_path = stack.pop()
            if self._nodes.get(parent.wd) is not parent or self.state != _ACTIVE:
                continue
            try:
                with os.scandir(parent_path) as entries:
                    found = [(entry.name, _entry_is_dir(entry)) for entry in entries]
            except OSError:
                continue
            for name, is_dir in found:
                child_path = os.path.join(parent_path, name)
                if synthesize:
                    if not self._drain_requested:
                        self._drain_requested = True
                        self._hub.after_drain(self._on_drained)
                    self._synthesized.add(child_path)
                    self._emit("created", child_path, is_dir)
                if is_dir:
                    child, fresh = self._add_dir(parent, name, child_path)
                    if child is not None and fresh:
                        stack.append((child, child_path))
                    if self._limit_hit:
                        return
            yield

    @staticmethod
    def _exhaust(steps: Iterator[None]) -> None:
        for _ in steps:
            pass

    def _resync(self) -> None:
        """Re-learn the tree from disk after lost events (no events reported)."""
        root = self._root_node
        if root is None:
            return
        seen = {root.wd}
        stack = [(root, self.root)]
        while stack:
            parent, parent_path = stack.pop()
            try:
                with os.scandir(parent_path) as entries:
                    dirs = [entry.name for entry in entries if _entry_is_dir(entry)]
            except OSError:
                continue
            for name in dirs:
                child, _ = self._add_dir(parent, name, os.path.join(parent_path, name))
                if child is not None and child.wd not in seen:
                    seen.add(child.wd)
                    stack.append((child, os.path.join(parent_path, name)))
        for wd, node in list(self._nodes.items()):
            if wd not in seen and self._nodes.get(wd) is node:
                self._detach(node)
                self._release_subtree(node)

    # -- the queue --

    def _emit(
        self,
        kind: str,
        path: str,
        is_dir: bool,
        *,
        from_path: str | None = None,
        to_path: str | None = None,
    ) -> None:
        if kind not in self._kinds:
            return
        keys = (
            tuple(p for p in (from_path, to_path) if p is not None) if kind == "moved" else (path,)
        )
        if self._debounce > 0 and kind != "moved" and self._coalesce(kind, path, is_dir):
            return
        if self._dropping:
            if len(self._queue) > self._limit // 2:
                self._dropped += 1
                return
            self._resume_after_drop()
        if len(self._queue) >= self._limit:
            self._dropping, self._dropped = True, 1
            return
        event = WatchEvent(path=path, is_dir=is_dir, from_path=from_path, to_path=to_path)
        ready_at = self._loop.time() + self._debounce if self._debounce > 0 else 0.0
        self._append(_Item(kind, event, ready_at, keys if self._debounce > 0 else ()))

    def _coalesce(self, kind: str, path: str, is_dir: bool) -> bool:
        pending = self._by_path.get(path)
        if not pending:
            return False
        for item in reversed(pending):
            if item.kind == kind and (kind not in _STRUCTURAL or item is pending[-1]):
                item.event.count += 1
                item.event.is_dir = is_dir
                return True
            if item.kind in _STRUCTURAL:
                return False
        return False

    def _control(
        self,
        kind: str,
        *,
        path: str | None = None,
        is_dir: bool | None = None,
        reason: str = "",
        source: str = "",
        dropped: int = 0,
    ) -> None:
        event = WatchEvent(
            path=self.root if path is None else path,
            is_dir=self._root_is_dir if is_dir is None else is_dir,
            reason=reason,
            source=source,
            dropped=dropped,
        )
        self._append(_Item(kind, event, 0.0, ()))

    def _resume_after_drop(self) -> None:
        dropped = self._dropped
        self._dropping, self._dropped = False, 0
        self._control("overflow", source="queue", dropped=dropped)

    def _append(self, item: _Item) -> None:
        self._queue.append(item)
        for key in item.keys:
            self._by_path.setdefault(key, deque()).append(item)
        self._wake.set()

    def _pop(self) -> _Item:
        item = self._queue.popleft()
        for key in item.keys:
            pending = self._by_path.get(key)
            if pending:
                if pending[0] is item:
                    pending.popleft()
                else:
                    with contextlib.suppress(ValueError):
                        pending.remove(item)
                if not pending:
                    del self._by_path[key]
        if self._dropping and len(self._queue) <= self._limit // 2:
            self._resume_after_drop()
        return item

    async def _next(self) -> _Item:
        while True:
            if self._queue:
                delay = self._queue[0].ready_at - self._loop.time()
                if delay <= 0:
                    return self._pop()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                continue
            if self.state == _ACTIVE and self._dropping:
                self._resume_after_drop()
                continue
            self._wake.clear()
            await self._wake.wait()

    async def _pump(self) -> None:
        try:
            await asyncio.sleep(0)  # let the subscribe reply go first
            while True:
                item = await self._next()
                try:
                    await self._ctx.push_event(topic=self.watch_id, name=item.kind, data=item.event)
                except TooLarge:
                    # Paths too long for the client's frame cap: say that events were lost.
                    lost = WatchEvent(
                        path=self.root, is_dir=self._root_is_dir, source="frame", dropped=1
                    )
                    await self._ctx.push_event(topic=self.watch_id, name="overflow", data=lost)
                if item.kind == "ended":
                    break
        except ConnectionLost:
            pass
        except TooLarge:
            log.warning("watch %d: events do not fit the client's frame cap; ended", self.watch_id)
        except Exception:
            log.exception("watch %d: pushing events failed", self.watch_id)
        finally:
            self.state = _ENDED
            self._hub.release_all(self)
            self._queue.clear()
            self._by_path.clear()
            self._owner.forget(self)


class _Waiter:
    """The watches of one ``watch.wait_for_path`` and the flag they raise.

    Watched: every existing directory on the way to the path (and to its
    resolved form, when symlinks lead elsewhere), interested only in the entry
    that leads toward the path and in the directory itself; for
    ``nonempty``, the path itself when it exists.
    """

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
                if exc.errno in _GONE_ERRNOS:
                    self.changed.set()  # changed under us: check again
                    continue
                if exc.errno in (errno.ENOSPC, errno.EMFILE) or directory in mandatory:
                    raise _watch_error(exc, directory) from None
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


class WatchCapability:
    """``watch.subscribe``, ``watch.unsubscribe`` and ``watch.wait_for_path``."""

    def __init__(self, config: Config) -> None:
        self.limits = config.limits
        self.hub = InotifyHub()
        self._subs: dict[int, _Subscription] = {}
        self._by_connection: dict[int, dict[int, _Subscription]] = {}
        self._hooked: set[int] = set()
        self._waiters: set[_Waiter] = set()
        self._ids = itertools.count(1)
        self._closed = False

    def methods(self) -> list[Method]:
        """The dispatch entries of this capability."""
        return [
            Method(SUBSCRIBE, SubscribeParams, self.subscribe),
            Method(UNSUBSCRIBE, UnsubscribeParams, self.unsubscribe),
            Method(WAIT_FOR_PATH, WaitForPathParams, self.wait_for_path),
        ]

    def subscriptions(self, connection_id: int) -> list[int]:
        """The live watch ids of a connection."""
        return list(self._by_connection.get(connection_id, {}))

    async def subscribe(self, params: SubscribeParams, ctx: CallContext) -> SubscribeResult:
        """Start a subscription; events follow as pushed events on its id."""
        if self._closed:
            raise ShuttingDown("execd is shutting down")
        root = _absolute(params.path)
        connection = ctx.connection_id
        if len(self._by_connection.get(connection, {})) >= self.limits.max_watches:
            raise LimitExceeded(
                f"at most {self.limits.max_watches} watches per connection",
                {"limit": self.limits.max_watches},
            )
        watch_id = next(self._ids)
        sub = _Subscription(self, watch_id, ctx, root, params)
        self._by_connection.setdefault(connection, {})[watch_id] = sub
        self._subs[watch_id] = sub
        if connection not in self._hooked:
            self._hooked.add(connection)
            ctx.on_close(lambda: self._connection_closed(connection))
        try:
            await sub.setup(params.follow)
        except BaseException:
            sub.abort()
            raise
        if sub.state == _ENDED:
            if self._closed:
                raise ShuttingDown("execd is shutting down")
            raise Cancelled("the connection closed while the watch was being set up")
        sub.start()
        result = SubscribeResult(watch_id=watch_id, watched=sub.watched)
        # Unwatched paths are named as far as the reply has room; the count is whole.
        room = result_budget(ctx) - encoded_size(result) - _RESULT_FIELDS
        result.unwatched, _ = fit_list(sub.unwatched, room)
        result.unwatched_count = sub.unwatched_count
        return result

    async def unsubscribe(self, params: UnsubscribeParams, ctx: CallContext) -> UnsubscribeResult:
        """End a subscription of this connection."""
        sub = self._by_connection.get(ctx.connection_id, {}).get(params.watch_id)
        if sub is None:
            raise NoSuchWatch(f"no watch {params.watch_id}", {"watch_id": params.watch_id})
        await sub.stop("unsubscribed")
        return UnsubscribeResult(watch_id=params.watch_id)

    async def wait_for_path(self, params: WaitForPathParams, ctx: CallContext) -> WaitForPathResult:
        """Return once ``params.condition`` holds for ``params.path``."""
        if self._closed:
            raise ShuttingDown("execd is shutting down")
        path = _absolute(params.path)
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + params.timeout
        waiter = _Waiter(self.hub, path, params.condition)
        self._waiters.add(waiter)
        try:
            while True:
                if condition_met(path, params.condition):
                    return WaitForPathResult(met=True, waited=loop.time() - start)
                if waiter.abandoned:
                    raise ShuttingDown("execd is shutting down")
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise OperationTimeout(
                        f"{path}: not {params.condition} after {params.timeout:g}s",
                        {"path": path, "condition": params.condition, "timeout": params.timeout},
                    )
                waiter.changed.clear()
                waiter.arm()
                if condition_met(path, params.condition):
                    return WaitForPathResult(met=True, waited=loop.time() - start)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await waiter.changed.wait()
        finally:
            waiter.disarm()
            self._waiters.discard(waiter)

    async def close(self) -> None:
        """End every subscription (pushing ``ended``) and wait; close inotify."""
        self._closed = True
        for waiter in list(self._waiters):
            waiter.abandon()
        subs = list(self._subs.values())
        await asyncio.gather(*(sub.stop("shutdown", grace=1.0) for sub in subs))
        for sub in list(self._subs.values()):
            sub.abort()
        self.hub.close()

    # -- bookkeeping --

    def forget(self, sub: _Subscription) -> None:
        """Drop an ended subscription from the tables (idempotent)."""
        if self._subs.get(sub.watch_id) is sub:
            del self._subs[sub.watch_id]
        mine = self._by_connection.get(sub.connection_id)
        if mine is not None and mine.get(sub.watch_id) is sub:
            del mine[sub.watch_id]
            if not mine:
                del self._by_connection[sub.connection_id]

    def _connection_closed(self, connection: int) -> None:
        self._hooked.discard(connection)
        for sub in list(self._by_connection.pop(connection, {}).values()):
            sub.abort()
