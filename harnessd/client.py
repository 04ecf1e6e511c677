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
message); execd's final answer to it is then discarded.
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
from harnessd import reattach as reattaching
from harnessd.errors import (
    AuthenticationFailed,
    ConnectFailed,
    ConnectionLost,
    HandshakeFailed,
    NotAnExecd,
    ProtocolViolation,
    remote_error,
)
from protocol import limits
from protocol.bridge import FramedProtocol, Stream
from protocol.codec import from_raw, to_raw
from protocol.connection import ClientConnection, ConnectionEvent, HandshakeComplete
from protocol.errors import ErrorCode, ProtocolError, RemoteProtocolError
from protocol.handshake import token_bytes
from protocol.messages import Abort, Call, Cancel, Chunk, Error, Event, Ping, Pong, Reply
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


class PendingCall(msgspec.Struct, eq=False):
    """One call in flight: the one record the client keeps of it until its answer comes.

    A Struct (never encoded): one is built per call, in C.
    """

    future: asyncio.Future[Reply | Error]
    #: Its request id and what it takes to send it again (None: not tracked).
    tracked: reattaching.Tracked | None
    #: Bytes received per stream, kept for a tracked call (:mod:`harnessd.reattach`).
    received: dict[str, int] | None = None
    #: Where an attach call's streams start, per stream.
    base: dict[str, int] | None = None


class ClientProtocol(FramedProtocol):
    """asyncio glue for one client connection."""

    def __init__(self, conn: ClientConnection) -> None:
        super().__init__(conn)
        self.client_conn = conn
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.ready: asyncio.Future[HandshakeComplete] = loop.create_future()
        #: The calls in flight, each with its record.
        self.pending: dict[int, PendingCall] = {}
        self.subscriptions: dict[int, asyncio.Queue[Event | None]] = {}
        # Events may arrive before the reply that names their topic; keep a few.
        self.early_events: collections.OrderedDict[int, list[Event]] = collections.OrderedDict()
        self.early_count = 0
        self.lost: Exception | None = None
        # The orphans made of the tracked calls in flight when the connection was lost.
        self.orphans: dict[int, reattaching.Orphan] = {}
        #: Takes the orphans of a lost connection; None: calls in flight fail with it.
        self.on_orphans: Callable[[list[reattaching.Orphan]], None] | None = None
        #: Closed on purpose (``Client.close``): nothing is orphaned.
        self.deliberate = False

    def start_call(
        self,
        method: str,
        params: msgspec.Raw,
        rid: bytes | None = None,
        tracked: reattaching.Tracked | None = None,
    ) -> tuple[int, asyncio.Future[Reply | Error]]:
        """Send a Call; return its id (chosen by the state machine) and its answer's future.

        ``rid``: the request id on the wire; ``tracked``: the call is tracked
        for reattaching under that record (:mod:`harnessd.reattach`).
        """
        call_id = self.client_conn.next_call_id()
        self.send(Call(id=call_id, method=method, params=params, rid=rid))
        future: asyncio.Future[Reply | Error] = self.loop.create_future()
        self.pending[call_id] = PendingCall(future, tracked)
        return call_id, future

    def is_pending(self, call_id: int, future: asyncio.Future[Reply | Error]) -> bool:
        """Whether ``future`` still waits for the answer to ``call_id``."""
        record = self.pending.get(call_id)
        return record is not None and record.future is future

    def tracked(self, call_id: int) -> reattaching.Tracked | None:
        """What call ``call_id`` is tracked as, while it is in flight (None: not tracked)."""
        record = self.pending.get(call_id)
        return record.tracked if record is not None else None

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
            if record is not None and not record.future.done():
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
        elif isinstance(event, Pong):
            pass

    def _on_chunk(self, chunk: Chunk) -> None:
        record = self.pending.get(chunk.id)
        if record is not None and record.tracked is not None:
            counts = record.received
            if counts is None:
                counts = record.received = {}
            counts[chunk.stream] = counts.get(chunk.stream, 0) + len(chunk.data)
        super()._on_chunk(chunk)

    def stream_names(self, call_id: int) -> list[str]:
        """Names of the inbound streams of a call that have a buffer here."""
        return list(self._streams.get(call_id, ()))

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
        if not self.ready.done() and (
            (isinstance(reason, RemoteProtocolError) and reason.code in _FOREIGN_PEER)
            or not isinstance(reason, ProtocolError | HandshakeFailed | ProtocolViolation)
        ):
            failure: Exception = NotAnExecd(
                "it answered with bytes that are not the execd protocol"
                if isinstance(reason, RemoteProtocolError)
                else "it closed the connection without answering the handshake"
            )
        elif isinstance(reason, RemoteProtocolError):
            if reason.code == ErrorCode.AUTH_FAILED:
                failure = AuthenticationFailed(
                    "execd did not prove knowledge of the token", int(reason.code)
                )
            else:
                failure = ProtocolViolation(f"protocol error: {reason}", int(reason.code))
        elif isinstance(reason, ConnectionLost | HandshakeFailed | ProtocolViolation):
            failure = reason
        elif reason is not None:
            failure = ConnectionLost(f"connection to execd lost: {reason}")
        else:
            failure = ConnectionLost("connection to execd closed")
        self.lost = failure
        if not self.ready.done():
            self.ready.set_exception(failure)
            self.ready.exception()  # mark retrieved; connect() re-raises it
        orphans: list[reattaching.Orphan] = []
        if self.on_orphans is not None and not self.deliberate:
            orphans = reattaching.orphan_calls(self)
        for record in self.pending.values():
            future = record.future
            if not future.done():
                future.set_exception(failure)
                future.exception()
        self.pending.clear()
        for queue in self.subscriptions.values():
            queue.put_nowait(None)
        if orphans and self.on_orphans is not None:
            self.on_orphans(orphans)


class StreamCursor:
    """The blocks of one inbound stream of a call, one :meth:`next` at a time.

    The stream's buffer is bound when the cursor is made. When the
    connection is lost and another client adopts the call
    (:mod:`harnessd.reattach`), the cursor goes on where the bytes received
    so far end.
    """

    __slots__ = ("_call_id", "_name", "_proto", "_source")

    def __init__(self, proto: ClientProtocol, call_id: int, name: str) -> None:
        self._proto = proto
        self._call_id = call_id
        self._name = name
        self._source: Stream = proto.stream(call_id, name)

    async def next(self) -> bytes | None:
        """The next block; None once the stream has ended."""
        while True:
            try:
                return await self._source.read()
            except Exception:
                proto = self._proto
                if not proto.closed:
                    raise
                moved = await reattaching.follow(proto, self._call_id, self._name)
                if moved is None:
                    if proto.lost is not None:
                        raise proto.lost from None
                    return None
                self._proto, self._call_id, self._source = moved


async def _blocks(cursor: StreamCursor) -> AsyncIterator[bytes]:
    while (data := await cursor.next()) is not None:
        yield data


class CallHandle(Generic[R]):
    """One call in flight: its streams, its result, and cancellation."""

    def __init__(
        self,
        client: Client,
        call_id: int,
        future: asyncio.Future[Reply | Error],
        result_type: type[R] | Any = Any,
    ) -> None:
        self._client = client
        self.id = call_id
        self._future = future
        self._result_type = result_type

    def stream(self, name: str) -> AsyncIterator[bytes]:
        """Iterate the bytes execd sends on stream ``name`` until it ends.

        The stream's buffer is bound now rather than at the first iteration:
        a reply that ends the call before iteration starts must not drop it.
        """
        return _blocks(self.cursor(name))

    def cursor(self, name: str) -> StreamCursor:
        """Stream ``name``'s blocks one ``await`` at a time (what :meth:`stream` iterates)."""
        return StreamCursor(self._client._proto, self.id, name)

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        """Send bytes on ``stream`` to execd (flow-controlled)."""
        await self._client._send_stream(self.id, stream, data, end=end)

    @overload
    async def result(self) -> R: ...

    @overload
    async def result(self, type: type[T]) -> T: ...

    async def result(self, type: Any = None) -> Any:
        """Wait for the final answer; raise the typed RemoteError on failure.

        The result is decoded as the RPC's declared result type (``type``
        only for a call started by method name).
        """
        future = self._future
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
        """Ask execd to cancel the call; its answer will be a Cancelled error."""
        if self._future.done():
            return
        self._client._send_cancel(self.id)

    @property
    def done(self) -> bool:
        return self._future.done()

    @property
    def request_id(self) -> bytes | None:
        """The call's request id (None without one), for :meth:`Client.reattach`."""
        tracked = self._client._proto.tracked(self.id)
        return tracked.rid if tracked is not None else None


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
        self.info = info
        #: Give every call a request id (harnessd.reattach); False sends none.
        self.request_ids = True
        #: Seconds a call in flight on a lost connection waits to be reattached (0: it fails).
        self.reattach_within = reattach_within
        #: Runs when the connection is lost with calls waiting to be reattached.
        self.on_lost: Callable[[], None] | None = None
        self._orphans: list[reattaching.Orphan] = []
        self._server_nonce = proto.conn.server_nonce
        if reattach_within > 0:
            proto.on_orphans = self._orphaned
        self._keepalive_interval = keepalive or 0.0
        self._pings = 0
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
        """Send a call and return its handle without waiting."""
        if isinstance(method, Rpc):
            call_id, future = self._send_call(method.name, params)
            return CallHandle(self, call_id, future, method.result)
        call_id, future = self._send_call(method, params)
        return CallHandle(self, call_id, future)

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
        """
        if isinstance(method, Rpc):
            name, type = method.name, method.result
        else:
            name = method
        call_id, future = self._send_call(name, params)
        try:
            answer = await future
        except asyncio.CancelledError:
            # Still pending means no answer came: cancel the call in execd too.
            if self._proto.is_pending(call_id, future):
                self._send_cancel(call_id)
            raise
        if isinstance(answer, Reply):
            try:
                return from_raw(answer.result, type)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise ProtocolViolation(f"execd sent a result of the wrong shape: {exc}") from None
        return self._unpack(answer, type)

    def subscribe(self, topic: int) -> asyncio.Queue[Event | None]:
        """The queue of server-pushed events for ``topic`` (None marks the end)."""
        return self._proto.subscribe(topic)

    def unsubscribe(self, topic: int) -> None:
        """Stop queueing events for ``topic``."""
        self._proto.unsubscribe(topic)

    def reattach(self, rid: bytes, offsets: dict[str, int] | None = None) -> CallHandle[Any]:
        """Attach to the call with request id ``rid`` (see :mod:`harnessd.reattach`).

        The handle's streams carry the call's output from ``offsets`` (bytes
        already held, per stream) on, and its result is the call's. Raises (on
        ``result()``) RequestNotKnown when execd does not know the id.
        """
        params = requests_rpc.AttachParams(rid=rid, offsets=dict(offsets or {}))
        tracked = reattaching.Tracked(
            rid, requests_rpc.ATTACH.name, to_raw(params), b"", uploads=True
        )
        call_id, future = self._send_call(requests_rpc.ATTACH.name, params, tracked=tracked)
        self._proto.pending[call_id].base = dict(offsets or {})
        return CallHandle(self, call_id, future)

    def take_orphans(self) -> list[reattaching.Orphan]:
        """The calls of a lost connection still waiting to be reattached (handed over once)."""
        orphans = [o for o in self._orphans if not (o.future.done() or o.moved.done())]
        self._orphans.clear()
        return orphans

    def adopt(self, orphans: list[reattaching.Orphan]) -> None:
        """Reattach calls another client lost on this client's connection."""
        reattaching.adopt(self, orphans)

    async def release(self) -> list[reattaching.Orphan]:
        """Close this connection for a new one: its calls in flight become orphans to adopt."""
        if not self._proto.closed:
            self._proto.abort(ConnectionLost("replaced by a new connection"))
        orphans = self.take_orphans()
        await self.close()
        return orphans

    def _orphaned(self, orphans: list[reattaching.Orphan]) -> None:
        self._orphans.extend(orphans)
        failure = self._proto.lost or ConnectionLost("connection to execd lost")
        self._proto.loop.call_later(self.reattach_within, _expire, orphans, failure)
        if self.on_lost is not None:
            self.on_lost()

    async def close(self) -> None:
        """Close the connection (calls in flight fail with ConnectionLost)."""
        if self._keepalive is not None:
            self._keepalive.leave()
        self._proto.deliberate = True
        for orphan in self.take_orphans():
            orphan.fail(ConnectionLost("client closed the connection"))
        if not self._proto.closed:
            self._proto.abort(
                ConnectionLost("client closed the connection"), code=ErrorCode.GOING_AWAY
            )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals -------------------------------------------------------------

    def _send_call(
        self, method: str, params: Any, tracked: reattaching.Tracked | None = None
    ) -> tuple[int, asyncio.Future[Reply | Error]]:
        """Frame and send a Call; return its id and the future of its answer.

        Every call gets a fresh request id (none for methods that belong to
        their connection, nor with ``request_ids`` off); ``tracked``: track it
        as this call instead (a reattach, or a call sent again). The id goes
        on the wire unless the method is connection-scoped (an attach names
        its id in its params).
        """
        # NoParams is the empty map: spare the no-op round trip its encoding.
        if params is None or type(params) is NoParams:
            raw = _EMPTY_PARAMS
        else:
            raw = params if isinstance(params, msgspec.Raw) else to_raw(params)
        scoped = method in requests_rpc.CONNECTION_SCOPED
        if tracked is None and self.request_ids and not scoped:
            fresh = reattaching.new_request_id()
            tracked = reattaching.Tracked(fresh, method, raw, self._server_nonce)
        wire_rid = None if scoped or tracked is None else tracked.rid
        return self._proto.start_call(method, raw, wire_rid, tracked)

    def _send_cancel(self, call_id: int) -> None:
        """Ask execd to cancel a call in flight (nothing happens if it cannot be sent)."""
        with contextlib.suppress(Exception):
            self._proto.send(Cancel(id=call_id))

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

    async def _send_stream(self, call_id: int, stream: str, data: bytes, *, end: bool) -> None:
        tracked = self._proto.tracked(call_id)
        if tracked is not None:
            tracked.uploads = True  # what was streamed cannot be sent again
        await self._proto.send_stream(call_id, stream, data, end=end)

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
        self._pings += 1
        self._unanswered += 1
        try:
            proto.send(Ping(seq=self._pings))
        except Exception:  # a transport closing under the write: the next tick sees it
            return not proto.closed
        return True


def _expire(orphans: list[reattaching.Orphan], failure: BaseException) -> None:
    for orphan in orphans:
        if not orphan.moved.done():
            orphan.fail(failure)


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
