"""The one module that glues the sans-I/O state machines to asyncio.

:class:`FramedProtocol` is an ``asyncio.BufferedProtocol`` (so the hot data
path runs on the event loop's transports, uvloop's or plain asyncio's, and
receives in place into the connection's buffer) that drives a
:class:`~protocol.connection.Connection`. It owns what a state machine cannot:
the transport's write backpressure, waiting for stream credit, and the
buffers of inbound streams. Roles subclass it and implement
:meth:`FramedProtocol.handle_event` and :meth:`FramedProtocol.handle_closed`.

Sending has one path: :meth:`FramedProtocol.send` asks the state machine for
the frame of a message (which checks and books it) and writes it to the
transport, small frames sent right beside others together, up to
:data:`HOLD_FRAMES` in one write (:meth:`FramedProtocol._put`: the answers to
one read's calls, the calls a batch of woken tasks sends); a large chunk of
immutable data goes out as the parts of its
:class:`~protocol.framing.SplicedFrame`, the data not copied. A
closed transport is mapped to one exception there and only there:
:meth:`FramedProtocol.closed_error`, a :class:`~protocol.errors.ConnectionLost`
unless a role knows better. Reading a stream of a connection that has closed
raises the same.

Inbound stream data is buffered per ``(call id, stream)`` until the
application reads it; credit is granted back only as it is read, so a stream
never buffers more than the window this side announced, and the total over all
streams of one connection is capped by ``max_inbound_buffer`` (exceeding it is
a flow-control violation that closes the connection). Each stream has one
record, :class:`Stream`: its buffered chunks, its reader and the writer
waiting for credit on it. When its call finishes the stream ends: what was
buffered can still be read, then iteration stops. A role may carry a call's
streams over to another call, on this connection or another one
(:meth:`FramedProtocol.carry_streams`): their readers go on reading the same
records, and the bytes they still buffer earn the new call no credit.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from typing import Final, cast

from protocol.connection import Connection, ConnectionEvent, Frame
from protocol.errors import (
    ConnectionLost,
    ErrorCode,
    FlowControlViolation,
    LocalProtocolError,
    RemoteProtocolError,
)
from protocol.framing import SplicedFrame
from protocol.messages import Chunk, Credit, Error, Message, Reply
from protocol.states import CLOSED

log = logging.getLogger(__name__)

DEFAULT_MAX_INBOUND_BUFFER: Final = 64 * 1024 * 1024
#: Largest chunk :meth:`FramedProtocol.send_stream` puts in one frame, and the
#: smallest share of the peer's window it aims for. Several chunks fit in a
#: window, so the peer grants credit for the first while the next are on the
#: way: the two ends work at once instead of taking turns.
STREAM_CHUNK: Final = 1024 * 1024
#: The smallest chunk :meth:`FramedProtocol.send_stream` aims for, however small the window.
MIN_STREAM_CHUNK: Final = 64 * 1024
#: Frames from this size on are written at once, never held to go out with others.
HOLD_MAX: Final = 64 * 1024
#: Held frames are written once this many are held, the rest held after them. A batch
#: written whole makes the two ends take turns: the peer starts on the first of 64
#: pipelined calls only once all 64 are made. Written in parts, it works on one part
#: while this end makes the next (pipelined no-ops with the ends on two cores: 0.42-0.46
#: -> 0.71-0.77 of the floor); parts much smaller cost more system calls and, on one
#: core, more switches between the ends than they save.
HOLD_FRAMES: Final = 32
#: ``FramedProtocol._held`` while the one event of a read is handled: its first frame is
#: written at once, the rest held until the read's end (never appended to).
_AT_ONCE: Final[list[bytes | bytearray | memoryview]] = []


class Stream:
    """One ``(call id, stream name)`` on the glue's side: inbound buffer and credit waiter."""

    __slots__ = (
        "_chunks",
        "_detached",
        "_ended",
        "_owner",
        "_unearned",
        "_waiter",
        "buffered",
        "call_id",
        "credit_waiter",
        "name",
    )

    def __init__(self, owner: FramedProtocol, call_id: int, name: str) -> None:
        self._owner = owner
        self.call_id = call_id
        self.name = name
        self._chunks: collections.deque[bytes] = collections.deque()
        self._ended = False
        #: True once the call has finished: reads no longer grant credit.
        self._detached = False
        self._waiter: asyncio.Future[None] | None = None
        #: The sender waiting for the peer's credit on this stream, if any.
        self.credit_waiter: asyncio.Future[None] | None = None
        self.buffered = 0
        #: Buffered bytes that came on another call (see carry_streams): reading them grants none.
        self._unearned = 0

    def _push(self, data: bytes, end: bool) -> None:
        if data:
            self._chunks.append(data)
            self.buffered += len(data)
        if end:
            self._ended = True
        self._wake()

    def _finish(self) -> None:
        """The call has finished: nothing more will come, nobody waits for credit."""
        self._detached = True
        self._ended = True
        self._wake()
        self._credit_arrived()

    def _credit_arrived(self) -> None:
        waiter = self.credit_waiter
        if waiter is not None:
            self.credit_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read(self) -> bytes | None:
        """The next chunk of data, or None once the stream has ended.

        Raises the connection's :meth:`~FramedProtocol.closed_error` once the
        connection has closed and nothing buffered is left.
        """
        owner = self._owner
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self.buffered -= len(data)
                if not self._detached:
                    owner._consumed(self, len(data))
                return data
            if self._ended:
                return None
            if owner.closed:
                raise owner.closed_error()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """Every chunk until the stream ends."""
        while True:
            data = await self.read()
            if data is None:
                return
            yield data

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.chunks()


class FramedProtocol(asyncio.BufferedProtocol):
    """Base asyncio protocol for both roles.

    A ``BufferedProtocol``: the transport receives straight into the buffer
    the connection offers (:attr:`Connection.get_buffer <protocol.connection.Connection.get_buffer>`), so the body of a
    large frame is copied by the kernel only.
    """

    def __init__(
        self, conn: Connection, *, max_inbound_buffer: int = DEFAULT_MAX_INBOUND_BUFFER
    ) -> None:
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        self.max_inbound_buffer = max_inbound_buffer
        #: call id -> stream name -> its record; a call's entry goes when it finishes.
        self._streams: dict[int, dict[str, Stream]] = {}
        self._inbound_total = 0
        self._paused = False
        self._drain_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.closed = False
        self.close_reason: BaseException | None = None
        #: The buffers of small frames held to be written together (see :meth:`_put`), a
        #: SplicedFrame's parts in its place; None: write at once.
        self._held: list[bytes | bytearray | memoryview] | None = None
        self._hold_loop: asyncio.AbstractEventLoop | None = None
        #: ``time.monotonic()`` of the latest bytes received.
        self.last_received = time.monotonic()

    # -- asyncio.Protocol ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self._hold_loop = asyncio.get_running_loop()
        self._flush_outbox()

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the transport puts the next bytes: the connection's receive buffer."""
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
        out = self.conn.data_to_send()
        # What is sent while the events are handled goes out in one write after them;
        # but the answer to a call made alone (one event, nothing held before it) goes
        # out at once, not after what the call's handler does once it has answered.
        outer = self._held
        if outer is None and not out and len(events) == 1:
            self._held = _AT_ONCE
        else:
            held = outer if outer is not None else []
            if out:
                held.append(out)
            self._held = held
        try:
            for event in events:
                if type(event) is Chunk:
                    self._on_chunk(event)
                elif type(event) is Credit:
                    self._on_credit(event)
                else:
                    if self._streams and (type(event) is Reply or type(event) is Error):
                        self.drop_streams(event.id)
                    self.handle_event(event)
                if self.closed:
                    return
        finally:
            if outer is None:
                self._release_held()
        if self.conn.state is CLOSED:
            self.abort(None)

    def _put(self, transport: asyncio.Transport, frame: Frame) -> None:
        """Write ``frame``, or hold it to go out with the frames sent right beside it.

        Frames are held while the events of one read are handled (the answers
        to a batch of pipelined calls; a read of one event writes its first
        frame at once, the answer to a call made alone), and after a frame
        written at once until the event loop's next round (the calls a batch
        of woken tasks send): one system call for the lot instead of one each,
        as the floor does, in parts of :data:`HOLD_FRAMES` so that the peer
        works on one part while the next is made. Order is kept; a large frame
        goes out at once, with what is held before it.
        """
        held = self._held
        if held is None or held is _AT_ONCE:
            if type(frame) is SplicedFrame:
                transport.writelines(frame.parts)
            else:
                transport.write(frame)
            if held is _AT_ONCE:
                self._held = []  # the rest of the read's answers: the read releases them
            elif self._hold_loop is not None:
                self._held = []
                self._hold_loop.call_soon(self._release_held)
        elif type(frame) is SplicedFrame:
            held += frame.parts
            self._write_held(held)
            held.clear()
        else:
            held.append(frame)
            if len(frame) >= HOLD_MAX or len(held) >= HOLD_FRAMES:
                self._write_held(held)
                held.clear()

    def _release_held(self) -> None:
        """Write the frames held so far, in order, and write at once again."""
        held, self._held = self._held, None
        if held:
            self._write_held(held)

    def _write_held(self, held: list[bytes | bytearray | memoryview]) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if len(held) == 1:
                transport.write(held[0])
            else:
                transport.writelines(held)

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

    def closed_error(self) -> Exception:
        """What sending on, or reading from, this closed connection raises."""
        return ConnectionLost("the connection is closed")

    # -- sending -------------------------------------------------------------

    def send(self, message: Message) -> None:
        """Frame ``message`` through the state machine and write it: the one way out.

        Raises :meth:`closed_error` when the connection is closed, and the
        state machine's LocalProtocolError when the message is not allowed.
        A final answer (Reply, Error) also ends the call's streams here.
        """
        if self.closed:
            raise self.closed_error()
        try:
            # Large chunks of immutable data go out as SplicedFrames: written, not copied.
            frame = self.conn.send(message, splice=True)
        except LocalProtocolError:
            if self.conn.state is CLOSED:
                raise self.closed_error() from None
            raise
        transport = self.transport
        if transport is None:
            raise self.closed_error()
        self._put(transport, frame)
        if self._streams and (type(message) is Reply or type(message) is Error):
            self.drop_streams(message.id)

    def _write(self, frame: Frame) -> None:
        transport = self.transport
        if transport is None or self.closed:
            raise self.closed_error()
        if frame:
            self._put(transport, frame)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        if self.closed:
            raise self.closed_error()
        if not self._paused:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter
        if self.closed:
            raise self.closed_error()

    async def send_stream(self, call_id: int, stream: str, data: bytes, *, end: bool) -> None:
        """Send ``data`` on a stream in chunks, waiting for credit and drain.

        Chunks are at most :data:`STREAM_CHUNK` bytes and at most a quarter of
        the peer's window (but not under :data:`MIN_STREAM_CHUNK`), and carry
        views of ``data``: immutable ``data`` (bytes) is written as it is
        (spliced, see :func:`~protocol.framing.encode_chunk`), anything else
        is copied once, into the frame.
        """
        view = memoryview(data)
        offset = 0
        total = len(data)
        conn = self.conn
        step = min(STREAM_CHUNK, max(MIN_STREAM_CHUNK, conn.peer_window // 4), conn.max_chunk)
        while True:
            if self.closed:
                raise self.closed_error()
            remaining = total - offset
            credit = conn.stream_credit(call_id, stream)
            if remaining and credit <= 0:
                await self._wait_credit(call_id, stream)
                continue
            size = min(remaining, credit, step)
            last = offset + size >= total
            # A view is encoded as msgpack bin exactly as bytes are.
            piece: bytes = data if size == total else cast(bytes, view[offset : offset + size])
            seq = conn.next_seq(call_id, stream)
            self.send(Chunk(id=call_id, stream=stream, seq=seq, data=piece, end=end and last))
            offset += size
            if self._paused:
                await self.drain()
            if last:
                return

    async def _wait_credit(self, call_id: int, stream: str) -> None:
        entry = self.stream(call_id, stream)
        waiter = entry.credit_waiter
        if waiter is None or waiter.done():
            waiter = entry.credit_waiter = asyncio.get_running_loop().create_future()
        await waiter
        if self.closed:
            raise self.closed_error()

    def _on_credit(self, credit: Credit) -> None:
        streams = self._streams.get(credit.id)
        entry = streams.get(credit.stream) if streams is not None else None
        if entry is not None:
            entry._credit_arrived()

    # -- receiving streams ---------------------------------------------------

    def stream(self, call_id: int, name: str) -> Stream:
        """The record of a stream of a call (created on first use by either side)."""
        streams = self._streams.get(call_id)
        if streams is None:
            if not self.conn.in_flight(call_id):
                # The call has finished (or never was): its streams have ended.
                ended = Stream(self, call_id, name)
                ended._finish()
                return ended
            streams = self._streams[call_id] = {}
        entry = streams.get(name)
        if entry is None:
            entry = streams[name] = Stream(self, call_id, name)
        return entry

    def _on_chunk(self, chunk: Chunk) -> None:
        entry = self.stream(chunk.id, chunk.stream)
        self._inbound_total += len(chunk.data)
        if self._inbound_total > self.max_inbound_buffer:
            self.abort(FlowControlViolation("peer's unread stream data exceeds the buffer cap"))
            return
        entry._push(chunk.data, chunk.end)

    def _consumed(self, entry: Stream, nbytes: int) -> None:
        self._inbound_total -= nbytes
        if self.closed:
            return
        unearned = entry._unearned
        if unearned:
            free = min(unearned, nbytes)
            entry._unearned = unearned - free
            nbytes -= free
        frame = self.conn.grant(entry.call_id, entry.name, nbytes)
        if frame:
            self._write(frame)

    def carry_streams(self, call_id: int, streams: dict[str, Stream]) -> None:
        """Make ``streams`` the streams of call ``call_id`` here, wherever they were before.

        For a call that goes on as another call, on this connection or
        another one: its readers keep their records, what those still buffer
        stays readable, and reading it grants no credit here (it came on the
        other call, within that call's window). The caller takes ``streams``
        out of the table of the connection they were on.
        """
        for entry in streams.values():
            source = entry._owner
            source._inbound_total -= entry.buffered
            entry._owner = self
            entry.call_id = call_id
            entry._unearned = entry.buffered
            self._inbound_total += entry.buffered
        self._streams[call_id] = streams

    def drop_streams(self, call_id: int) -> None:
        """A call has finished: end its streams and wake whoever waits on them."""
        streams = self._streams.pop(call_id, None)
        if streams is None:
            return
        for entry in streams.values():
            self._inbound_total -= entry.buffered
            entry._finish()

    # -- closing -------------------------------------------------------------

    def abort(
        self, reason: BaseException | None, *, code: ErrorCode | None = None, message: str = ""
    ) -> None:
        """Close the connection now, sending an Abort first when the state allows.

        The Abort carries ``message``, else ``reason``'s text.
        """
        if self.close_reason is None:
            self.close_reason = reason
        self._release_held()  # what was sent before goes before the Abort
        if code is not None or isinstance(reason, RemoteProtocolError):
            err_code = (
                code if code is not None else getattr(reason, "code", ErrorCode.PROTOCOL_ERROR)
            )
            frame = self.conn.close(err_code, message or (str(reason) if reason else ""))
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
        for streams in self._streams.values():
            for entry in streams.values():
                entry._wake()
                entry._credit_arrived()
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        try:
            self.handle_closed(reason)
        except Exception:
            log.exception("error while closing a connection")
