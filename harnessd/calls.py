"""The client's one record of each call, from its send to its answer, across connections.

Theory of operation
-------------------
Every call the client sends has one :class:`PendingCall`. It books the facts
of the call once: the future its caller awaits, its request id and what it
takes to send it again (:class:`Tracked`), the connection and call id it is
on now, its inbound streams, and how many bytes of each it has received. The
send path, the stream readers and reattaching all use this one record.

*In flight.* The connection's glue (:class:`~harnessd.client.ClientProtocol`)
keeps the record under its call id and counts each chunk of a tracked call
into ``offsets``.

*Streams belong to the call.* Each inbound stream of the call is one
:class:`~protocol.bridge.Stream`, kept in the record from the first chunk or
the first reader on. Bytes that arrive before anyone reads them wait there,
even once the call has been answered, so a reader made late
(:meth:`PendingCall.stream`) still gets every byte.

*Orphaned.* When the connection is lost and its client allows reattaching
(``reattach_within > 0``), a tracked call in flight is not failed: its record
becomes an orphan (``moved`` is a pending future) and waits up to
``reattach_within`` seconds for another client to carry it on
(:meth:`~harnessd.client.Client.adopt`). Its readers first read what had
arrived, then wait on ``moved``.

*Carried on.* The new connection sends ``request.attach`` with the request
id, the bytes held per stream and the nonce of the connection the call was
last sent on (PROTOCOL.md 8.1). The record, its stream records with it,
moves to the attach call, so every reader goes on where it was. When execd
says the call never arrived (``REQUEST_NOT_KNOWN`` with ``seen``) and it
streamed no upload, it is sent again under the same id on the same
connection, and the record moves again. A call made while its connection
was down (``sent`` false) is simply sent on the new one. A cancel goes to
the call's current wire call, whatever it is: execd binds an attach to the
call on receipt, so a cancel of the attach cancels the call, even right
behind it; one asked while the call is between connections is sent right
behind the attach.

*Settled.* The final answer settles the caller's future and ends the
streams. An orphan nobody carries on in time fails with ConnectionLost, or
with :class:`~harnessd.errors.NotSent` when it had never been sent.
"""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Protocol

import msgspec

from protocol import limits
from protocol.bridge import Stream
from protocol.errors import ErrorCode
from protocol.messages import Error, Reply
from protocol.rpc import request as requests_rpc

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
    """What it takes to find a call again by its request id, or to send it again.

    ``params`` (already encoded) and ``method`` let a call that never reached
    execd be sent again under the same id; ``sent_on`` is the server nonce of
    the connection it was last sent on; ``uploads``: it sent stream data,
    which cannot be sent again. A Struct (never encoded): one is built per
    call, in C.
    """

    rid: bytes
    method: str
    params: msgspec.Raw
    sent_on: bytes
    uploads: bool = False


class Carrier(Protocol):
    """The connection a call is on, as its record uses it (:class:`~harnessd.client.ClientProtocol`)."""

    def call_stream(self, call: PendingCall, name: str) -> Stream:
        """Stream ``name`` of ``call``, kept in the call's record."""
        ...

    def send_cancel(self, call_id: int) -> None:
        """Ask execd to cancel call ``call_id`` (nothing happens if it cannot be sent)."""
        ...

    async def send_stream(self, call_id: int, stream: str, data: bytes, *, end: bool) -> None:
        """Send ``data`` on a stream of call ``call_id`` (flow-controlled)."""
        ...


class PendingCall(msgspec.Struct, eq=False):
    """One call of the client until it is answered, on whichever connection it is.

    A Struct (never encoded): one is built per call, in C. The glue of the
    connection it is on (``proto``) moves it; callers read it.
    """

    #: The caller's: settled with the call's final answer.
    future: asyncio.Future[Reply | Error]
    #: Its request id and what it takes to send it again (None: not tracked).
    tracked: Tracked | None
    #: The connection the call is on now, and its call id there.
    proto: Carrier
    call_id: int
    #: Its inbound streams by name (None until the first chunk or reader).
    streams: dict[str, Stream] | None = None
    #: Bytes received per stream since the call's output began (tracked calls only).
    offsets: dict[str, int] | None = None
    #: Pending while the call waits for another connection; failed when it never gets one.
    moved: asyncio.Future[None] | None = None
    #: False for a call made while its connection was down: carried on, it is sent, not attached.
    sent: bool = True
    #: Its current wire call is a ``request.attach`` (whose answer may say "never arrived").
    attaching: bool = False
    #: A cancel was asked (it goes to wherever the call is).
    cancelled: bool = False
    #: The final answer has been handed to ``future``.
    settled: bool = False

    @property
    def rid(self) -> bytes | None:
        """The call's request id (None without one)."""
        tracked = self.tracked
        return tracked.rid if tracked is not None else None

    @property
    def waiting(self) -> bool:
        """Whether the call waits for another connection to carry it on."""
        moved = self.moved
        return moved is not None and not moved.done()

    def stream(self, name: str) -> Stream:
        """Stream ``name`` of the call: its record from the first byte on, wherever the call goes."""
        return self.proto.call_stream(self, name)

    def cancel(self) -> None:
        """Ask execd to cancel the call, on the connection it is on now or the one it goes to."""
        if self.settled:
            return
        self.cancelled = True
        if self.moved is None:
            self.proto.send_cancel(self.call_id)

    def fail(self, failure: BaseException) -> None:
        """The call will not be answered: its caller and its readers get ``failure``."""
        future = self.future
        if not future.done():
            future.set_exception(failure)
            future.exception()
        moved = self.moved
        if moved is None:
            moved = self.moved = future.get_loop().create_future()
        if not moved.done():
            moved.set_exception(failure)
            moved.exception()

    def land(self) -> None:
        """The call is on a connection again: wake its readers."""
        moved, self.moved = self.moved, None
        if moved is not None and not moved.done():
            moved.set_result(None)


def never_arrived(answer: Reply | Error) -> bool:
    """An attach's answer saying execd never got the call from the connection it was sent on."""
    if type(answer) is not Error or answer.code != ErrorCode.REQUEST_NOT_KNOWN:
        return False
    try:
        data = msgspec.msgpack.decode(answer.data, type=requests_rpc.NotKnown)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return data.reason == "unknown" and data.seen


class StreamCursor:
    """The blocks of one inbound stream of a call, one :meth:`next` at a time.

    The stream's record is bound when the cursor is made. When the call's
    connection is lost and another client carries the call on, the cursor
    reads on from the same record: the bytes that had arrived, then those
    the new connection brings.
    """

    __slots__ = ("_call", "_source")

    def __init__(self, call: PendingCall, name: str) -> None:
        self._call = call
        self._source = call.stream(name)

    async def next(self) -> bytes | None:
        """The next block; None once the stream has ended."""
        while True:
            try:
                return await self._source.read()
            except Exception:
                moved = self._call.moved
                if moved is None:
                    raise
                await asyncio.shield(moved)  # raises the call's failure when it goes nowhere
