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
queued events. A recursive subscription mirrors the watched directories in a
:class:`~execd.watch_tree.DirectoryTree`, so a renamed directory keeps its
watches. New directories are watched first and scanned second; entries the
scan finds are reported as ``created`` and remembered until the descriptor
is next read empty, so the kernel's own event for an entry created in that
window is not reported twice.

Delivery: a pump task per subscription pushes the events of its
:class:`~execd.watch_queue.EventQueue` in order; that module says how the
queue is bounded (``Limits.watch_queue``, one ``overflow`` event for what was
dropped) and debounced. Control events (overflow, root_deleted, ended,
watch_limit, watch_failed) are never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import stat
from typing import Final

from execd.config import Config
from execd.context import CallContext, ConnectionLost, Method, bind
from execd.errors import (
    Cancelled,
    InvalidPath,
    LimitExceeded,
    NoSuchWatch,
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
from execd.path_wait import PathWaiter
from execd.watch_queue import EventQueue
from execd.watch_tree import GONE_ERRNOS, DirectoryTree, Node, watch_error
from protocol.rpc.watch import (
    CHANGE_KINDS,
    MAX_UNWATCHED_REPORTED,
    RPCS,
    SubscribeParams,
    SubscribeResult,
    UnsubscribeParams,
    UnsubscribeResult,
    WaitForPathParams,
    WaitForPathResult,
    WatchEvent,
)

log = logging.getLogger(__name__)

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


class _Subscription:
    """One ``watch.subscribe``: its watches, its queue and its pump task.

    The subscription is the hub's :class:`~execd.inotify.WatchUser` for every
    watch its :class:`~execd.watch_tree.DirectoryTree` holds; it translates
    the kernel's events into the protocol's and queues them in its
    :class:`~execd.watch_queue.EventQueue`.
    """

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
        self._loop = asyncio.get_running_loop()
        self.state = _ACTIVE
        self._root_is_dir = False
        self._tree = DirectoryTree(self._hub, self, root, self._unwatchable)
        self._queue = EventQueue(
            owner.limits.watch_queue, params.debounce, frozenset(kinds), self._overflow_event
        )
        self._synthesized: set[str] = set()
        self._drain_requested = False
        self._task: asyncio.Task[None] | None = None
        self._setting_up = True
        self._limit_hit = False
        self.unwatched: list[str] = []
        self.unwatched_count = 0

    # -- lifecycle --

    @property
    def watched(self) -> int:
        """How many inotify watches the subscription holds."""
        return len(self._tree)

    async def setup(self, follow: bool) -> None:
        """Watch the root (and, if recursive, the tree below it)."""
        try:
            st = os.stat(self.root) if follow else os.lstat(self.root)
        except OSError as exc:
            raise from_oserror(exc, self.root) from None
        try:
            wd, _ = self._hub.acquire(self, self.root, follow=follow)
        except OSError as exc:
            raise watch_error(exc, self.root) from None
        self._root_is_dir = stat.S_ISDIR(st.st_mode)
        root_node = self._tree.set_root(wd)
        if self.recursive and self._root_is_dir:
            walk = self._tree.walk(root_node, self.root, halted=self._halted)
            for steps, _ in enumerate(walk, 1):
                if self._halted():
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
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._owner.forget(self)

    def _halted(self) -> bool:
        return self._limit_hit or self.state != _ACTIVE

    def _finish_root_gone(self, reason: str) -> None:
        if self.state != _ACTIVE:
            return
        self.state = _ENDING
        self._hub.release_all(self)
        self._queue.release()
        self._control("root_deleted", reason=reason)
        self._control("ended", reason="root_deleted")

    # -- WatchUser callbacks: the kernel's events translated --

    def on_event(self, event: RawEvent) -> None:
        """Translate one kernel event on a watched directory (or the root)."""
        if self.state != _ACTIVE:
            return
        node = self._tree.node(event.wd)
        if node is None:
            return
        mask = event.mask
        if not event.name:
            if node is not self._tree.root_node:
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
            path, is_dir = os.path.join(self._tree.path_of(node), event.name), bool(mask & IN_ISDIR)
        if mask & IN_CREATE:
            if path in self._synthesized:
                self._synthesized.discard(path)
                return
            self._queue.change("created", path, is_dir)
            if is_dir and self.recursive:
                self._watch_new(node, event.name, path, synthesize=True)
        elif mask & IN_DELETE:
            self._synthesized.discard(path)
            self._queue.change("deleted", path, is_dir)
            if is_dir and self.recursive:
                self._tree.remove(node, event.name)
        elif mask & IN_MODIFY:
            self._queue.change("modified", path, is_dir)
        elif mask & IN_CLOSE_WRITE:
            self._queue.change("closed_write", path, is_dir)
        elif mask & IN_ATTRIB:
            self._queue.change("attrib", path, is_dir)

    def on_move(self, source: RawEvent | None, target: RawEvent | None) -> None:
        """A rename, with the sides inside this subscription's watches."""
        if self.state != _ACTIVE:
            return
        tree = self._tree
        src_node = tree.node(source.wd) if source is not None else None
        dst_node = tree.node(target.wd) if target is not None else None
        src_path = dst_path = None
        if source is not None and src_node is not None:
            src_path = os.path.join(tree.path_of(src_node), source.name)
            self._synthesized.discard(src_path)
        if target is not None and dst_node is not None:
            dst_path = os.path.join(tree.path_of(dst_node), target.name)
            if dst_path in self._synthesized:
                self._synthesized.discard(dst_path)
                if src_path is None:
                    return  # a scan already reported it as created
        if src_path is None and dst_path is None:
            return
        sample = source if source is not None else target
        is_dir = sample is not None and bool(sample.mask & IN_ISDIR)
        self._queue.change(
            "moved",
            dst_path if dst_path is not None else str(src_path),
            is_dir,
            from_path=src_path,
            to_path=dst_path,
        )
        if not (is_dir and self.recursive):
            return
        if src_node is not None and source is not None:
            new_name = target.name if target is not None else ""
            if tree.move(src_node, source.name, dst_node, new_name) or dst_node is None:
                return
        if dst_node is not None and target is not None and dst_path is not None:
            self._watch_new(dst_node, target.name, dst_path, synthesize=src_path is None)

    def on_overflow(self) -> None:
        """The kernel queue overflowed: say so, and re-learn the tree."""
        if self.state != _ACTIVE:
            return
        last = self._queue.last
        if last is None or last.kind != "overflow" or last.event.source != "kernel":
            self._control("overflow", source="kernel")
        if self.recursive and self._root_is_dir:
            self._tree.resync()

    def on_ignored(self, wd: int) -> None:
        """The kernel dropped ``wd``: the directory is gone."""
        node = self._tree.node(wd)
        if node is None or self.state != _ACTIVE:
            return
        if node is self._tree.root_node:
            self._finish_root_gone("deleted")
            return
        self._tree.forget(wd)

    # -- new directories --

    def _watch_new(self, parent: Node, name: str, path: str, *, synthesize: bool) -> None:
        """Watch a directory that appeared, and everything already in it.

        With ``synthesize``, the entries the scan finds are reported as
        ``created`` and remembered until the hub next reads its descriptor
        empty, so the kernel's own event for one created meanwhile is not
        reported twice.
        """
        child, fresh = self._tree.add(parent, name, path)
        if child is None or not fresh:
            return
        found = self._synthesize if synthesize else None
        for _ in self._tree.walk(child, path, found=found, halted=self._halted):
            pass

    def _synthesize(self, path: str, is_dir: bool) -> None:
        if not self._drain_requested:
            self._drain_requested = True
            self._hub.after_drain(self._on_drained)
        self._synthesized.add(path)
        self._queue.change("created", path, is_dir)

    def _on_drained(self) -> None:
        """Every kernel event of the scans so far has been seen."""
        self._drain_requested = False
        self._synthesized.clear()

    def _unwatchable(self, path: str, exc: OSError) -> None:
        if exc.errno in GONE_ERRNOS:
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

    # -- queueing and delivery --

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
        self._queue.control(kind, event)

    def _overflow_event(self, dropped: int) -> WatchEvent:
        return WatchEvent(path=self.root, is_dir=self._root_is_dir, source="queue", dropped=dropped)

    async def _pump(self) -> None:
        try:
            await asyncio.sleep(0)  # let the subscribe reply go first
            while True:
                item = await self._queue.next()
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
            self._owner.forget(self)


class WatchCapability:
    """``watch.subscribe``, ``watch.unsubscribe`` and ``watch.wait_for_path``."""

    def __init__(self, config: Config) -> None:
        self.limits = config.limits
        self.hub = InotifyHub()
        self._subs: dict[int, _Subscription] = {}
        self._by_connection: dict[int, dict[int, _Subscription]] = {}
        self._hooked: set[int] = set()
        self._waiters: set[PathWaiter] = set()
        self._ids = itertools.count(1)
        self._closed = False

    def methods(self) -> list[Method]:
        """The dispatch entries of this capability."""
        return bind(self, RPCS)

    def subscriptions(self, connection_id: int) -> list[int]:
        """The live watch ids of a connection."""
        return list(self._by_connection.get(connection_id, {}))

    async def watch_subscribe(self, params: SubscribeParams, ctx: CallContext) -> SubscribeResult:
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

    async def watch_unsubscribe(
        self, params: UnsubscribeParams, ctx: CallContext
    ) -> UnsubscribeResult:
        """End a subscription of this connection."""
        sub = self._by_connection.get(ctx.connection_id, {}).get(params.watch_id)
        if sub is None:
            raise NoSuchWatch(f"no watch {params.watch_id}", {"watch_id": params.watch_id})
        await sub.stop("unsubscribed")
        return UnsubscribeResult(watch_id=params.watch_id)

    async def watch_wait_for_path(
        self, params: WaitForPathParams, ctx: CallContext
    ) -> WaitForPathResult:
        """Return once ``params.condition`` holds for ``params.path``."""
        if self._closed:
            raise ShuttingDown("execd is shutting down")
        path = _absolute(params.path)
        waiter = PathWaiter(self.hub, path, params.condition)
        self._waiters.add(waiter)
        try:
            waited = await waiter.wait(params.timeout)
        finally:
            self._waiters.discard(waiter)
        return WaitForPathResult(met=True, waited=waited)

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
