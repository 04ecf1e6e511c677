"""The one module that glues the sans-I/O state machines to asyncio.

:class:`FramedProtocol` is an ``asyncio.BufferedProtocol`` (so the hot data
path runs on the event loop's transports, uvloop's or plain asyncio's, and
receives in place into the connection's buffer) that drives a
:class:`~protocol.connection.Connection`. It owns what a state machine cannot:
the transport's write backpressure, waiting for stream credit, and the
buffers of inbound streams. Roles subclass it and implement
:meth:`FramedProtocol.handle_event` and :meth:`FramedProtocol.handle_closed`.

Inbound stream data is buffered per ``(call id, stream)`` until the
application reads it; credit is granted back only as it is read, so a stream
never buffers more than the window this side announced, and the total over all
streams of one connection is capped by ``max_inbound_buffer`` (exceeding it is
a flow-control violation that closes the connection).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from typing import Final, cast

from protocol.connection import Connection, ConnectionEvent, State, StreamKey
from protocol.errors import ErrorCode, FlowControlViolation, RemoteProtocolError
from protocol.messages import Chunk, Credit

log = logging.getLogger(__name__)

DEFAULT_MAX_INBOUND_BUFFER: Final = 64 * 1024 * 1024
#: Largest chunk :meth:`FramedProtocol.send_stream` puts in one frame, and the
#: smallest share of the peer's window it aims for. Several chunks fit in a
#: window, so the peer grants credit for the first while the next are on the
#: way: the two ends work at once instead of taking turns.
STREAM_CHUNK: Final = 1024 * 1024
MIN_STREAM_CHUNK: Final = 64 * 1024


class TransportClosed(Exception):
    """The transport under a FramedProtocol is gone; nothing more can be sent."""


class InboundStream:
    """Buffered chunks of one inbound stream, consumed by one reader."""

    __slots__ = ("_chunks", "_ended", "_error", "_owner", "_waiter", "buffered", "key")

    def __init__(self, owner: FramedProtocol, key: StreamKey) -> None:
        self._owner = owner
        self.key = key
        self._chunks: collections.deque[bytes] = collections.deque()
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.buffered = 0

    def _push(self, data: bytes, end: bool) -> None:
        if data:
            self._chunks.append(data)
            self.buffered += len(data)
        if end:
            self._ended = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read(self) -> bytes | None:
        """The next chunk of data, or None once the stream has ended."""
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self.buffered -= len(data)
                self._owner._consumed(self.key, len(data))
                return data
            if self._ended:
                return None
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            data = await self.read()
            if data is None:
                return
            yield data


class FramedProtocol(asyncio.BufferedProtocol):
    """Base asyncio protocol for both roles.

    A ``BufferedProtocol``: the transport receives straight into the buffer
    the connection offers (:meth:`Connection.get_buffer`), so the body of a
    large frame is copied by the kernel only. :meth:`data_received` takes
    bytes the same way for callers that have them in hand.
    """

    def __init__(
        self, conn: Connection, *, max_inbound_buffer: int = DEFAULT_MAX_INBOUND_BUFFER
    ) -> None:
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        self.max_inbound_buffer = max_inbound_buffer
        self._inbound: dict[StreamKey, InboundStream] = {}
        self._inbound_total = 0
        self._credit_waiters: dict[StreamKey, asyncio.Future[None]] = {}
        self._paused = False
        self._drain_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._seq: dict[StreamKey, int] = {}
        self.closed = False
        self.close_reason: BaseException | None = None
        #: ``time.monotonic()`` of the latest bytes received.
        self.last_received = time.monotonic()

    # -- asyncio.Protocol ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self._flush_outbox()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.last_received = time.monotonic()
        if self.closed:
            return
        try:
            events = self.conn.buffer_updated(nbytes)
        except RemoteProtocolError as exc:
            self._flush_outbox()
            self.abort(exc)
            return
        self._dispatch(events)

    def data_received(self, data: bytes) -> None:
        """Take received bytes that are not in the connection's buffer."""
        self.last_received = time.monotonic()
        if self.closed:
            return
        try:
            events = self.conn.receive_data(data)
        except RemoteProtocolError as exc:
            self._flush_outbox()
            self.abort(exc)
            return
        self._dispatch(events)

    def _dispatch(self, events: list[ConnectionEvent]) -> None:
        conn = self.conn
        out = conn.data_to_send()
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out)
        for event in events:
            kind = type(event)
            if kind is Chunk:
                self._on_chunk(cast(Chunk, event))
            elif kind is Credit:
                self._on_credit(cast(Credit, event))
            else:
                self.handle_event(event)
            if self.closed:
                return
        if conn.state is State.CLOSED and not self.closed:
            self.abort(None)

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc if self.close_reason is None else self.close_reason)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # -- role hooks ----------------------------------------------------------

    def handle_event(self, event: ConnectionEvent) -> None:
        """A non-stream event: handshake completion, Call, Reply, Event, ..."""
        raise NotImplementedError

    def handle_closed(self, reason: BaseException | None) -> None:
        """The connection is gone (once); ``reason`` is the error, if any."""
        raise NotImplementedError

    # -- sending -------------------------------------------------------------

    def write(self, data: bytes | bytearray) -> None:
        """Write bytes to the transport, or raise TransportClosed."""
        if self.closed or self.transport is None:
            raise TransportClosed("the connection is closed")
        if data:
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        if self.closed:
            raise TransportClosed("the connection is closed")
        if not self._paused:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter
        if self.closed:
            raise TransportClosed("the connection is closed")

    async def send_stream(self, call_id: int, stream: str, data: bytes, *, end: bool) -> None:
        """Send ``data`` on a stream in chunks, waiting for credit and drain.

        Chunks are at most :data:`STREAM_CHUNK` bytes and at most a quarter of
        the peer's window (but not under :data:`MIN_STREAM_CHUNK`), and carry
        views of ``data``: the bytes are copied once, into the frame.
        """
        key = (call_id, stream)
        view = memoryview(data)
        offset = 0
        total = len(data)
        conn = self.conn
        step = min(STREAM_CHUNK, max(MIN_STREAM_CHUNK, conn.peer_window // 4), conn.max_chunk)
        while True:
            if self.closed:
                raise TransportClosed("the connection is closed")
            remaining = total - offset
            credit = conn.stream_credit(call_id, stream)
            if remaining and credit <= 0:
                await self._wait_credit(key)
                continue
            size = min(remaining, credit, step)
            last = offset + size >= total
            seq = self._seq.get(key, 0)
            self._seq[key] = seq + 1
            # A view is encoded as msgpack bin exactly as bytes are.
            piece: bytes = data if size == total else cast(bytes, view[offset : offset + size])
            chunk = Chunk(id=call_id, stream=stream, seq=seq, data=piece, end=end and last)
            self.write(self.conn.send(chunk))
            offset += size
            if self._paused:
                await self.drain()
            if last:
                if end:
                    self._seq.pop(key, None)
                return

    async def _wait_credit(self, key: StreamKey) -> None:
        waiter = self._credit_waiters.get(key)
        if waiter is None or waiter.done():
            waiter = asyncio.get_running_loop().create_future()
            self._credit_waiters[key] = waiter
        await waiter
        if self.closed:
            raise TransportClosed("the connection is closed")

    def _on_credit(self, credit: Credit) -> None:
        waiter = self._credit_waiters.pop((credit.id, credit.stream), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- receiving streams ---------------------------------------------------

    def inbound(self, call_id: int, stream: str) -> InboundStream:
        """The buffer of an inbound stream (created on first use by either side)."""
        key = (call_id, stream)
        entry = self._inbound.get(key)
        if entry is None:
            entry = InboundStream(self, key)
            self._inbound[key] = entry
            if self.closed:
                entry._fail(TransportClosed("the connection is closed"))
        return entry

    def _on_chunk(self, chunk: Chunk) -> None:
        stream = self.inbound(chunk.id, chunk.stream)
        self._inbound_total += len(chunk.data)
        if self._inbound_total > self.max_inbound_buffer:
            self.abort(FlowControlViolation("peer's unread stream data exceeds the buffer cap"))
            return
        stream._push(chunk.data, chunk.end)

    def _consumed(self, key: StreamKey, nbytes: int) -> None:
        self._inbound_total -= nbytes
        if self.closed:
            return
        frame = self.conn.grant(key[0], key[1], nbytes)
        if frame:
            self.write(frame)

    def drop_streams(self, call_id: int) -> None:
        """Forget every stream buffer and credit waiter of a finished call."""
        if not (self._inbound or self._credit_waiters or self._seq):
            return
        for key in [k for k in self._inbound if k[0] == call_id]:
            entry = self._inbound.pop(key)
            self._inbound_total -= entry.buffered
            entry._fail(TransportClosed("the call has finished"))
        for key in [k for k in self._credit_waiters if k[0] == call_id]:
            waiter = self._credit_waiters.pop(key)
            if not waiter.done():
                waiter.set_result(None)
        for key in [k for k in self._seq if k[0] == call_id]:
            del self._seq[key]

    # -- closing -------------------------------------------------------------

    def abort(self, reason: BaseException | None, *, code: ErrorCode | None = None) -> None:
        """Close the connection now, sending an Abort first when the state allows."""
        if self.close_reason is None:
            self.close_reason = reason
        if code is not None or isinstance(reason, RemoteProtocolError):
            err_code = (
                code if code is not None else getattr(reason, "code", ErrorCode.PROTOCOL_ERROR)
            )
            frame = self.conn.close(err_code, str(reason) if reason else "")
            if frame and self.transport is not None and not self.transport.is_closing():
                self.transport.write(frame)
        else:
            self.conn.close()
        if self.transport is not None:
            self.transport.close()
        self._finish(reason)

    def _flush_outbox(self) -> None:
        out = self.conn.data_to_send()
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out)

    def _finish(self, reason: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        failure = TransportClosed("the connection is closed")
        for entry in self._inbound.values():
            entry._fail(failure)
        for waiter in self._credit_waiters.values():
            if not waiter.done():
                waiter.set_result(None)
        self._credit_waiters.clear()
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        try:
            self.handle_closed(reason)
        except Exception:
            log.exception("error while closing a connection")
