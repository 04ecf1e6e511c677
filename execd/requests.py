"""Request ids: calls that survive a lost connection and run at most once.

Theory of operation
-------------------
This module is one layer around the server's dispatch: the dispatcher runs
every call the same way, with a context (:class:`Dispatched`) it tells the
call's fate (running on, finished with an outcome, cancelled), and this
layer decides what those mean. A call without a request id gets the
server's plain context, whose hooks do nothing. A call that carries one
(``rid``, PROTOCOL.md section 8.1) goes through
:meth:`RequestTable.dispatch`: a connection-scoped method keeps the plain
context; a known id runs an attach to its request instead of the method; a
new id is *tracked*: its handler runs with a :class:`TrackedCall` (its
output kept, its connection a virtual one) whose hooks hand the outcome (the
encoded result, or the error) to :meth:`RequestTable.finish` right after the
call is answered as usual (nothing runs in between: a copy of the call finds
the outcome kept).

A tracked call gets a :class:`Request`, its record while it runs, only once
something needs one (:meth:`RequestTable.open`): when its handler first
sends output, or when the call is not over once its dispatch returns (it
suspended, or its first step was left to a task: :meth:`TrackedCall.running`).
Until then nothing but the call itself can look for it: no other frame is
processed while a call is dispatched. So a call that answers at once (a
no-op, a small file read) costs the table no record, only its outcome kept;
any other is registered before the next frame is read, and from then on a
connection that closes, or a copy of the call, finds it.
Three things set a tracked call apart from any other:

* **It does not belong to its connection.** The handler's task is the
  dispatcher's task of the original call, but when that connection closes
  the server asks :meth:`RequestTable.connection_closed` which of its tasks
  to leave running. The request is then *unbound*: a grace timer starts
  (``Limits.request_grace``), output goes on being produced into the
  request's own buffers (up to ``Limits.output_cap`` more per stream, after
  which the handler waits, as for a reader that grants no credit), and
  ``on_close`` callbacks (which stop a connection's commands) wait for the
  request's end. When the grace passes with nobody attached, the task is
  cancelled as a lost connection would have cancelled it at once (a command
  gets its group killed) and the outcome kept is ``CANCELLED`` with the
  message ``cancelled: connection lost``.
* **Its outcome outlives it.** Finished requests stay in a retention window
  bounded by count (``Limits.request_retention``) and by bytes
  (``Limits.request_retention_bytes``: encoded results plus kept output);
  the oldest are evicted first, and their ids are remembered (four times the
  count, 16 bytes each) so that a late attach hears "evicted" rather than
  "unknown".
* **It runs once.** A second call with a known id, or a ``request.attach``,
  *attaches* to the request: the attaching call's streams carry the output
  from the offsets the client holds, then its answer is the request's
  outcome. A call whose id was evicted fails with REQUEST_NOT_KNOWN instead
  of running.

Output is retained per stream: everything produced while unbound, and while
bound the last ``Limits.output_cap`` bytes -- at least the peer's window with
the default windows, so at least every byte sent that the client may not
have consumed (the sender cannot run further ahead of the reader than the
credit it was granted). An attach that asks for older bytes fails with
STREAM_ERROR before anything is sent.

Once a call has finished, the client either got its output or lost it with
the connection, and the server cannot tell which from the answer alone. So
after answering a call that keeps at least :data:`RECEIPT_MIN` bytes of
output, the table has the server ping the connection (one ping in flight per
connection; the server tells it of every answer and every pong:
:meth:`RequestTable.answered`, :meth:`RequestTable.pong`): the peer answers
pings in order with its other frames, so its pong proves that it received
every chunk sent before the ping, and those bytes are let go; the outcome and
the streams' offsets stay. Without that, every finished large read would pin its blocks for as
long as the retention window keeps it (up to ``request_retention_bytes``),
and each read's blocks would land in fresh memory. Output of a call that is
still running is kept as above. A per-stream lock orders a live send
and the replay of an attach, so the attaching call sees the stream's bytes
exactly once and in order.

An attach takes the request on as it is received: its handler is run
``direct`` (:mod:`execd.calls`), and its first step binds the request to the
attaching connection before the next frame is read, though the request's
live output goes to the attaching call only once the replay holds every
stream's lock. So a Cancel of the attaching call, whenever it comes (right
behind the attach, during the replay, while it waits for the end), finds the
request held by it and cancels the call itself. An attach that ends any
other way while the request runs (its connection lost, its replay failed)
releases it: unbound again, with a fresh grace. Its connection's loss
releases the request before the attach is cancelled, which is how the two
cancellations are told apart.

An attach from a newer connection while the request is still bound to an
older live one means the client has given that connection up (a half-open
TCP connection after a NAT timeout, say): that connection is closed, and the
request moves. A late copy from an older connection, or an attach from the
connection it is bound to, is INVALID_PARAMS and changes nothing.

For an id it does not know, ``request.attach`` says whether the connection
the call was sent on (``sent_on``, a server nonce) was one of this execd's:
then the call never arrived and the client may send it again under the same
id. The nonces of the newest authenticated connections are remembered for
that (as many as evicted ids).

Uploads are not replayed: a handler reading a client stream of a request
whose connection is lost gets ConnectionLost, which fails the request with
STREAM_ERROR (``files.write`` in atomic mode then leaves the target
untouched).

Every id is reachable only through an authenticated connection of this
execd, which has one token; ids are 128-bit random, so a client cannot find
another's request by guessing.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

import msgspec

from execd.commands import BackgroundTasks
from execd.config import Limits
from execd.context import CallContext, ConnectionLost, Method, bind
from execd.errors import (
    Cancelled,
    ExecdError,
    InvalidParams,
    RequestNotKnown,
    StreamError,
)
from protocol.codec import to_raw
from protocol.errors import ErrorCode
from protocol.rpc import request as api

log = logging.getLogger("execd.requests")

#: Evicted ids remembered per id of the retention count.
EVICTED_MEMORY: Final = 4
#: Bytes a kept outcome costs beyond its payload (its tuples, its id, the table slots).
ENTRY_OVERHEAD: Final = 512
#: Kept output of a finished call from which its receipt is proved (a ping) to let it go.
RECEIPT_MIN: Final = 64 * 1024

#: Encoded results from this size on are kept in memory mapped for each alone (_compact).
MAPPED_MIN: Final = 64 * 1024

#: A finished call's outcome: its encoded result, or its error.
Outcome = bytes | ExecdError
if TYPE_CHECKING:
    import mmap  # imported on first use: execd's start does not need it

#: An outcome kept compactly: the encoded result as it is (a large one in a mapping of its
#: own), or the error's code, message and encoded data.
Kept: TypeAlias = "bytes | mmap.mmap | tuple[int, str, bytes]"
#: One output stream of a finished call as kept: its name, the offset of its first kept
#: byte, the kept chunks, and whether it had ended.
KeptStream = tuple[str, int, tuple[bytes, ...], bool]
#: A finished call as the retention window keeps it: the bytes it costs, its outcome and its
#: kept output, by stream name. Tuples of bytes, ints and strings, which the garbage
#: collector stops tracking (the Request, its locks and buffers go), and which never
#: change: letting output go replaces the entry, so an attach replaying it keeps what it
#: took.
Finished = tuple[int, Kept, tuple[KeptStream, ...]]
Callback = Callable[[], Awaitable[None] | None]
#: What a tracked call whose upload was cut by a lost connection fails with.
UPLOAD_LOST: Final = "the connection was lost while the call's upload was received"


class Dispatched(CallContext, Protocol):
    """The context a dispatcher runs a call with: a handler's, plus the call's fate.

    The dispatcher calls :meth:`running` once the call is not over when its
    dispatch returns, and then exactly one of :meth:`finished` (with the
    encoded result or the error it answered) and :meth:`cancelled`.
    """

    def running(self) -> None:
        """The call runs on past its dispatch."""
        ...

    def finished(self, outcome: bytes | ExecdError) -> None:
        """The call was answered with ``outcome`` (an encoded result, or an error)."""
        ...

    def cancelled(self) -> None:
        """The call's handler was cancelled (by its caller, or by a lost connection)."""
        ...

    def upload_lost(self) -> ExecdError | None:
        """What the call is answered when its connection was lost under its upload.

        None: nothing (the call is lost with its connection, PROTOCOL.md section 8).
        """
        ...


class _Output:
    """The kept bytes of one output stream: ``[base, base + size)`` of everything produced."""

    __slots__ = ("base", "chunks", "ended", "lock", "size")

    def __init__(self) -> None:
        self.base = 0
        self.size = 0
        self.chunks: collections.deque[bytes] = collections.deque()
        self.ended = False
        self.lock = asyncio.Lock()

    def append(self, data: bytes) -> None:
        if data:
            piece = bytes(data)
            self.chunks.append(piece)
            self.size += len(piece)

    def trim(self, keep: int) -> None:
        """Drop the oldest whole chunks while at least ``keep`` bytes stay."""
        chunks = self.chunks
        while chunks and self.size - len(chunks[0]) >= keep:
            dropped = chunks.popleft()
            self.size -= len(dropped)
            self.base += len(dropped)

    def since(self, offset: int) -> bytes:
        """The kept bytes from ``offset`` (at least ``base``) on."""
        return _tail(self.chunks, self.base, offset)


class Request:
    """The record of a tracked call while it runs (finished, it is kept as :data:`Finished`).

    Made by :meth:`RequestTable.open` for a call that is not over once its
    dispatch returns, or that sends output. Its output goes through
    :meth:`send` into the request's own buffers (and on to the call bound to
    it), so it survives the connection the call came on. ``origin`` is the
    original call's plain context (on its real connection, not the tracked
    call's virtual one): the output goes there while the call is bound to it.
    """

    __slots__ = (
        "attached",
        "bound_to",
        "call_id",
        "done",
        "grace",
        "lost",
        "method",
        "origin",
        "origin_connection",
        "outcome",
        "rid",
        "sink",
        "streams",
        "table",
        "task",
    )

    def __init__(self, table: RequestTable, rid: bytes, method: str, origin: CallContext) -> None:
        self.table = table
        self.rid = rid
        self.method = method
        self.origin_connection = origin.connection_id
        self.call_id = origin.call_id
        #: The connection whose call gets the answer; None while unbound.
        self.bound_to: int | None = self.origin_connection
        self.origin: CallContext | None = origin
        #: The context of the call that gets the answer and the live output; None while
        #: unbound, and while the attach that holds it has not caught up (_replay).
        self.sink: CallContext | None = origin
        self.task: asyncio.Task[Any] | None = None
        self.outcome: Outcome | None = None
        self.done: asyncio.Future[None] | None = None
        self.attached: asyncio.Future[None] | None = None
        #: Output kept per stream (None until the handler sends any: most calls never do).
        self.streams: dict[str, _Output] | None = None
        self.grace: asyncio.TimerHandle | None = None
        self.lost = False

    def output(self, stream: str) -> _Output:
        streams = self.streams
        if streams is None:
            streams = self.streams = {}
        out = streams.get(stream)
        if out is None:
            out = streams[stream] = _Output()
        return out

    @property
    def max_chunk(self) -> int:
        """The largest chunk the call that gets the output takes."""
        sink = self.sink or self.origin
        assert sink is not None
        return sink.max_chunk

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        """The handler's output on ``stream``: kept, and sent on to the bound call if any."""
        out = self.output(stream)
        table = self.table
        while self.sink is None and out.size > table.detached_cap:
            await table.wait_attached(self)
        async with out.lock:
            out.append(data)
            out.ended = out.ended or end
            sink = self.sink
            if sink is None:
                return
            try:
                await sink.send(stream, data, end=end)
            except ConnectionLost:
                return  # kept: an attach replays it
            out.trim(table.keep)


class TrackedCall:
    """The context of a call with a new request id: its output kept, its connection virtual.

    Its output goes through the call's :class:`Request`, opened on first need
    (:meth:`open`: most calls answer without), which keeps it for an attach.
    Uploads and events are its own call's, on ``origin`` (the plain context of
    the connection it came on), as for any call. Its :attr:`connection_id` is
    a virtual connection's: closing the real one must not stop what tracked
    calls started; one per connection, so that a call can still name another
    by its call id (``shell.signal``), and its ``on_close`` callbacks run once
    the connection is closed and every tracked call it started has ended.
    """

    __slots__ = ("_origin", "_table", "method", "request", "rid")

    def __init__(self, table: RequestTable, origin: CallContext, rid: bytes, method: str) -> None:
        self._table = table
        self._origin = origin
        self.rid = rid
        self.method = method
        #: The call's record, once opened.
        self.request: Request | None = None

    @property
    def call_id(self) -> int:
        return self._origin.call_id

    @property
    def connection_id(self) -> int:
        return -self._origin.connection_id

    @property
    def max_chunk(self) -> int:
        req = self.request
        return self._origin.max_chunk if req is None else req.max_chunk

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        await self.open().send(stream, data, end=end)

    def receive(self, stream: str) -> AsyncIterator[bytes]:
        return self._origin.receive(stream)

    async def push_event(self, topic: int, name: str, data: Any) -> None:
        await self._origin.push_event(topic, name, data)

    def on_close(self, callback: Callback) -> None:
        self._table.on_virtual_close(self.connection_id, callback)

    def open(self) -> Request:
        """The call's record, opened (and registered as running) if it is not yet."""
        req = self.request
        if req is None:
            req = self.request = self._table.open(self.rid, self.method, self._origin)
        return req

    # -- its fate, from the dispatcher ----------------------------------------------

    def running(self) -> None:
        self.open()  # it runs on: from now on others must find it

    def finished(self, outcome: bytes | ExecdError) -> None:
        self._table.finish(self.rid, outcome, self.request)

    def cancelled(self) -> None:
        self._table.cancelled(self.rid, self.method, self.request)

    def upload_lost(self) -> ExecdError | None:
        # It outlives its connection, to be answered on another.
        return StreamError(UPLOAD_LOST)


class RequestTable:
    """Every request id execd knows: running, kept, and recently evicted."""

    def __init__(self, limits: Limits) -> None:
        self.grace = limits.request_grace
        self.max_count = limits.request_retention
        self.max_bytes = limits.request_retention_bytes
        #: Evicted ids remembered (their order is :attr:`_evicted_order`).
        self.remembered = EVICTED_MEMORY * self.max_count
        self.keep = limits.output_cap
        self.detached_cap = 2 * limits.output_cap
        self._running: dict[bytes, Request] = {}
        self._finished: dict[bytes, Finished] = {}
        # The ids of _finished, oldest first (only eviction takes them out of either), and
        # the evicted ids remembered, as a set and oldest first: a deque and a plain table
        # cost no allocation per entry, as an OrderedDict's linked nodes do.
        self._finish_order: collections.deque[bytes] = collections.deque()
        self._evicted: set[bytes] = set()
        self._evicted_order: collections.deque[bytes] = collections.deque()
        # Server nonces of this execd's authenticated connections (the newest ones).
        self._nonces: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._background = BackgroundTasks("requests")
        # Per virtual connection (minus the id of the connection its calls came on): what
        # to run once it is closed and none of its calls runs; and, once it is closed,
        # how many of its calls still run (counted when it closes, not per call).
        self._virtual_callbacks: dict[int, list[Callback]] = {}
        self._closed_running: dict[int, int] = {}
        # Per connection: the ids of finished requests answered on it whose kept output
        # waits for proof of receipt. Ids, not requests: an evicted request is not held
        # on to by these lists.
        self._unproved: dict[int, list[bytes]] = {}
        # Per connection: the ids the ping in flight covers, with its seq.
        self._pinged: dict[int, tuple[int, list[bytes]]] = {}
        self.kept_bytes = 0
        self.evictions = 0
        #: Closes a connection by its id (set by the server).
        self.abort_connection: Callable[[int], None] = lambda _: None

    # -- the dispatcher's hooks ------------------------------------------------------

    def methods(self) -> list[Method]:
        # An attach takes its request on in its first step, on receipt: a Cancel read right
        # behind it finds the request held by it (its first step needs no task).
        return bind(self, api.RPCS, direct=api.RPCS)

    def dispatch(self, method: Method, origin: Dispatched, rid: bytes) -> tuple[Method, Dispatched]:
        """What runs a call of ``method`` carrying ``rid``, and the context it runs with.

        ``origin``: the call's plain context on its connection. A new id runs
        the method with a :class:`TrackedCall`; a known id an attach to its
        request with ``origin``; a connection-scoped method itself with
        ``origin`` (see :meth:`track`).
        """
        method, new = self.track(rid, method)
        if new:
            return method, TrackedCall(self, origin, rid, method.name)
        return method, origin

    def track(self, rid: bytes, method: Method) -> tuple[Method, bool]:
        """What runs a call of ``method`` carrying request id ``rid``, and whether it is tracked.

        A new id is tracked: the dispatcher runs the handler and hands the
        outcome to :meth:`finish`, having opened the call's record
        (:meth:`open`) if the call is not over once its dispatch returns, or
        sends output. A
        known id runs an attach to its request instead (never the method
        again); a connection-scoped method is not tracked.
        """
        if method.name in api.CONNECTION_SCOPED:
            return method, False
        if rid in self._running or rid in self._finished or rid in self._evicted:
            return Method(method.rpc, functools.partial(self._again, rid), direct=True), False
        return method, True

    def open(self, rid: bytes, method: str, origin: CallContext) -> Request:
        """The record of the tracked call ``rid`` of ``method``, registered as running.

        ``origin`` is the call's plain context on its connection. Opened
        before the next frame is read when the call is not over once its
        dispatch returns: a connection that closes right behind the call must
        find it (and leave its task running), and so must a copy of the call.
        """
        req = self._running[rid] = Request(self, rid, method, origin)
        return req

    def connection_opened(self, server_nonce: bytes) -> None:
        """An authenticated connection: remember its nonce (``request.attach``'s ``sent_on``)."""
        self._nonces[server_nonce] = None
        if len(self._nonces) > self.remembered:
            self._nonces.popitem(last=False)

    def connection_closed(
        self, connection_id: int, tasks: Mapping[int, asyncio.Task[Any]]
    ) -> frozenset[int]:
        """Unbind the requests of a closed connection; the call ids whose tasks live on.

        ``tasks``: the connection's tasks by call id; the table takes those of
        its requests (to cancel them when their grace runs out). A scan of the
        running requests: connections close far less often than calls come,
        and no index has to be kept up to date per call.
        """
        survivors: list[int] = []
        # No receipt will come: what waited for one stays kept for an attach.
        self._unproved.pop(connection_id, None)
        self._pinged.pop(connection_id, None)
        for req in self._running.values():
            if req.origin_connection == connection_id:
                survivors.append(req.call_id)
                req.task = tasks.get(req.call_id)
            if req.bound_to == connection_id:
                self._release(req)
        if survivors:
            # Its calls run on (the requests that came on it are its virtual connection's).
            self._closed_running[-connection_id] = len(survivors)
        elif -connection_id in self._virtual_callbacks:
            self._virtual_closed(-connection_id)
        return frozenset(survivors)

    def on_virtual_close(self, virtual: int, callback: Callback) -> None:
        """Run ``callback`` once the connection is closed and its tracked calls have ended."""
        self._virtual_callbacks.setdefault(virtual, []).append(callback)

    def _virtual_closed(self, virtual: int) -> None:
        callbacks = self._virtual_callbacks.pop(virtual, None)
        if callbacks:
            self._background.spawn(_run_callbacks(callbacks))

    def close(self) -> None:
        """execd is stopping: cancel every running request."""
        for req in list(self._running.values()):
            if req.grace is not None:
                req.grace.cancel()
            if req.task is not None:
                req.task.cancel()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def kept(self) -> int:
        return len(self._finished)

    def locate(self, rid: bytes) -> tuple[int, int] | None:
        """The connection id and call id the handler of running request ``rid`` was given.

        A capability keeps what a call runs by those (``shell.signal`` finds
        a command by request id through them, from any connection); None when
        no request of that id runs.
        """
        req = self._running.get(rid)
        if req is None:
            return None
        return -req.origin_connection, req.call_id  # a TrackedCall's (virtual) connection

    # -- running a tracked call --------------------------------------------------------

    def _lookup(self, rid: bytes) -> Request | Finished | None:
        req = self._running.get(rid)
        if req is not None:
            return req
        return self._finished.get(rid)

    async def _again(self, rid: bytes, params: Any, ctx: CallContext) -> Any:
        """A call with an id already known: attach to it (it never runs twice)."""
        found = self._lookup(rid)
        if found is None:
            raise self._not_known(rid, "evicted" if rid in self._evicted else "unknown")
        return await self._attach(rid, found, ctx, {})

    def cancelled(self, rid: bytes, method: str, req: Request | None) -> None:
        """The handler of tracked call ``rid`` (record ``req``, if opened) was cancelled: by
        its caller, or by a lost connection."""
        lost = req is not None and req.lost
        message = "cancelled: connection lost" if lost else f"{method} was cancelled"
        self.finish(rid, Cancelled(message), req)

    def finish(self, rid: bytes, outcome: Outcome, req: Request | None = None) -> None:
        """Tracked call ``rid`` (record ``req``, if opened) has its outcome: keep it in the
        retention window, with the output the record kept."""
        streams: tuple[KeptStream, ...] = ()
        output = 0
        if req is not None:
            streams, output = self._ended(req, outcome)
        kept, cost = _compact(outcome)
        size = output + ENTRY_OVERHEAD + cost
        finished = self._finished
        finished[rid] = (size, kept, streams)
        self._finish_order.append(rid)
        self.kept_bytes += size
        if len(finished) > self.max_count or self.kept_bytes > self.max_bytes:
            self._evict()

    def _ended(self, req: Request, outcome: Outcome) -> tuple[tuple[KeptStream, ...], int]:
        """``req`` has its outcome: it runs no more. The output it keeps, and its size."""
        req.outcome = outcome
        self._running.pop(req.rid, None)
        streams: tuple[KeptStream, ...] = ()
        output = 0
        if req.streams:  # many calls have none: spare them the generators
            streams, output = self._keep_output(req, req.streams)
        req.task = req.sink = req.bound_to = req.origin = None
        if req.grace is not None:
            req.grace.cancel()
            req.grace = None
        if req.done is not None and not req.done.done():
            req.done.set_result(None)
        closed = self._closed_running
        if closed:
            virtual = -req.origin_connection
            left = closed.get(virtual)
            if left == 1:
                del closed[virtual]
                self._virtual_closed(virtual)
            elif left is not None:
                closed[virtual] = left - 1
        return streams, output

    def _keep_output(
        self, req: Request, outputs: dict[str, _Output]
    ) -> tuple[tuple[KeptStream, ...], int]:
        """The output ``req`` keeps once finished, and its size; if it is large and was
        answered on a connection, its receipt there is awaited to let it go."""
        streams = tuple(
            (name, out.base, tuple(out.chunks), out.ended) for name, out in sorted(outputs.items())
        )
        output = sum(out.size for out in outputs.values())
        bound = req.bound_to
        if bound is not None and req.sink is not None:
            self._await_receipt(req.rid, output, bound)
        return streams, output

    # -- proof of receipt --------------------------------------------------------------

    def _await_receipt(self, rid: bytes, output: int, connection_id: int) -> None:
        """Request ``rid`` (``output`` bytes kept) is answered on ``connection_id``: let its
        output go once received there."""
        if output >= RECEIPT_MIN:
            waiting = self._unproved.setdefault(connection_id, [])
            waiting.append(rid)
            if len(waiting) > self.max_count:
                # A peer that leaves pings unanswered: the oldest wait for eviction instead.
                del waiting[0]

    def answered(self, connection_id: int, ping: Callable[[], int | None]) -> None:
        """A call was answered on ``connection_id``: prove receipt of kept output, if any waits.

        ``ping`` sends a Ping on the connection, behind every answer so far,
        and returns its seq (None: the connection is gone). One ping is in
        flight per connection; its pong (:meth:`pong`) lets the output go.
        """
        if connection_id in self._unproved and connection_id not in self._pinged:
            seq = ping()
            if seq is not None:
                waiting = self._unproved.pop(connection_id, None)
                if waiting:
                    self._pinged[connection_id] = (seq, waiting)

    def pong(self, connection_id: int, seq: int, ping: Callable[[], int | None]) -> None:
        """``pong(seq)`` came on ``connection_id`` (``ping`` as for :meth:`answered`).

        If it answers the ping in flight, the peer received every frame sent
        before that ping: the kept output of the requests answered before it
        goes (their outcomes stay), and the next ping goes out if more waits.
        """
        pinged = self._pinged.get(connection_id)
        if pinged is None or pinged[0] != seq:
            return  # not ours, or not the latest
        del self._pinged[connection_id]
        finished = self._finished
        for rid in pinged[1]:
            kept = finished.get(rid)
            if kept is None:
                continue  # evicted meanwhile
            size, outcome, streams = kept
            released = _output_size(streams)
            left = tuple(
                (name, base + sum(map(len, chunks)), (), ended)
                for name, base, chunks, ended in streams
            )
            finished[rid] = (size - released, outcome, left)
            self.kept_bytes -= released
        self.answered(connection_id, ping)

    def _evict(self) -> None:
        """The window is over a bound: evict the oldest outcomes until it is within both
        (remembering their ids)."""
        finished, order = self._finished, self._finish_order
        evicted, evicted_order = self._evicted, self._evicted_order
        while order:
            rid = order.popleft()
            self.kept_bytes -= finished.pop(rid)[0]
            self.evictions += 1
            evicted.add(rid)
            evicted_order.append(rid)
            if len(evicted_order) > self.remembered:
                evicted.discard(evicted_order.popleft())
            if len(order) <= self.max_count and self.kept_bytes <= self.max_bytes:
                return

    def _expire(self, req: Request) -> None:
        req.grace = None
        if req.outcome is not None or req.bound_to is not None:
            return
        log.info("%s: no reattach within %g s; cancelling it", req.method, self.grace)
        req.lost = True
        self._cancel(req)

    def _cancel(self, req: Request) -> None:
        """Cancel running request ``req`` (its grace ran out, or its attach was cancelled)."""
        task = req.task
        if task is not None and not task.done():
            task.cancel()
        else:
            # Its task was cancelled before it ever ran (a Cancel right behind the call), so
            # its handler never told how it ended.
            self.cancelled(req.rid, req.method, req)

    # -- attaching ---------------------------------------------------------------------

    async def request_attach(self, params: api.AttachParams, ctx: CallContext) -> msgspec.Raw:
        """``request.attach``: the rest of a request's output, then its outcome."""
        found = self._lookup(params.rid)
        if found is None:
            reason: api.NotKnownReason = "evicted" if params.rid in self._evicted else "unknown"
            seen = params.sent_on is not None and params.sent_on in self._nonces
            raise self._not_known(params.rid, reason, seen=seen and reason == "unknown")
        return await self._attach(params.rid, found, ctx, params.offsets)

    async def _attach(
        self, rid: bytes, found: Request | Finished, ctx: CallContext, offsets: dict[str, int]
    ) -> msgspec.Raw:
        if isinstance(found, tuple):
            _, kept, streams = found
            _check_offsets([(name, base) for name, base, _, _ in streams], offsets)
            for name, base, chunks, ended in streams:
                data = _tail(chunks, base, offsets.get(name, 0))
                if data or ended:
                    await ctx.send(name, data, end=ended)
            self._await_receipt(rid, _output_size(streams), ctx.connection_id)
            return _expand(kept)
        req = found
        bound = req.bound_to
        if bound is not None:
            if bound == ctx.connection_id:
                raise InvalidParams("the request is in flight on this connection already")
            if bound > ctx.connection_id:
                # A copy of the call from an older connection, processed late: the newer
                # connection keeps the request.
                raise InvalidParams("the request is attached from a newer connection")
            # The client gave that connection up: close it (which unbinds the request).
            self.abort_connection(bound)
        _check_offsets([(name, out.base) for name, out in (req.streams or {}).items()], offsets)
        self._claim(req, ctx)
        try:
            await self._replay(req, ctx, offsets)
            if req.outcome is None:
                if req.done is None:
                    req.done = asyncio.get_running_loop().create_future()
                await asyncio.wait([req.done])
        except asyncio.CancelledError:
            if self._holds(req, ctx):
                # This call was cancelled, not its connection lost (which would have
                # released the request first): the call attached to is cancelled with it.
                self._cancel(req)
            raise
        finally:
            if self._holds(req, ctx):
                self._release(req)
        outcome = req.outcome
        assert outcome is not None
        # An encoded result is answered as it is: no mapping made for one answer.
        return _expand(outcome if isinstance(outcome, bytes) else _compact(outcome)[0])

    def _claim(self, req: Request, ctx: CallContext) -> None:
        """The attach of ``ctx`` holds running request ``req`` from now until it ends.

        Done on receipt, in the attach's first step: whatever comes next on
        the connection (a Cancel right behind the attach) finds the request
        held. Its output goes to ``ctx`` once the replay has caught up
        (:meth:`_replay`); until then it is kept, up to the same cap as
        while unbound.
        """
        req.bound_to = ctx.connection_id
        req.sink = None
        if req.grace is not None:
            req.grace.cancel()
            req.grace = None

    def _holds(self, req: Request, ctx: CallContext) -> bool:
        """Whether the attach of ``ctx`` still holds ``req`` (it runs, and nobody took it)."""
        return req.outcome is None and req.bound_to == ctx.connection_id

    def _release(self, req: Request) -> None:
        """Nobody gets ``req``'s output any more: it runs on unbound, for its grace."""
        req.sink = None
        req.bound_to = None
        if req.outcome is None and req.grace is None:
            req.grace = asyncio.get_running_loop().call_later(self.grace, self._expire, req)

    async def _replay(self, req: Request, ctx: CallContext, offsets: dict[str, int]) -> None:
        """Send ``ctx`` the kept output of ``req`` from ``offsets`` on, and bind ``req`` to it.

        Every stream's lock is held meanwhile, so that no live send comes
        between the kept bytes and those that follow them.
        """
        held: dict[str, _Output] = {}
        try:
            while True:
                # A stream the handler opens while this waits for a lock is replayed too.
                streams = req.streams or {}
                missing = sorted(name for name in streams if name not in held)
                if not missing:
                    break
                for name in missing:
                    out = streams[name]
                    await out.lock.acquire()
                    held[name] = out
            if req.outcome is None:
                if not self._holds(req, ctx):
                    raise InvalidParams("the request was attached from another connection")
                self._bind(req, ctx)
            for name, out in sorted(held.items()):
                data = out.since(offsets.get(name, 0))
                if data or out.ended:
                    await ctx.send(name, data, end=out.ended)
        finally:
            for out in held.values():
                out.lock.release()

    def _bind(self, req: Request, ctx: CallContext) -> None:
        req.sink = ctx
        waiter = req.attached
        if waiter is not None:
            req.attached = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait_attached(self, req: Request) -> None:
        """Wait until a client attaches to ``req`` (its output is at its cap meanwhile)."""
        if req.attached is None:
            req.attached = asyncio.get_running_loop().create_future()
        await asyncio.wait([req.attached])

    def _not_known(
        self, rid: bytes, reason: api.NotKnownReason, *, seen: bool = False
    ) -> RequestNotKnown:
        what = "was evicted from the retention window" if reason == "evicted" else "is not known"
        data = api.NotKnown(reason=reason, rid=rid.hex(), seen=seen)
        return RequestNotKnown(f"request {rid.hex()} {what}", msgspec.to_builtins(data))


def _tail(chunks: Iterable[bytes], base: int, offset: int) -> bytes:
    """Of the kept ``chunks`` (from byte ``base`` of a stream), the bytes from ``offset`` on."""
    data = b"".join(chunks)
    return data[max(0, offset - base) :]


def _output_size(streams: tuple[KeptStream, ...]) -> int:
    return sum(len(chunk) for _, _, chunks, _ in streams for chunk in chunks)


def _check_offsets(bases: list[tuple[str, int]], offsets: dict[str, int]) -> None:
    """STREAM_ERROR when the client asks for a stream's bytes from before its first kept byte.

    A stream the client names no offset for is asked for from its start.
    """
    for name, base in bases:
        offset = offsets.get(name, 0)
        if offset < base:
            raise StreamError(
                f"output of stream {name!r} before byte {base} is no longer kept",
                {"stream": name, "offset": offset, "kept_from": base},
            )


def _compact(outcome: Outcome) -> tuple[Kept, int]:
    """``outcome`` as the retention window keeps it, and the bytes that costs."""
    if isinstance(outcome, bytes):
        if len(outcome) >= MAPPED_MIN:
            return _mapped(outcome), len(outcome)
        return outcome, len(outcome)
    data = b"" if outcome.data is None else bytes(to_raw(outcome.data))
    return (int(outcome.code), outcome.message, data), len(outcome.message) + 64


def _mapped(data: bytes) -> mmap.mmap:
    """A copy of ``data`` in an anonymous mapping of its own, unmapped once dropped.

    A kept result outlives the buffers its call allocated around it (the
    decoded params, the frames), which are freed as the call ends. On the C
    heap, large kept results and those freed buffers interleave, and the
    holes between results stay resident: a 64 MiB window of 64 KiB results
    made a process resident 96 MiB over its start (70 MiB without the
    transient buffers, 72 MiB with every such buffer mapped on its own). A
    mapping of its own holds the result's pages only, and gives them back
    when the window lets it go; it costs a mapping, a copy and a page fault
    per page (some 10 us for 64 KiB here), once per large result.
    """
    import mmap

    mapped = mmap.mmap(-1, len(data))
    mapped.write(data)
    return mapped


def _expand(kept: Kept) -> msgspec.Raw:
    """The kept outcome as the attaching call's answer: its result, or its error raised."""
    if not isinstance(kept, tuple):
        return msgspec.Raw(kept)
    code, message, data = kept
    error = ExecdError(message, msgspec.Raw(data) if data else None)
    error.code = ErrorCode(code)  # type: ignore[misc]  # this instance's code
    raise error


async def _run_callbacks(callbacks: list[Callback]) -> None:
    for callback in callbacks:
        try:
            result = callback()
            if result is not None:
                await result
        except Exception:
            log.exception("a request's close callback failed")
