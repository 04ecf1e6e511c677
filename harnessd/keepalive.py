"""Keepalive pings for every connection of an event loop, from one timer per interval.

Theory of operation
-------------------
A client connected with keepalive interval ``T`` sends execd a ping every
``T`` seconds and gives the connection up once nothing has arrived from
execd for ``3 T`` (see :class:`harnessd.client.Client`). A task per
connection would pay a timer, a task wake-up and a coroutine resumption for
every ping; a harness holding a thousand idle sessions pays that 500 times a
second at ``T = 2``. So the connections of one event loop that share an
interval form a *group* with one timer, which fires :data:`SLOTS` times per
interval; each firing serves one slot. A connection joins the slot with the
fewest members, so the pings are spread evenly over the interval (no
firing does more than about ``1 / SLOTS`` of the work, and calls in flight
never wait behind a burst of a thousand pings), and each connection is served
once per interval, the first time within ``T`` of joining.

A member's tick returns False once its connection is done with pings (closed,
or just given up); it then leaves the group, as it does when its client calls
:meth:`Membership.leave`. A group whose last member leaves stops its timer
and forgets itself. Groups belong to one loop and are only touched from that
loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Final

log = logging.getLogger(__name__)

DEFAULT_INTERVAL: Final = 5.0
"""Seconds between pings unless the caller asks otherwise (``connect``, ``serve``).

Why 5: a ping costs the harness 45-60 us here, mostly the loopback ``send()``
(the kernel does the receiving side's TCP work in the sender's call), so a
thousand idle sessions at 2 s took 2.7-3.1% of a core; at 5 s it is under 2%.
The pings hold execd's lease (30 s by default: six pings per lease, and
``serve`` shortens the interval to a third of a shorter lease), and a dead
connection is still given up within 15 s (three intervals).
"""

SLOTS: Final = 16
"""Timer firings per interval; each serves the members of one slot."""

Tick = Callable[[], bool]
"""A member's ping: send it (or give the connection up); False to leave the group."""

_groups: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, _Group]] = (
    weakref.WeakKeyDictionary()
)


class Membership:
    """One connection's place in its loop's keepalive group."""

    __slots__ = ("_group", "_key", "_slot")

    def __init__(self, group: _Group, slot: int, key: int) -> None:
        self._group: _Group | None = group
        self._slot = slot
        self._key = key

    def leave(self) -> None:
        """Stop pinging for this connection (idempotent)."""
        group, self._group = self._group, None
        if group is not None:
            group.remove(self._slot, self._key)


class _Group:
    """The members of one loop sharing one interval, and their timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        self.loop = loop
        self.interval = interval
        self.slots: list[dict[int, Tick]] = [{} for _ in range(SLOTS)]
        self.size = 0
        self.next_key = 0
        self.turn = 0
        self.due = loop.time()
        self.timer: asyncio.TimerHandle | None = None

    def add(self, tick: Tick) -> Membership:
        slot = min(range(SLOTS), key=lambda index: len(self.slots[index]))
        key = self.next_key
        self.next_key += 1
        self.slots[slot][key] = tick
        self.size += 1
        if self.size == 1:
            self.due = self.loop.time()
            self._schedule()
        return Membership(self, slot, key)

    def remove(self, slot: int, key: int) -> None:
        if self.slots[slot].pop(key, None) is None:
            return
        self.size -= 1
        if self.size == 0:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            groups = _groups.get(self.loop)
            if groups is not None and groups.get(self.interval) is self:
                del groups[self.interval]
                if not groups:
                    del _groups[self.loop]

    def _schedule(self) -> None:
        # Absolute times, so the firings do not drift later by the time each takes.
        self.due += self.interval / SLOTS
        self.timer = self.loop.call_at(self.due, self._fire)

    def _fire(self) -> None:
        self.timer = None
        slot = self.turn
        self.turn = (slot + 1) % SLOTS
        members = self.slots[slot]
        finished: list[int] = []
        for key, tick in list(members.items()):
            try:
                if not tick():
                    finished.append(key)
            except Exception:
                log.exception("keepalive tick failed; the connection leaves its group")
                finished.append(key)
        for key in finished:
            self.remove(slot, key)
        if self.size:
            if self.due < self.loop.time() - self.interval:
                self.due = self.loop.time()  # far behind (a stalled loop): do not fire in a burst
            self._schedule()


def join(interval: float, tick: Tick) -> Membership:
    """Call ``tick`` once every ``interval`` seconds on the running loop, until it returns False.

    Must be called from a coroutine or callback of the running loop.
    """
    if not interval > 0:
        raise ValueError("the keepalive interval must be positive")
    loop = asyncio.get_running_loop()
    groups = _groups.setdefault(loop, {})
    group = groups.get(interval)
    if group is None:
        group = groups[interval] = _Group(loop, interval)
    return group.add(tick)
