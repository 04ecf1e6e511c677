"""The queue of one watch subscription: bounded, debounced, never silent about a loss.

Theory of operation. A subscription puts *change* events (created, deleted,
moved, modified, closed_write, attrib) and *control* events (overflow,
root_deleted, ended, watch_limit, watch_failed) into one :class:`EventQueue`,
and its pump takes them out in order with :meth:`EventQueue.next`.

* Kinds: change events of a kind the subscriber did not ask for are not
  queued at all.
* Bound: the queue holds at most ``limit`` change events. Beyond that it
  drops them and counts them until it has drained to half, when one
  ``overflow`` event (source ``queue``, the count in ``dropped``) is queued
  and changes are taken again; a pump that finds the queue empty while
  dropping queues it at once. Control events are never dropped.
* Debounce: with a window, a change event waits ``debounce`` seconds before
  the pump may take it, and a repeat of its kind for its path merges into it
  (``count`` goes up) until a structural event (created, deleted, moved) for
  that path is queued after it. ``moved`` events never merge. Each waiting
  event is indexed under its paths for that lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Final

from protocol.rpc.watch import WatchEvent

STRUCTURAL: Final = frozenset({"created", "deleted", "moved"})
"""Change kinds that end the merging of earlier events for their path."""


class Item:
    """One queued event; ``keys`` are the paths it is indexed under for debounce."""

    __slots__ = ("event", "keys", "kind", "ready_at")

    def __init__(self, kind: str, event: WatchEvent, ready_at: float, keys: tuple[str, ...]):
        self.kind = kind
        self.event = event
        self.ready_at = ready_at
        self.keys = keys


class EventQueue:
    """Events waiting for the pump; see the module docstring.

    ``kinds`` are the change kinds to queue; ``overflowed(dropped)`` makes
    the ``overflow`` event that reports ``dropped`` lost change events.
    """

    def __init__(
        self,
        limit: int,
        debounce: float,
        kinds: frozenset[str],
        overflowed: Callable[[int], WatchEvent],
    ) -> None:
        self._kinds = kinds
        self._limit = max(1, limit)
        self._debounce = debounce
        self._overflowed = overflowed
        self._loop = asyncio.get_running_loop()
        self._queue: deque[Item] = deque()
        self._by_path: dict[str, deque[Item]] = {}
        self._dropping = False
        self._dropped = 0
        self._wake = asyncio.Event()

    @property
    def last(self) -> Item | None:
        """The event queued last, if any is waiting."""
        return self._queue[-1] if self._queue else None

    def change(
        self,
        kind: str,
        path: str,
        is_dir: bool,
        *,
        from_path: str | None = None,
        to_path: str | None = None,
    ) -> None:
        """Queue a change event (merged, or dropped and counted, as the module says)."""
        if kind not in self._kinds:
            return
        debounce = self._debounce
        if debounce > 0 and kind != "moved" and self._coalesce(kind, path, is_dir):
            return
        if self._dropping:
            if len(self._queue) > self._limit // 2:
                self._dropped += 1
                return
            self._resume()
        if len(self._queue) >= self._limit:
            self._dropping, self._dropped = True, 1
            return
        keys: tuple[str, ...] = ()
        if debounce > 0:
            keys = (
                tuple(p for p in (from_path, to_path) if p is not None)
                if kind == "moved"
                else (path,)
            )
        event = WatchEvent(path=path, is_dir=is_dir, from_path=from_path, to_path=to_path)
        ready_at = self._loop.time() + debounce if debounce > 0 else 0.0
        self._append(Item(kind, event, ready_at, keys))

    def control(self, kind: str, event: WatchEvent) -> None:
        """Queue a control event: never dropped, never delayed."""
        self._append(Item(kind, event, 0.0, ()))

    def release(self) -> None:
        """Make everything queued ready now and report what was dropped (the end is near)."""
        self._by_path.clear()
        for item in self._queue:
            item.ready_at = 0.0
        if self._dropping:
            self._resume()

    def clear(self) -> None:
        """Discard everything queued, and the count of what was dropped."""
        self._queue.clear()
        self._by_path.clear()
        self._dropping, self._dropped = False, 0

    async def next(self) -> Item:
        """The next event once it is ready (waiting for one to be queued)."""
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
            if self._dropping:
                self._resume()
                continue
            self._wake.clear()
            await self._wake.wait()

    def _coalesce(self, kind: str, path: str, is_dir: bool) -> bool:
        pending = self._by_path.get(path)
        if not pending:
            return False
        for item in reversed(pending):
            if item.kind == kind and (kind not in STRUCTURAL or item is pending[-1]):
                item.event.count += 1
                item.event.is_dir = is_dir
                return True
            if item.kind in STRUCTURAL:
                return False
        return False

    def _resume(self) -> None:
        dropped = self._dropped
        self._dropping, self._dropped = False, 0
        self.control("overflow", self._overflowed(dropped))

    def _append(self, item: Item) -> None:
        self._queue.append(item)
        for key in item.keys:
            self._by_path.setdefault(key, deque()).append(item)
        self._wake.set()

    def _pop(self) -> Item:
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
            self._resume()
        return item
