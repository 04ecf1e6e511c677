"""Request ids: calls that survive a lost connection and run at most once.

Theory of operation
-------------------
A call that carries a request id (``rid``, PROTOCOL.md section 8.1) is
registered by :meth:`RequestTable.track` as a :class:`Request`, the one
record of the call on this side: the dispatcher runs the method's handler
with the request as its context and hands the outcome (the encoded result,
or the error) to :meth:`RequestTable.finish` right after answering as usual
(nothing runs in between: a copy of the call finds the outcome kept).
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
output, the server pings the connection (one ping in flight per connection):
the peer answers pings in order with its other frames, so its pong proves
that it received every chunk sent before the ping, and those bytes are let
go (:meth:`RequestTable.received`); the outcome and the streams' offsets
stay. Without that, every finished large read would pin its blocks for as
long as the retention window keeps it (up to ``request_retention_bytes``),
and each read's blocks would land in fresh memory. Output of a call that is
still running is kept as above. A per-stream lock orders a live send
and the replay of an attach, so the attaching call sees the stream's bytes
exactly once and in order.

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
from dataclasses import dataclass, field
from typing import Any, Final

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

#: A finished call's outcome: its encoded result, or its error.
Outcome = bytes | ExecdError
#: An outcome kept compactly: the encoded result (None for an error), the error's code,
#: message and encoded data.
Kept = tuple[bytes | None, int, str, bytes]
#: One output stream of a finished call as kept: its name, the offset of its first kept
#: byte, the kept chunks, and whether it had ended.
KeptStream = tuple[str, int, tuple[bytes, ...], bool]
#: A finished call as the retention window keeps it: its outcome and its kept output, by
#: stream name. Tuples of bytes, ints and strings, which the garbage collector stops
#: tracking (the Request, its locks and buffers go), and which never change: letting
#: output go replaces the entry, so an attach replaying it keeps what it took.
Finished = tuple[Kept, tuple[KeptStream, ...]]
Callback = Callable[[], Awaitable[None] | None]


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


@dataclass(slots=True, eq=False, repr=False)
class Request:
    """One call known by its request id while it runs (finished, it is kept as :data:`Finished`).

    It is also the :class:`~execd.context.CallContext` its handler runs with:
    output goes through it into the request's own buffers (and on to the call
    bound to it), so it survives the connection the call came on.
    """

    table: RequestTable
    rid: bytes
    method: str
    origin_connection: int
    call_id: int
    virtual_id: int
    #: (connection id, call id) of the call that gets the answer; None while unbound.
    bound_to: tuple[int, int] | None
    #: The original call's context, once its task has started.
    origin: CallContext | None = field(default=None, init=False)
    #: That call's context (None until it has started).
    sink: CallContext | None = field(default=None, init=False)
    task: asyncio.Task[Any] | None = field(default=None, init=False)
    outcome: Outcome | None = field(default=None, init=False)
    done: asyncio.Future[None] | None = field(default=None, init=False)
    attached: asyncio.Future[None] | None = field(default=None, init=False)
    streams: dict[str, _Output] = field(default_factory=dict, init=False)
    grace: asyncio.TimerHandle | None = field(default=None, init=False)
    lost: bool = field(default=False, init=False)

    def output(self, stream: str) -> _Output:
        out = self.streams.get(stream)
        if out is None:
            out = self.streams[stream] = _Output()
        return out

    # -- the CallContext of the tracked call ----------------------------------------------

    @property
    def connection_id(self) -> int:
        # Not the connection's own: closing it must not stop what tracked calls started.
        # One per connection, so that a call can still name another by its call id
        # (shell.signal), and on_close runs once the connection is closed and every
        # tracked call it started has ended.
        return self.virtual_id

    @property
    def max_chunk(self) -> int:
        sink = self.sink or self.origin
        assert sink is not None
        return sink.max_chunk

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        out = self.output(stream)
        table = self.table
        while self.bound_to is None and out.size > table.detached_cap:
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

    async def receive(self, stream: str) -> AsyncIterator[bytes]:
        # Uploads come on the original call only; a lost connection ends them.
        origin = self.origin
        assert origin is not None
        async for data in origin.receive(stream):
            yield data

    async def push_event(self, topic: int, name: str, data: Any) -> None:
        origin = self.origin
        assert origin is not None
        await origin.push_event(topic, name, data)

    def on_close(self, callback: Callback) -> None:
        self.table.on_virtual_close(self.virtual_id, callback)


class RequestTable:
    """Every request id execd knows: running, kept, and recently evicted."""

    def __init__(self, limits: Limits) -> None:
        self.grace = limits.request_grace
        self.max_count = limits.request_retention
        self.max_bytes = limits.request_retention_bytes
        self.keep = limits.output_cap
        self.detached_cap = 2 * limits.output_cap
        self._running: dict[bytes, Request] = {}
        # rid -> (bytes it costs, the request or its compact outcome)
        self._finished: dict[bytes, tuple[int, Finished]] = {}
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
        #: Per connection: the ids of finished requests answered on it whose kept output
        #: waits for proof of receipt (empty, the server need not ask :meth:`ping_due`).
        #: Ids, not requests: an evicted request is not held on to by these lists.
        self.unproved: dict[int, list[bytes]] = {}
        # Per connection: the ids the ping in flight covers, with its seq.
        self._pinged: dict[int, tuple[int, list[bytes]]] = {}
        self.kept_bytes = 0
        self.evictions = 0
        #: Closes a connection by its id (set by the server).
        self.abort_connection: Callable[[int], None] = lambda _: None

    # -- the dispatcher's hooks ------------------------------------------------------

    def methods(self) -> list[Method]:
        return bind(self, api.RPCS)

    def track(
        self, rid: bytes, method: Method, connection_id: int, call_id: int
    ) -> tuple[Method, Request | None]:
        """What runs call ``call_id`` of ``method`` carrying request id ``rid``.

        The method to run, and the request to run it as (None: untracked).
        A new id is registered at once, before its handler runs: a connection
        that closes right behind the call must find it (and leave its task
        running). The dispatcher runs the handler with :meth:`started`'s
        context and hands the outcome to :meth:`finish`.
        """
        if method.name in api.CONNECTION_SCOPED:
            return method, None
        if rid in self._running or rid in self._finished or rid in self._evicted:
            return Method(method.rpc, functools.partial(self._again, rid)), None
        req = Request(
            self, rid, method.name, connection_id, call_id, -connection_id, (connection_id, call_id)
        )
        self._running[rid] = req
        return method, req

    def connection_opened(self, server_nonce: bytes) -> None:
        """An authenticated connection: remember its nonce (``request.attach``'s ``sent_on``)."""
        self._nonces[server_nonce] = None
        if len(self._nonces) > EVICTED_MEMORY * self.max_count:
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
        loop = asyncio.get_running_loop()
        # No receipt will come: what waited for one stays kept for an attach.
        self.unproved.pop(connection_id, None)
        self._pinged.pop(connection_id, None)
        for req in self._running.values():
            if req.origin_connection == connection_id:
                survivors.append(req.call_id)
                req.task = tasks.get(req.call_id)
            bound = req.bound_to
            if bound is not None and bound[0] == connection_id:
                req.sink = None
                req.bound_to = None
                if req.grace is None:
                    req.grace = loop.call_later(self.grace, self._expire, req)
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

    # -- running a tracked call --------------------------------------------------------

    def _lookup(self, rid: bytes) -> Request | Finished | None:
        req = self._running.get(rid)
        if req is not None:
            return req
        kept = self._finished.get(rid)
        return kept[1] if kept is not None else None

    async def _again(self, rid: bytes, params: Any, ctx: CallContext) -> Any:
        """A call with an id already known: attach to it (it never runs twice)."""
        found = self._lookup(rid)
        if found is None:
            raise self._not_known(rid, "evicted" if rid in self._evicted else "unknown")
        return await self._attach(rid, found, ctx, {})

    def started(self, req: Request, ctx: CallContext) -> Request:
        """The original call of ``req`` starts with ``ctx``; the context its handler gets."""
        req.origin = ctx
        bound = req.bound_to
        if bound is not None and bound[0] == req.origin_connection:
            req.sink = ctx
        return req

    def cancelled(self, req: Request) -> None:
        """The handler of ``req`` was cancelled: by its caller, or by a lost connection."""
        message = "cancelled: connection lost" if req.lost else f"{req.method} was cancelled"
        self.finish(req, Cancelled(message))

    def finish(self, req: Request, outcome: Outcome) -> None:
        """``req`` has its outcome: keep it in the retention window."""
        req.outcome = outcome
        rid = req.rid
        self._running.pop(rid, None)
        streams: tuple[KeptStream, ...] = ()
        output = 0
        if req.streams:  # most calls have none: spare them the generators
            streams, output = self._keep_output(req)
        req.task = req.sink = req.bound_to = req.origin = None
        if req.grace is not None:
            req.grace.cancel()
            req.grace = None
        if req.done is not None and not req.done.done():
            req.done.set_result(None)
        closed = self._closed_running
        if closed:
            virtual = req.virtual_id
            left = closed.get(virtual)
            if left == 1:
                del closed[virtual]
                self._virtual_closed(virtual)
            elif left is not None:
                closed[virtual] = left - 1
        kept, cost = _compact(outcome)
        size = output + ENTRY_OVERHEAD + cost
        finished = self._finished
        finished[rid] = (size, (kept, streams))
        self._finish_order.append(rid)
        self.kept_bytes += size
        if len(finished) > self.max_count or self.kept_bytes > self.max_bytes:
            self._evict()

    def _keep_output(self, req: Request) -> tuple[tuple[KeptStream, ...], int]:
        """The output ``req`` keeps once finished, and its size; if it is large and was
        answered on a connection, its receipt there is awaited to let it go."""
        streams = tuple(
            (name, out.base, tuple(out.chunks), out.ended)
            for name, out in sorted(req.streams.items())
        )
        output = sum(out.size for out in req.streams.values())
        bound = req.bound_to
        if bound is not None and req.sink is not None:
            self._await_receipt(req.rid, output, bound[0])
        return streams, output

    # -- proof of receipt --------------------------------------------------------------

    def _await_receipt(self, rid: bytes, output: int, connection_id: int) -> None:
        """Request ``rid`` (``output`` bytes kept) is answered on ``connection_id``: let its
        output go once received there."""
        if output >= RECEIPT_MIN:
            waiting = self.unproved.setdefault(connection_id, [])
            waiting.append(rid)
            if len(waiting) > self.max_count:
                # A peer that leaves pings unanswered: the oldest wait for eviction instead.
                del waiting[0]

    def ping_due(self, connection_id: int) -> bool:
        """Whether the server should ping ``connection_id`` now (see :meth:`pinged`)."""
        return connection_id in self.unproved and connection_id not in self._pinged

    def pinged(self, connection_id: int, seq: int) -> None:
        """The server sent ``ping(seq)`` on ``connection_id``, after every answer so far."""
        waiting = self.unproved.pop(connection_id, None)
        if waiting:
            self._pinged[connection_id] = (seq, waiting)

    def received(self, connection_id: int, seq: int) -> bool:
        """``pong(seq)`` came on ``connection_id``; True when another ping is due.

        The peer received every frame sent before that ping: the kept output
        of the requests answered before it goes (their outcomes stay).
        """
        pinged = self._pinged.get(connection_id)
        if pinged is None or pinged[0] != seq:
            return False  # not ours, or not the latest
        del self._pinged[connection_id]
        finished = self._finished
        for rid in pinged[1]:
            kept = finished.get(rid)
            if kept is None:
                continue  # evicted meanwhile
            size, (outcome, streams) = kept
            released = _output_size(streams)
            left = tuple(
                (name, base + sum(map(len, chunks)), (), ended)
                for name, base, chunks, ended in streams
            )
            finished[rid] = (size - released, (outcome, left))
            self.kept_bytes -= released
        return connection_id in self.unproved

    def _evict(self) -> None:
        finished, order = self._finished, self._finish_order
        evicted, evicted_order = self._evicted, self._evicted_order
        max_count, max_bytes = self.max_count, self.max_bytes
        remembered = EVICTED_MEMORY * max_count
        while order and (len(order) > max_count or self.kept_bytes > max_bytes):
            rid = order.popleft()
            self.kept_bytes -= finished.pop(rid)[0]
            self.evictions += 1
            evicted.add(rid)
            evicted_order.append(rid)
            if len(evicted_order) > remembered:
                evicted.discard(evicted_order.popleft())

    def _expire(self, req: Request) -> None:
        req.grace = None
        if req.outcome is not None or req.bound_to is not None:
            return
        log.info("%s: no reattach within %g s; cancelling it", req.method, self.grace)
        req.lost = True
        if req.task is not None:
            req.task.cancel()
        elif req.origin is None:
            # Its task was cancelled before it ever ran (a Cancel right behind the call).
            self.finish(req, Cancelled("cancelled: connection lost"))

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
            kept, streams = found
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
            if bound[0] == ctx.connection_id:
                raise InvalidParams("the request is in flight on this connection already")
            if bound[0] > ctx.connection_id:
                # A copy of the call from an older connection, processed late: the newer
                # connection keeps the request.
                raise InvalidParams("the request is attached from a newer connection")
            # The client gave that connection up: close it, and the request moves here.
            self.abort_connection(bound[0])
            self._unbind(req)
        _check_offsets([(name, out.base) for name, out in req.streams.items()], offsets)
        try:
            await self._replay(req, ctx, offsets)
            if req.outcome is None:
                if req.done is None:
                    req.done = asyncio.get_running_loop().create_future()
                try:
                    await asyncio.wait([req.done])
                except asyncio.CancelledError:
                    if req.sink is ctx and req.task is not None:
                        req.task.cancel()  # this call was cancelled, not its connection lost
                    raise
        finally:
            if req.sink is ctx:
                self._unbind(req)
        assert req.outcome is not None
        return _expand(_compact(req.outcome)[0])

    async def _replay(self, req: Request, ctx: CallContext, offsets: dict[str, int]) -> None:
        """Bind ``req`` to ``ctx`` and send it the kept output from ``offsets`` on."""
        outputs = sorted(req.streams.items())
        for _, out in outputs:
            await out.lock.acquire()
        try:
            self._bind(req, ctx)
            for name, out in outputs:
                data = out.since(offsets.get(name, 0))
                if data or out.ended:
                    await ctx.send(name, data, end=out.ended)
        finally:
            for _, out in outputs:
                out.lock.release()

    def _bind(self, req: Request, ctx: CallContext) -> None:
        req.bound_to = (ctx.connection_id, ctx.call_id)
        req.sink = ctx
        if req.grace is not None:
            req.grace.cancel()
            req.grace = None
        waiter = req.attached
        if waiter is not None:
            req.attached = None
            if not waiter.done():
                waiter.set_result(None)

    def _unbind(self, req: Request) -> None:
        req.sink = None
        req.bound_to = None

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
    if isinstance(outcome, ExecdError):
        data = b"" if outcome.data is None else bytes(to_raw(outcome.data))
        return (None, int(outcome.code), outcome.message, data), len(outcome.message) + 64
    return (outcome, 0, "", b""), len(outcome)


def _expand(kept: Kept) -> msgspec.Raw:
    """The kept outcome as the attaching call's answer: its result, or its error raised."""
    payload, code, message, data = kept
    if payload is not None:
        return msgspec.Raw(payload)
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
