"""The async client of execd: connect, call, stream, cancel.

Three layers, as in the daemon: the sans-I/O :class:`~protocol.connection.ClientConnection`, the asyncio glue :class:`ClientProtocol` (an
``asyncio.BufferedProtocol`` receiving in place, so the hot path costs two
small callbacks per read, under uvloop or the default loop), and the user API
:class:`Client`, whose typed methods per capability live in
:mod:`harnessd.api`.

Example::

    client = await harnessd.connect("127.0.0.1", port, token)
    result = await client.run(["echo", "hi"])
    await client.close()

A call whose awaiting task is cancelled is cancelled in execd too (a Cancel
message); execd's final answer to it is then discarded. Each call has one
record, :class:`~harnessd.calls.PendingCall`, that the send path, its streams
and reattaching share; :mod:`harnessd.calls` tells how a call goes on over
another connection.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, Self, TypeVar, overload

import msgspec

from harnessd import keepalive as keepalive_group
from harnessd.calls import PendingCall, StreamCursor, Tracked, never_arrived, new_request_id
from harnessd.errors import (
    AuthenticationFailed,
    ConnectFailed,
    ConnectionLost,
    HandshakeFailed,
    NotAnExecd,
    NotSent,
    ProtocolViolation,
    remote_error,
)
from protocol import limits
from protocol.bridge import FramedProtocol, Stream
from protocol.codec import from_raw, to_raw
from protocol.connection import ClientConnection, ConnectionEvent, HandshakeComplete
from protocol.errors import ErrorCode, ProtocolError, RemoteProtocolError, SplitexecError
from protocol.handshake import token_bytes
from protocol.messages import Abort, Call, Cancel, Chunk, Error, Event, Ping, Reply
from protocol.rpc import Rpc
from protocol.rpc import request as requests_rpc
from protocol.rpc.core import NoParams

T = TypeVar("T")
P = TypeVar("P")
R = TypeVar("R")

_EMPTY_PARAMS = msgspec.Raw(b"\x80")
#: Violations only a peer that does not speak the protocol commits before its Challenge.
_FOREIGN_PEER = frozenset(
    {
        ErrorCode.FRAME_TOO_LARGE,
        ErrorCode.MALFORMED_MESSAGE,
        ErrorCode.INVALID_MESSAGE,
        ErrorCode.UNKNOWN_MESSAGE_TYPE,
        ErrorCode.UNEXPECTED_MESSAGE,
    }
)
#: Events kept for topics nobody has subscribed to yet (oldest topics dropped first).
MAX_EARLY_EVENTS = 4096


def _code_name(code: int) -> str:
    """A wire code as words, for an Abort that came without a message."""
    try:
        return ErrorCode(code).name.lower().replace("_", " ")
    except ValueError:
        return f"error code {code}"


class ClientProtocol(FramedProtocol):
    """asyncio glue for one client connection: it moves each call's record."""

    def __init__(self, conn: ClientConnection) -> None:
        super().__init__(conn)
        self.client_conn = conn
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.ready: asyncio.Future[HandshakeComplete] = loop.create_future()
        #: The calls in flight here by call id, each with its record.
        self.pending: dict[int, PendingCall] = {}
        self.subscriptions: dict[int, asyncio.Queue[Event | None]] = {}
        # Events may arrive before the reply that names their topic; keep a few.
        self.early_events: collections.OrderedDict[int, list[Event]] = collections.OrderedDict()
        self.early_count = 0
        self.lost: Exception | None = None
        #: Takes the tracked calls in flight when the connection is lost (maybe none), then
        #: waiting for another connection; None: calls in flight fail with the connection.
        self.on_orphans: Callable[[list[PendingCall]], None] | None = None
        #: Closed on purpose (``Client.close``): nothing is orphaned.
        self.deliberate = False
        #: ``seq`` of the latest Ping sent.
        self.pings = 0
        #: The client over this connection (set by :class:`Client`).
        self.owner: Client | None = None

    def start_call(
        self, method: str, params: msgspec.Raw, rid: bytes | None, tracked: Tracked | None
    ) -> PendingCall:
        """Send a Call; return its record (its id is chosen by the state machine).

        ``rid``: the request id on the wire; ``tracked``: the call is tracked
        for reattaching under that record. Raises :meth:`closed_error` when
        the connection is closed: the call was not sent.
        """
        call_id = self.client_conn.next_call_id()
        self.send(Call(id=call_id, method=method, params=params, rid=rid))
        record = PendingCall(self.loop.create_future(), tracked, self, call_id)
        self.pending[call_id] = record
        return record

    def ping(self) -> int:
        """Send a Ping; its ``seq``. Raises :meth:`closed_error` when closed."""
        self.pings += 1
        self.send(Ping(seq=self.pings))
        return self.pings

    def carry(self, call: PendingCall) -> None:
        """Carry ``call``, waiting since its connection was lost, on over this connection.

        A call that was sent is attached to by its request id, from the bytes
        of each stream it holds; one made while its connection was down is
        sent now. Raises :meth:`closed_error` when this connection is closed
        (the call still waits).
        """
        tracked = call.tracked
        assert tracked is not None, "only tracked calls wait for another connection"
        if call.sent:
            params = requests_rpc.AttachParams(
                rid=tracked.rid, offsets=dict(call.offsets or {}), sent_on=tracked.sent_on or None
            )
            self._move(call, requests_rpc.ATTACH.name, to_raw(params), None, attaching=True)
        else:
            self._send_again(call, tracked)
        call.land()

    def _send_again(self, call: PendingCall, tracked: Tracked) -> None:
        """Send ``call`` itself under its request id (it never reached execd)."""
        sent_on = tracked.sent_on
        tracked.sent_on = self.conn.server_nonce
        try:
            attach = tracked.method == requests_rpc.ATTACH.name  # a Client.reattach made while down
            self._move(call, tracked.method, tracked.params, tracked.rid, attaching=attach)
        except BaseException:
            tracked.sent_on = sent_on
            raise

    def _move(
        self,
        call: PendingCall,
        method: str,
        params: msgspec.Raw,
        rid: bytes | None,
        *,
        attaching: bool,
    ) -> None:
        """Send a Call that carries ``call`` on, and move its record and streams to it."""
        call_id = self.client_conn.next_call_id()
        self.send(Call(id=call_id, method=method, params=params, rid=rid))
        source, source_id = call.proto, call.call_id
        call.proto, call.call_id = self, call_id
        call.sent, call.attaching = True, attaching
        self.pending[call_id] = call
        streams = call.streams
        if streams is not None:
            if isinstance(source, ClientProtocol) and source._streams.get(source_id) is streams:
                del source._streams[source_id]
            self.carry_streams(call_id, streams)
        if call.cancelled:
            # Asked meanwhile: it goes right behind the call. execd binds an attach to the
            # call on receipt, so a cancel of the attach cancels the call (PROTOCOL.md 8.1).
            self.send_cancel(call_id)

    def send_cancel(self, call_id: int) -> None:
        """Ask execd to cancel a call in flight (nothing happens if it cannot be sent)."""
        with contextlib.suppress(Exception):
            self.send(Cancel(id=call_id))

    def call_stream(self, call: PendingCall, name: str) -> Stream:
        """Stream ``name`` of ``call`` (on this connection now), kept in its record.

        A call answered before this stream had a byte or a reader gets an
        ended stream: nothing came on it.
        """
        streams = call.streams
        if streams is None:
            if call.settled:
                return self.stream(call.call_id, name)
            # A call not sent yet has no entry here: its streams go where it is sent.
            streams = self._streams.setdefault(call.call_id, {}) if call.sent else {}
            call.streams = streams
        entry = streams.get(name)
        if entry is None:
            if call.settled:
                return self.stream(call.call_id, name)
            entry = streams[name] = Stream(self, call.call_id, name)
        return entry

    def subscribe(self, topic: int) -> asyncio.Queue[Event | None]:
        """The queue of server-pushed events for ``topic`` (None marks the end)."""
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        for event in self._take_early(topic):
            queue.put_nowait(event)
        self.subscriptions[topic] = queue
        if self.closed:
            queue.put_nowait(None)
        return queue

    def unsubscribe(self, topic: int) -> None:
        self.subscriptions.pop(topic, None)

    def closed_error(self) -> Exception:
        return self.lost or ConnectionLost("connection to execd closed")

    def handle_event(self, event: ConnectionEvent) -> None:
        if type(event) is Reply or type(event) is Error:
            record = self.pending.pop(event.id, None)
            if record is None:
                return
            if record.attaching:
                self._attached(record, event)
            else:
                record.settled = True
                if not record.future.done():
                    record.future.set_result(event)
        elif isinstance(event, Event):
            queue = self.subscriptions.get(event.topic)
            if queue is not None:
                queue.put_nowait(event)
            else:
                self._keep_early(event)
        elif isinstance(event, HandshakeComplete):
            if not self.ready.done():
                self.ready.set_result(event)
        elif isinstance(event, Abort):
            if event.code == ErrorCode.AUTH_FAILED:
                reason: BaseException = AuthenticationFailed(
                    "execd rejected the token (authentication failed)", event.code
                )
            elif event.code == ErrorCode.GOING_AWAY and self.ready.done():
                reason = ConnectionLost(
                    f"execd closed the connection: {event.message or 'going away'}"
                )
            elif not self.ready.done():
                why = event.message or _code_name(event.code)
                reason = HandshakeFailed(f"execd refused the handshake: {why}", event.code)
            else:
                why = event.message or _code_name(event.code)
                reason = ProtocolViolation(f"execd closed the connection: {why}", event.code)
            self.abort(reason)

    def _attached(self, call: PendingCall, answer: Reply | Error) -> None:
        """The answer to an attach that carries ``call``: its outcome, or "never arrived".

        A call that never reached execd, streamed no upload and was not
        cancelled is sent again under its id; its streams go with it.
        """
        call.attaching = False
        tracked = call.tracked
        if (
            tracked is not None
            and not tracked.uploads
            and not call.cancelled
            and never_arrived(answer)
        ):
            try:
                self._send_again(call, tracked)
            except SplitexecError as exc:
                super().drop_streams(answer.id)
                call.fail(NotSent(f"the call never reached execd and cannot be sent again: {exc}"))
            return
        super().drop_streams(answer.id)
        call.settled = True
        if not call.future.done():
            call.future.set_result(answer)

    def drop_streams(self, call_id: int) -> None:
        # An attach's streams stay open through its answer: _attached decides whether the
        # call ends there or goes on as a call sent again.
        record = self.pending.get(call_id)
        if record is None or not record.attaching:
            super().drop_streams(call_id)

    def _on_chunk(self, chunk: Chunk) -> None:
        record = self.pending.get(chunk.id)
        if record is None:
            super()._on_chunk(chunk)
            return
        if record.tracked is not None:
            counts = record.offsets
            if counts is None:
                counts = record.offsets = {}
            counts[chunk.stream] = counts.get(chunk.stream, 0) + len(chunk.data)
        super()._on_chunk(chunk)
        if record.streams is None:
            record.streams = self._streams.get(chunk.id)

    def _keep_early(self, event: Event) -> None:
        self.early_events.setdefault(event.topic, []).append(event)
        self.early_count += 1
        while self.early_count > MAX_EARLY_EVENTS:
            _, dropped = self.early_events.popitem(last=False)
            self.early_count -= len(dropped)

    def _take_early(self, topic: int) -> list[Event]:
        """Events for ``topic`` that arrived before anyone subscribed to it."""
        events = self.early_events.pop(topic, [])
        self.early_count -= len(events)
        return events

    def handle_closed(self, reason: BaseException | None) -> None:
        failure = self._failure(reason)
        self.lost = failure
        if not self.ready.done():
            self.ready.set_exception(failure)
            self.ready.exception()  # mark retrieved; connect() re-raises it
        orphaning = self.on_orphans is not None and not self.deliberate
        orphans: list[PendingCall] = []
        for record in self.pending.values():
            if orphaning and record.tracked is not None:
                record.moved = self.loop.create_future()
                orphans.append(record)
            elif not record.future.done():
                record.future.set_exception(failure)
                record.future.exception()
        self.pending.clear()
        for queue in self.subscriptions.values():
            queue.put_nowait(None)
        if orphaning and self.on_orphans is not None:
            self.on_orphans(orphans)

    def _failure(self, reason: BaseException | None) -> Exception:
        """What calls on this connection fail with, for the reason it closed."""
        if not self.ready.done() and (
            (isinstance(reason, RemoteProtocolError) and reason.code in _FOREIGN_PEER)
            or not isinstance(reason, ProtocolError | HandshakeFailed | ProtocolViolation)
        ):
            return NotAnExecd(
                "it answered with bytes that are not the execd protocol"
                if isinstance(reason, RemoteProtocolError)
                else "it closed the connection without answering the handshake"
            )
        if isinstance(reason, RemoteProtocolError):
            if reason.code == ErrorCode.AUTH_FAILED:
                return AuthenticationFailed(
                    "execd did not prove knowledge of the token", int(reason.code)
                )
            return ProtocolViolation(f"protocol error: {reason}", int(reason.code))
        if isinstance(reason, ConnectionLost | HandshakeFailed | ProtocolViolation):
            return reason
        if reason is not None:
            return ConnectionLost(f"connection to execd lost: {reason}")
        return ConnectionLost("connection to execd closed")


async def _blocks(cursor: StreamCursor) -> AsyncIterator[bytes]:
    while (data := await cursor.next()) is not None:
        yield data


class CallHandle(Generic[R]):
    """One call in flight: its streams, its result, and cancellation."""

    def __init__(self, client: Client, call: PendingCall, result_type: type[R] | Any = Any) -> None:
        self._client = client
        self.call = call
        #: The id the call was first sent with on its client's connection.
        self.id = call.call_id
        self._result_type = result_type

    def stream(self, name: str) -> AsyncIterator[bytes]:
        """Iterate the bytes execd sends on stream ``name`` until it ends.

        Every byte of the stream is delivered whenever iteration starts, even
        after the call was answered, and across a reattach; or the iteration
        raises (ConnectionLost when the call is lost with its connection).
        """
        return _blocks(self.cursor(name))

    def cursor(self, name: str) -> StreamCursor:
        """Stream ``name``'s blocks one ``await`` at a time (what :meth:`stream` iterates)."""
        return StreamCursor(self.call, name)

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        """Send bytes on ``stream`` to execd (flow-controlled).

        Raises ConnectionLost when the call's connection is lost.
        """
        await self._client.send_stream(self.call, stream, data, end=end)

    @overload
    async def result(self) -> R: ...

    @overload
    async def result(self, type: type[T]) -> T: ...

    async def result(self, type: Any = None) -> Any:
        """Wait for the final answer; raise the typed RemoteError on failure.

        The result is decoded as the RPC's declared result type (``type``
        only for a call started by method name).
        """
        future = self.call.future
        if future.done():
            answer = future.result()  # answered already (a read's reply ends its stream)
        else:
            try:
                answer = await asyncio.shield(future)
            except asyncio.CancelledError:
                self.cancel()
                raise
        return self._client._unpack(answer, self._result_type if type is None else type)

    def cancel(self) -> None:
        """Ask execd to cancel the call; its answer will be a Cancelled error.

        The cancel goes to the connection the call is on now; while it waits
        to be reattached, to the connection that takes it on.
        """
        self.call.cancel()

    async def carrier(self) -> Client:
        """The client whose connection carries the call now: another one once it adopted it.

        Waits while the call waits between connections (raising its failure
        when no connection takes it on). For calls that name this one (a
        signal by its request id), which must follow it.
        """
        call = self.call
        if call.waiting:
            assert call.moved is not None
            await asyncio.shield(call.moved)
        proto = call.proto
        owner = proto.owner if isinstance(proto, ClientProtocol) else None
        return owner if owner is not None else self._client

    @property
    def done(self) -> bool:
        return self.call.future.done()

    @property
    def request_id(self) -> bytes | None:
        """The call's request id (None without one), for :meth:`Client.reattach`."""
        return self.call.rid


class Client:
    """An authenticated connection to one execd."""

    def __init__(
        self,
        proto: ClientProtocol,
        info: HandshakeComplete,
        keepalive: float | None,
        *,
        reattach_within: float = 0.0,
    ):
        self._proto = proto
        proto.owner = self
        self.info = info
        #: Give every call a request id (PROTOCOL.md 8.1); False sends none.
        self.request_ids = True
        #: Seconds a call in flight on a lost connection waits to be carried on by another
        #: client (:meth:`adopt`); 0: it fails with the connection.
        self.reattach_within = reattach_within
        #: Runs when the connection is lost (with or without calls in flight) and again
        #: when a call is made on it while it is down: whoever reconnects listens here.
        self.on_lost: Callable[[], None] | None = None
        self._orphans: list[PendingCall] = []
        #: Replaced by a new connection (:meth:`release`): calls made here now fail at once.
        self._released = False
        self._server_nonce = proto.conn.server_nonce
        if reattach_within > 0:
            proto.on_orphans = self._orphaned
        self._keepalive_interval = keepalive or 0.0
        self._unanswered = 0
        self._heard_at = proto.last_received
        self._keepalive: keepalive_group.Membership | None = None
        if keepalive:
            self._keepalive = keepalive_group.join(keepalive, self._keepalive_tick)

    # -- core ------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once the connection is closed or lost."""
        return self._proto.closed

    @property
    def cipher(self) -> str:
        """The cipher sealing every frame (``"none"`` for plaintext), as the handshake agreed."""
        return self.info.cipher

    @overload
    def start(self, method: Rpc[P, R], params: P) -> CallHandle[R]: ...

    @overload
    def start(self, method: str, params: Any = None) -> CallHandle[Any]: ...

    def start(self, method: Rpc[Any, Any] | str, params: Any = None) -> CallHandle[Any]:
        """Send a call and return its handle without waiting.

        Raises NotSent at once when the connection is down and the call
        cannot wait for a new one (see :meth:`call`).
        """
        if isinstance(method, Rpc):
            return CallHandle(self, self._send_call(method.name, params), method.result)
        return CallHandle(self, self._send_call(method, params))

    @overload
    async def call(self, method: Rpc[P, R], params: P) -> R: ...

    @overload
    async def call(self, method: str, params: Any = None) -> Any: ...

    @overload
    async def call(self, method: str, params: Any, type: type[T]) -> T: ...

    async def call(self, method: Rpc[Any, Any] | str, params: Any = None, type: Any = Any) -> Any:
        """Call ``method`` and return its result.

        ``method`` is an RPC declared in :mod:`protocol.rpc` (its params and
        result types come with it), or a bare method name, whose result is
        decoded as ``type`` (for methods this client does not declare).
        The same as ``await self.start(method, params).result()`` without the
        handle: nothing else can wait on this call's future, so it is awaited
        directly (no shield, no extra trip through the event loop).

        A call made while the connection is down was not sent: it fails with
        :class:`~harnessd.errors.NotSent`, or, when someone reconnects this
        client (``on_lost``) and ``reattach_within`` allows, waits that long
        for the new connection and is sent there.
        """
        if isinstance(method, Rpc):
            name, type = method.name, method.result
        else:
            name = method
        record = self._send_call(name, params)
        try:
            answer = await record.future
        except asyncio.CancelledError:
            record.cancel()  # unless answered already: execd cancels it too
            raise
        if isinstance(answer, Reply):
            try:
                return from_raw(answer.result, type)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise ProtocolViolation(f"execd sent a result of the wrong shape: {exc}") from None
        return self._unpack(answer, type)

    async def call_here(self, method: Rpc[P, R], params: P) -> R:
        """Call ``method`` as a call that belongs to this connection.

        For params that name something of this connection (a call id): the
        call is never carried over to another connection; on a lost
        connection it fails (NotSent when it was not sent).
        """
        record = self._send_call(method.name, params, here=True)
        return await CallHandle(self, record, method.result).result()

    def subscribe(self, topic: int) -> asyncio.Queue[Event | None]:
        """The queue of server-pushed events for ``topic`` (None marks the end)."""
        return self._proto.subscribe(topic)

    def unsubscribe(self, topic: int) -> None:
        """Stop queueing events for ``topic``."""
        self._proto.unsubscribe(topic)

    def reattach(self, rid: bytes, offsets: dict[str, int] | None = None) -> CallHandle[Any]:
        """Attach to the call with request id ``rid`` (PROTOCOL.md 8.1).

        The handle's streams carry the call's output from ``offsets`` (bytes
        already held, per stream) on, and its result is the call's. Raises (on
        ``result()``) RequestNotKnown when execd does not know the id.
        """
        held = dict(offsets or {})
        params = requests_rpc.AttachParams(rid=rid, offsets=held)
        tracked = Tracked(rid, requests_rpc.ATTACH.name, to_raw(params), b"", uploads=True)
        record = self._send_call(requests_rpc.ATTACH.name, params, tracked=tracked)
        record.offsets = dict(held)
        record.attaching = record.sent  # one made while down is marked when it is sent
        return CallHandle(self, record)

    # -- calls that outlive the connection --------------------------------------

    def take_orphans(self) -> list[PendingCall]:
        """The calls of this lost connection still waiting for another one (handed over once)."""
        orphans = [call for call in self._orphans if call.waiting]
        self._orphans.clear()
        return orphans

    def adopt(self, orphans: list[PendingCall]) -> None:
        """Carry on here the calls another client lost (its :meth:`take_orphans`).

        Each is attached to by its request id (or sent, if it never was), and
        its caller and readers go on as if nothing had happened.
        """
        proto = self._proto
        for call in orphans:
            if not call.waiting:
                continue
            if call.cancelled and not call.sent:
                call.fail(NotSent("cancelled before it was sent"))
                continue
            try:
                proto.carry(call)
            except SplitexecError as exc:
                call.fail(exc if call.sent else NotSent(f"not sent: {exc}"))

    async def release(self) -> list[PendingCall]:
        """Close this connection for a new one: its calls in flight become orphans to adopt.

        Calls made on this client afterwards fail at once with NotSent.
        """
        self._released = True
        self.on_lost = None
        if not self._proto.closed:
            self._proto.abort(ConnectionLost("replaced by a new connection"))
        orphans = self.take_orphans()
        await self.close()
        return orphans

    def _orphaned(self, orphans: list[PendingCall]) -> None:
        """The connection was lost: its tracked calls in flight wait for another."""
        if orphans:
            self._wait(orphans, self._proto.closed_error())
        if self.on_lost is not None:
            self.on_lost()

    def _wait(self, calls: list[PendingCall], failure: Exception) -> None:
        """Keep ``calls`` to be adopted; those still waiting in ``reattach_within`` s fail."""
        self._orphans = [call for call in self._orphans if call.waiting]
        self._orphans.extend(calls)
        waits = [(call, call.moved) for call in calls]
        self._proto.loop.call_later(self.reattach_within, _expire, waits, failure)

    async def close(self) -> None:
        """Close the connection (calls in flight fail with ConnectionLost)."""
        if self._keepalive is not None:
            self._keepalive.leave()
        self._proto.deliberate = True
        closing = ConnectionLost("client closed the connection")
        for call in self.take_orphans():
            call.fail(closing if call.sent else NotSent("not sent: client closed the connection"))
        if not self._proto.closed:
            self._proto.abort(closing, code=ErrorCode.GOING_AWAY)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send_stream(self, call: PendingCall, stream: str, data: bytes, *, end: bool) -> None:
        """Send ``data`` on ``stream`` of ``call``, on the connection it is on (flow-controlled).

        A call made while the connection was down is sent first.
        """
        if not call.sent and call.waiting:
            assert call.moved is not None
            await asyncio.shield(call.moved)
        tracked = call.tracked
        if tracked is not None:
            tracked.uploads = True  # what was streamed cannot be sent again
        await call.proto.send_stream(call.call_id, stream, data, end=end)

    # -- internals -------------------------------------------------------------

    def _send_call(
        self, method: str, params: Any, tracked: Tracked | None = None, *, here: bool = False
    ) -> PendingCall:
        """Frame and send a Call; return its record.

        Every call gets a fresh request id (none for methods that belong to
        their connection, nor with ``request_ids`` off); ``tracked``: track
        it as this call instead (a reattach). The id goes on the wire unless
        the method is connection-scoped (an attach names its id in its
        params). A call that belongs ``here`` has its id on the wire like any
        other (execd books it alike) but is never carried to another
        connection.
        """
        # NoParams is the empty map: spare the no-op round trip its encoding.
        if params is None or type(params) is NoParams:
            raw = _EMPTY_PARAMS
        else:
            raw = params if isinstance(params, msgspec.Raw) else to_raw(params)
        scoped = method in requests_rpc.CONNECTION_SCOPED
        if tracked is None and self.request_ids and not scoped:
            tracked = Tracked(new_request_id(), method, raw, self._server_nonce)
        wire_rid = None if scoped or tracked is None else tracked.rid
        if here:
            tracked = None
        proto = self._proto
        if not proto.closed:
            try:
                return proto.start_call(method, raw, wire_rid, tracked)
            except Exception:
                if not proto.closed:
                    raise
        return self._unsent(tracked)

    def _unsent(self, tracked: Tracked | None) -> PendingCall:
        """A call made while the connection is down: it waits for a new one, or is NotSent."""
        proto = self._proto
        why = proto.closed_error()
        on_lost = self.on_lost
        if (
            tracked is None
            or on_lost is None
            or self._released
            or proto.deliberate
            or self.reattach_within <= 0
        ):
            raise NotSent(f"not sent: {why}")
        loop = proto.loop
        record = PendingCall(loop.create_future(), tracked, proto, 0, sent=False)
        record.moved = loop.create_future()
        self._wait(
            [record],
            NotSent(f"not sent: {why}; no new connection within {self.reattach_within:g} s"),
        )
        on_lost()  # a reconnection that gave up starts again
        return record

    def _unpack(self, answer: Reply | Error, type: Any) -> Any:
        if isinstance(answer, Error):
            data: Any = None
            with contextlib.suppress(msgspec.DecodeError):
                data = from_raw(answer.data, Any)
            raise remote_error(answer.code, answer.message, data)
        try:
            return from_raw(answer.result, type)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ProtocolViolation(f"execd sent a result of the wrong shape: {exc}") from None

    def _keepalive_tick(self) -> bool:
        """Ping execd, or give the connection up; False when done with pings.

        The connection is given up once three pings in a row went unanswered
        and nothing came from execd for three intervals. Counting pings, not
        only time, keeps a harness whose event loop was held up for a while
        (a long synchronous step, a slow machine) from giving up on every
        connection at once: nothing was asked of execd while it stalled.
        """
        proto = self._proto
        if proto.closed:
            return False
        if proto.last_received != self._heard_at:
            self._heard_at = proto.last_received
            self._unanswered = 0
        silent = time.monotonic() - proto.last_received
        if self._unanswered >= 3 and silent > 3 * self._keepalive_interval:
            proto.abort(
                ConnectionLost(f"execd did not answer keepalives for {silent:.1f} s"),
                code=ErrorCode.GOING_AWAY,
            )
            return False
        self._unanswered += 1
        try:
            proto.ping()
        except Exception:  # a transport closing under the write: the next tick sees it
            return not proto.closed
        return True


def _expire(
    waits: list[tuple[PendingCall, asyncio.Future[None] | None]], failure: Exception
) -> None:
    """Fail the calls of ``waits`` that still wait where they waited when the timer was set."""
    for call, moved in waits:
        if moved is not None and call.moved is moved and not moved.done():
            call.fail(failure)


async def open_connection(
    host: str,
    port: int,
    token: bytes | str,
    *,
    encrypt: bool | str = False,
    timeout: float = 10.0,
    max_frame: int = limits.DEFAULT_MAX_FRAME,
    window: int = limits.DEFAULT_STREAM_WINDOW,
) -> tuple[ClientProtocol, HandshakeComplete]:
    """Connect to execd and complete the handshake; the low layer under ``connect``.

    ``encrypt``: False for plaintext frames (loopback), True to require
    authenticated encryption (AES-256-GCM, else ChaCha20-Poly1305), or a
    cipher name. Raises ConnectFailed, AuthenticationFailed or HandshakeFailed.
    """
    secret = token_bytes(token)
    if encrypt is True:
        ciphers: tuple[str, ...] = (limits.CIPHER_AESGCM, limits.CIPHER_CHACHA20)
    elif encrypt is False:
        ciphers = (limits.CIPHER_NONE,)
    else:
        ciphers = (encrypt,)
    conn = ClientConnection(secret, max_frame=max_frame, window=window, ciphers=ciphers)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            _, proto = await loop.create_connection(lambda: ClientProtocol(conn), host, port)
    except (OSError, TimeoutError) as exc:
        raise ConnectFailed(f"cannot connect to execd at {host}:{port}: {exc}") from None
    try:
        async with asyncio.timeout(timeout):
            info = await proto.ready
    except TimeoutError:
        proto.abort(HandshakeFailed("handshake timed out"), code=ErrorCode.HANDSHAKE_TIMEOUT)
        raise HandshakeFailed(
            f"not an execd at {host}:{port}? no answer to the handshake within {timeout:g} s"
        ) from None
    except NotAnExecd as exc:
        raise NotAnExecd(f"not an execd at {host}:{port}: {exc}") from None
    except BaseException:
        if not proto.closed:
            proto.abort(None)
        raise
    return proto, info
