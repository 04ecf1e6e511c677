"""Reconnecting by itself: a session whose connection is lost gets a new one.

Theory of operation
-------------------
Every call the client sends carries a fresh request id (PROTOCOL.md
section 8.1), so execd keeps a call running for a grace period when its
connection is lost, and keeps its outcome for a while once it has finished.
How a call goes on over another connection is the client's business
(:mod:`harnessd.calls`): a client that allows reattaching
(``reattach_within > 0``) keeps its tracked calls in flight when its
connection is lost, and another client takes them on with
:meth:`~harnessd.client.Client.adopt`.

This module decides *when* to reconnect, above the client: a
:class:`Reconnector` listens on its session's current client (``on_lost``,
called when the connection is lost, with or without calls in flight, and
when a call is made on the lost connection) and dials a new client in the
background, again and again (backing off from 50 ms to 1 s) for
``reattach_within`` seconds. The new client becomes the session's client and
adopts what the old one had in flight; calls made on the old one while it
was down were not sent and wait for the new one, then are sent there (or
fail with :class:`~harnessd.errors.NotSent` once the window has passed).
It drives the client through its public surface only: ``on_lost``,
``closed``, :meth:`~harnessd.client.Client.release` and
:meth:`~harnessd.client.Client.adopt`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from harnessd.errors import HarnessError

if TYPE_CHECKING:
    from harnessd.api import ExecdClient
    from harnessd.client import Client

log = logging.getLogger("harnessd.reattach")

#: Seconds a session's calls in flight wait for a reconnect (execd's default grace).
DEFAULT_REATTACH_WITHIN = 30.0


class Reconnectable(Protocol):
    """A session whose client a :class:`Reconnector` replaces (harnessd.launcher.Session)."""

    client: ExecdClient

    @property
    def closed(self) -> bool: ...

    async def reconnect(self, *, timeout: float | None = None) -> ExecdClient: ...

    async def dial(self, timeout: float | None) -> ExecdClient: ...


@dataclass(eq=False, repr=False)
class Reconnector:
    """Reconnects a session whose connection was lost.

    ``lost()`` (a client's ``on_lost``) starts one background attempt unless
    one is under way: while the session is open and its current client is
    closed, ``reconnect()`` is tried again and again (backing off from 50 ms
    to 1 s) until it succeeds -- the new client adopts the calls the old one
    had in flight or was asked to make while down -- or ``window`` seconds
    have passed, after which those calls fail by themselves.
    """

    reconnect: Callable[[], Awaitable[object]]
    current: Callable[[], Client]
    closed: Callable[[], bool]
    window: float
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _session: Reconnectable | None = field(default=None, init=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    @classmethod
    def of(cls, session: Reconnectable, window: float) -> Reconnector:
        """The reconnector of ``session``: its current client's loss reconnects it."""
        self = cls(session.reconnect, lambda: session.client, lambda: session.closed, window)
        self._session = session
        session.client.on_lost = self.lost
        return self

    async def swap(self, timeout: float | None) -> ExecdClient:
        """Dial a new client for the session; it adopts the calls in flight of the old one.

        A swap that waited for another one (the background reconnection) and
        finds the session's client replaced and open returns that client.
        """
        session = self._session
        assert session is not None, "swap() needs a reconnector made by of()"
        before = session.client
        async with self._lock:
            if session.client is not before and not session.client.closed:
                return session.client
            client = await session.dial(timeout)
            client.on_lost = self.lost
            old, session.client = session.client, client
            client.adopt(await old.release())
        return client

    def lost(self) -> None:
        if self.closed() or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window
        pause = 0.05
        while not self.closed() and self.current().closed and loop.time() < deadline:
            try:
                await self.reconnect()
                return
            except HarnessError as exc:
                log.info("reconnecting to execd failed: %s", exc)
            await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
            pause = min(pause * 2, 1.0)

    async def stop(self) -> None:
        """Stop trying (the session is closing)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
