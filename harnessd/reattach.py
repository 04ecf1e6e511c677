"""Calls that outlive their connection: the client's side of request ids.

Theory of operation
-------------------
Every call the client sends carries a fresh 128-bit random request id
(PROTOCOL.md section 8.1), except the few that belong to their connection
(:data:`protocol.rpc.request.CONNECTION_SCOPED`). execd keeps such a call
running for a grace period when the connection is lost and keeps its outcome
for a while once it has finished.

When a client that allows reattaching (``reattach_within > 0``) loses its
connection, its calls in flight that carry an id are not failed: each becomes
an :class:`Orphan` that remembers the request id, the future the caller
awaits, and how many bytes of each output stream it has received. Its
``on_lost`` callback runs (a :class:`~harnessd.launcher.Session` reconnects
from there). A new client then :func:`adopt`\\ s the orphans: for each it sends
``request.attach`` with the id and the offsets, its answer settles the
original future, and the stream iterators of the original call carry on with
the attach call's streams, which start exactly where the received bytes end.
An attach call is itself tracked under the same id, so a second loss
orphans it again and a third connection picks it up. Orphans nobody adopts
within ``reattach_within`` seconds fail with ConnectionLost.

A call is sent again only when execd says it never arrived: an attach
carries the server nonce of the connection the call was sent on, and when
execd does not know the id but that connection was its own
(``NotKnown.seen``), the call cannot have run -- it is sent again under the
same id (a copy still on its way would attach to it instead of running).
Calls that streamed an upload are not sent again. Otherwise (execd
restarted, or the outcome was evicted) the caller gets
:class:`~harnessd.errors.RequestNotKnown` and decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec

from harnessd.errors import ConnectionLost, HarnessError
from protocol import limits
from protocol.bridge import Stream
from protocol.errors import ErrorCode
from protocol.messages import Error, Reply
from protocol.rpc import request as api

if TYPE_CHECKING:
    from harnessd.api import ExecdClient
    from harnessd.client import Client, ClientProtocol

log = logging.getLogger("harnessd.reattach")

#: Seconds a session's calls in flight wait for a reconnect (execd's default grace).
DEFAULT_REATTACH_WITHIN = 30.0


#: 256 request ids side by side: one block of random bytes cut into ids in one call.
_IDS = struct.Struct(f"{limits.REQUEST_ID_SIZE}s" * 256)
_pool: list[bytes] = []


def new_request_id() -> bytes:
    """A fresh request id: 128 random bits, so ids cannot be guessed across sessions.

    Drawn from ``os.urandom`` 256 ids at a time: one system call per 256 calls.
    """
    if not _pool:
        _pool.extend(_IDS.unpack(os.urandom(_IDS.size)))
    return _pool.pop()


class Tracked(msgspec.Struct, eq=False):
    """What the client keeps of a call with a request id while it is in flight.

    ``params`` (already encoded) and ``method`` let a call that never reached
    execd be sent again under the same id; ``sent_on`` is the server nonce of
    the connection it was sent on; ``uploads``: it sent stream data, which
    cannot be sent again. A Struct (never encoded): one is built per call, in C.
    """

    rid: bytes
    method: str
    params: msgspec.Raw
    sent_on: bytes
    uploads: bool = False


@dataclass(frozen=True, slots=True)
class Moved:
    """Where an orphaned call goes on: the call that carries it now and its stream buffers."""

    proto: ClientProtocol
    call_id: int
    streams: dict[str, Stream]


@dataclass(eq=False, slots=True)
class Orphan:
    """A call in flight whose connection was lost, waiting for a new connection."""

    tracked: Tracked
    future: asyncio.Future[Reply | Error]
    offsets: dict[str, int]
    streams: tuple[str, ...]
    #: Where it went (None: nowhere further; its streams end where they are).
    moved: asyncio.Future[Moved | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def rid(self) -> bytes:
        return self.tracked.rid

    def fail(self, failure: BaseException) -> None:
        """Nobody adopted it in time: the caller gets ``failure``."""
        if not self.future.done():
            self.future.set_exception(failure)
            self.future.exception()
        if not self.moved.done():
            self.moved.set_exception(failure)
            self.moved.exception()


def orphan_calls(proto: ClientProtocol) -> list[Orphan]:
    """The tracked calls in flight on a connection that was just lost, as orphans.

    Their records are taken out of ``proto.pending`` (they must not fail with
    the connection); what is left there fails as before.
    """
    orphans: list[Orphan] = []
    pending = proto.pending
    for call_id in [call_id for call_id, record in pending.items() if record.tracked is not None]:
        record = pending.pop(call_id)
        tracked, future = record.tracked, record.future
        if tracked is None or future.done():
            continue
        base = record.base or {}
        received = record.received or {}
        names = set(base) | set(received) | set(proto.stream_names(call_id))
        offsets = {name: base.get(name, 0) + received.get(name, 0) for name in names}
        orphan = Orphan(tracked, future, offsets, tuple(sorted(names)))
        proto.orphans[call_id] = orphan
        orphans.append(orphan)
    return orphans


def adopt(client: Client, orphans: list[Orphan]) -> None:
    """Reattach ``orphans`` on ``client``'s connection (see the module docstring)."""
    for orphan in orphans:
        if orphan.future.done() or orphan.moved.done():
            continue
        tracked = orphan.tracked
        params = api.AttachParams(
            rid=tracked.rid, offsets=dict(orphan.offsets), sent_on=tracked.sent_on or None
        )
        try:
            call_id, future = client._send_call(api.ATTACH.name, params, tracked=tracked)
        except ConnectionLost as exc:
            orphan.fail(exc)
            continue
        proto = client._proto
        proto.pending[call_id].base = dict(orphan.offsets)
        # Bind the buffers now: the attach's answer may come before anyone reads them.
        streams = {name: proto.stream(call_id, name) for name in orphan.streams}
        # Where the attach call's own streams go if the call is sent again (below).
        relay = Orphan(tracked, orphan.future, {}, orphan.streams)
        proto.orphans[call_id] = relay
        future.add_done_callback(functools.partial(_answered, client, relay))
        orphan.moved.set_result(Moved(proto, call_id, streams))


def _answered(client: Client, relay: Orphan, done: asyncio.Future[Reply | Error]) -> None:
    """The answer to an attach: the call's outcome, or "never arrived": send it again."""
    tracked = relay.tracked
    answer = None if done.cancelled() or done.exception() is not None else done.result()
    if (
        isinstance(answer, Error)
        and answer.code == ErrorCode.REQUEST_NOT_KNOWN
        and not tracked.uploads
        and _never_arrived(answer)
        and not relay.future.done()
    ):
        try:
            tracked.sent_on = client._proto.conn.server_nonce
            call_id, future = client._send_call(tracked.method, tracked.params, tracked=tracked)
        except ConnectionLost as exc:
            relay.fail(exc)
            return
        proto = client._proto
        streams = {name: proto.stream(call_id, name) for name in relay.streams}
        future.add_done_callback(functools.partial(_settle, relay.future))
        relay.moved.set_result(Moved(proto, call_id, streams))
        return
    if not relay.moved.done():
        relay.moved.set_result(None)
    _settle(relay.future, done)


def _never_arrived(answer: Error) -> bool:
    """A REQUEST_NOT_KNOWN saying the id is unknown to the execd the call was sent to."""
    try:
        data = msgspec.msgpack.decode(answer.data, type=api.NotKnown)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return data.reason == "unknown" and data.seen


def _settle(target: asyncio.Future[Reply | Error], done: asyncio.Future[Reply | Error]) -> None:
    if target.done():
        return
    if done.cancelled():
        target.cancel()
    elif (exc := done.exception()) is not None:
        target.set_exception(exc)
        target.exception()
    else:
        target.set_result(done.result())


async def follow(
    proto: ClientProtocol, call_id: int, name: str
) -> tuple[ClientProtocol, int, Stream] | None:
    """Where stream ``name`` of a lost call continues; None when it goes nowhere further.

    Raises ConnectionLost when nobody adopted the call in time.
    """
    orphan = proto.orphans.get(call_id)
    if orphan is None:
        return None
    moved = await asyncio.shield(orphan.moved)
    if moved is None:
        return None
    source = moved.streams.get(name) or moved.proto.stream(moved.call_id, name)
    return moved.proto, moved.call_id, source


class Reconnectable(Protocol):
    """A session whose client a :class:`Reconnector` replaces (harnessd.launcher.Session)."""

    client: ExecdClient

    @property
    def closed(self) -> bool: ...

    async def reconnect(self, *, timeout: float | None = None) -> ExecdClient: ...

    async def dial(self, timeout: float | None) -> ExecdClient: ...


@dataclass(eq=False, repr=False)
class Reconnector:
    """Reconnects a session whose connection was lost with calls in flight.

    ``lost()`` (a client's ``on_lost``) starts one background attempt: while
    the session is open and its current client is closed, ``reconnect()`` is
    tried again and again (backing off from 50 ms to 1 s) until it succeeds
    -- the new client adopts the orphans -- or ``window`` seconds have passed,
    after which the orphans fail by themselves.
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
        """Dial a new client for the session; it adopts the calls in flight of the old one."""
        session = self._session
        assert session is not None, "swap() needs a reconnector made by of()"
        async with self._lock:
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
                log.info("reconnecting to reattach calls in flight failed: %s", exc)
            await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
            pause = min(pause * 2, 1.0)

    async def stop(self) -> None:
        """Stop trying (the session is closing)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
