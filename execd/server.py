"""execd's network layer: accept, authenticate, dispatch calls to handlers.

Theory of operation
-------------------
Each accepted socket gets a :class:`ServerProtocol` (an asyncio protocol over
:class:`~protocol.connection.ServerConnection`). Until the handshake completes
the connection counts as unauthenticated: it must finish within
``Limits.handshake_timeout``, and at most ``Limits.max_unauthenticated`` are
pending at once. A newcomer that finds those slots (or all
``Limits.max_connections``) taken is not refused while unauthenticated
connections hold them: the oldest of those is shed instead (one that has
sent nothing yet first), with CONNECTION_LIMIT, so idle or slow peers can
delay a real client by a handshake at most, never lock it out. Since
unauthenticated connections never hold more than their own slots, the rest
stay free for authenticated ones.

Every Call becomes one asyncio task running the handler from the dispatch
table. The handler's return value becomes the Reply; an
:class:`~execd.errors.ExecdError` becomes an Error reply with its code; any
other exception is logged and answered with INTERNAL. A Cancel cancels the
task, which is answered with CANCELLED. When the connection closes, every
task it started is cancelled and the ``on_close`` callbacks registered by
handlers run (they kill non-detached commands, drop watches, ...).

The call's context hears how it ended (``running``, ``finished``,
``cancelled``): a plain call's context ignores that. A call with a request
id is handed to :meth:`execd.requests.RequestTable.dispatch` first, which
may give it a context of its own that keeps its outcome, or run an attach
in its place; that module is the whole of request tracking, and the
dispatch here is the same for every call.

Every answer fits the client's frame cap: a result that does not fit is
answered with TOO_LARGE (handlers whose results grow with data fit them
themselves, see :mod:`execd.fit`), and an error is cut until it fits. Params
nested deeper than ``MAX_NESTING - 1`` levels (PROTOCOL.md section 3, held by
:func:`protocol.codec.decode_payload`) are INVALID_PARAMS, like any other bad
params.

The :class:`Server` also keeps the lease: with ``--lease`` set, execd
shuts down (the path that cleans up by marker) once no authenticated client
has been heard from for that long -- no authenticated connection at all, or
only connections that stay silent (a harness that vanished without closing
TCP). Any frame from an authenticated client holds the lease; the client's
keepalive pings hold it while the harness lives. One timer, re-armed for the
moment the lease would run out, checks it.

Liveness. A peer that vanished without a FIN or RST (a blackholed route, a
machine that lost power) leaves its connection open on execd's side for
good: TCP only notices when it has something unacknowledged to send. So one
timer sweeps the authenticated connections every quarter of
``Limits.idle_timeout``: a connection execd has heard nothing from for half
of it gets a ping (the peer MUST answer, PROTOCOL.md section 11, whatever
else it is doing), and one that stays silent for the whole of it is given up:
aborted without waiting for its buffered output, so its descriptor and its
calls are released as for a reset (calls with a request id keep their grace).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from execd import calls
from execd.config import Config
from execd.context import ConnectionLost, Method
from execd.errors import (
    Cancelled,
    ExecdError,
    InternalError,
    InvalidParams,
    TooLarge,
    UnknownMethod,
)
from execd.memory import Trimmer
from execd.requests import Dispatched, RequestTable
from protocol import limits
from protocol.bridge import FramedProtocol
from protocol.codec import ENCODER, NestingTooDeep, decode_payload, to_raw
from protocol.connection import ConnectionEvent, HandshakeComplete, ServerConnection
from protocol.errors import ErrorCode, LocalProtocolError
from protocol.messages import Abort, Call, Cancel, Error, Event, Ping, Pong, Reply

log = logging.getLogger("execd.server")

_connection_ids = itertools.count(1)
_NIL = msgspec.Raw(b"\xc0")
#: Characters of an error message kept when the whole error does not fit a frame.
_SHORT_MESSAGE = 256
#: Seconds between two log lines about shed connections.
_SHED_LOG_INTERVAL = 5.0


class _CallContext:
    """The CallContext handed to one handler invocation."""

    __slots__ = ("_call_id", "_proto")

    def __init__(self, proto: ServerProtocol, call_id: int) -> None:
        self._proto = proto
        self._call_id = call_id

    @property
    def call_id(self) -> int:
        return self._call_id

    @property
    def connection_id(self) -> int:
        return self._proto.connection_id

    @property
    def max_chunk(self) -> int:
        return self._proto.conn.max_chunk

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        await self._proto.send_stream(self._call_id, stream, data, end=end)

    def receive(self, stream: str) -> AsyncIterator[bytes]:
        return self._proto.stream(self._call_id, stream).chunks()

    async def push_event(self, topic: int, name: str, data: Any) -> None:
        proto = self._proto
        raw = to_raw(data)
        if len(raw) + limits.CHUNK_OVERHEAD > proto.conn.peer_max_frame:
            raise TooLarge(
                f"event {name!r} of {len(raw)} bytes does not fit the client's frame cap",
                {"size": len(raw), "limit": proto.conn.peer_max_frame - limits.CHUNK_OVERHEAD},
            )
        proto.send(Event(topic=topic, name=name, data=raw))
        await proto.drain()

    def on_close(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        self._proto.add_close_callback(callback)

    # The call's fate: nothing to keep for a plain call (a call with a request id is run
    # with execd.requests.TrackedCall instead, whose hooks keep its outcome).

    def running(self) -> None:
        pass

    def finished(self, outcome: bytes | ExecdError) -> None:
        pass

    def cancelled(self) -> None:
        pass

    def upload_lost(self) -> ExecdError | None:
        return None  # lost with its connection, like every call of it


def _bind_literal(host: str, port: int) -> socket.socket | None:
    """A socket bound to ``host`` when it is an IP address, as ``create_server`` binds one.

    None for a host name (and for an IPv6 address with a scope), which
    ``create_server`` resolves. An address needs no resolving, and the
    resolver's IDNA codec would be imported for it: about a millisecond of
    execd's start.
    """
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
        except BaseException:
            sock.close()
            raise
        return sock
    return None


class ServerProtocol(FramedProtocol):
    """One client connection to execd."""

    def __init__(self, server: Server) -> None:
        cfg = server.config
        conn = ServerConnection(
            server.token,
            max_frame=cfg.limits.max_frame,
            window=cfg.limits.stream_window,
            max_inflight=cfg.limits.max_inflight_calls,
            info={"pid": server.pid, "marker": cfg.marker, "marker_var": cfg.marker_var},
        )
        super().__init__(
            conn, max_inbound_buffer=4 * cfg.limits.stream_window + cfg.limits.max_frame
        )
        self.server = server
        #: The connection as the serving side's (``conn`` is typed as the base).
        self.server_conn = conn
        self.connection_id = next(_connection_ids)
        self.authenticated = False
        self.connected_at = time.monotonic()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._close_callbacks: list[Callable[[], Awaitable[None] | None]] = []
        self._deadline: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self._pings = 0
        #: ``last_received`` when execd last pinged this connection for liveness.
        self.liveness_ping_for = -1.0
        #: What the request table pings this connection with (bound once: it goes by often).
        self._receipt_ping = self.ping
        #: Largest encoded result that fits one reply frame to this client (known once
        #: the handshake has set the client's frame cap; no call comes before).
        self.max_result = 0

    # -- lifecycle -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self.server.admit(self):
            self.abort(None, code=ErrorCode.CONNECTION_LIMIT, message="too many connections")
            return
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(
            self.server.config.limits.handshake_timeout, self._handshake_expired
        )

    def _handshake_expired(self) -> None:
        if not self.authenticated and not self.closed:
            log.info("connection %d: handshake timed out", self.connection_id)
            limit = self.server.config.limits.handshake_timeout
            message = f"the handshake did not complete within {limit:g} s"
            self.abort(None, code=ErrorCode.HANDSHAKE_TIMEOUT, message=message)

    def handle_closed(self, reason: BaseException | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        # Calls with a request id live on for their grace period (execd.requests).
        survivors = self.server.requests.connection_closed(self.connection_id, self._tasks)
        for call_id, task in self._tasks.items():
            if call_id not in survivors:
                task.cancel()
        self._tasks.clear()
        callbacks, self._close_callbacks = self._close_callbacks, []
        self.server.release(self)
        if callbacks:
            self.server.spawn_background(self._run_close_callbacks(callbacks))
        if reason is not None:
            log.info("connection %d closed: %s", self.connection_id, reason)

    async def _run_close_callbacks(
        self, callbacks: list[Callable[[], Awaitable[None] | None]]
    ) -> None:
        for callback in callbacks:
            try:
                result = callback()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("connection %d: close callback failed", self.connection_id)

    def add_close_callback(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        """Run ``callback`` once this connection closes (at once if it already has)."""
        if self.closed:
            self.server.spawn_background(self._run_close_callbacks([callback]))
        else:
            self._close_callbacks.append(callback)

    def give_up(self, message: str) -> None:
        """Close a connection whose peer is gone, dropping what it still buffers."""
        self.abort(None, code=ErrorCode.GOING_AWAY, message=message)
        if self.transport is not None:
            self.transport.abort()  # a close would wait for a peer that never acknowledges

    # -- events --------------------------------------------------------------

    def handle_event(self, event: ConnectionEvent) -> None:
        if isinstance(event, Call):
            self._start_call(event)
        elif isinstance(event, Cancel):
            task = self._tasks.get(event.id)
            if task is not None:
                task.cancel()
                # A task cancelled before its first step never runs its handler's
                # except clauses (a Cancel right behind its Call): answer for it.
                task.add_done_callback(functools.partial(self._cancelled, event.id))
        elif isinstance(event, HandshakeComplete):
            self.authenticated = True
            self.max_result = self.conn.max_chunk + limits.CHUNK_OVERHEAD - limits.REPLY_OVERHEAD
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self.server.authenticated(self)
            self.server.requests.connection_opened(self.conn.server_nonce)
        elif isinstance(event, Pong):
            self.server.requests.pong(self.connection_id, event.seq, self._receipt_ping)
        elif isinstance(event, Abort):
            self.abort(None)

    def ping(self) -> int | None:
        """Ping the client: its pong proves it alive, and that it received what came before.

        The ping's seq; None when the connection is gone. The request table
        (:mod:`execd.requests`) pings for proof of receipt, the server's
        liveness sweep for a sign of life.
        """
        if self.closed:
            return None
        self._pings += 1
        try:
            self.send(Ping(seq=self._pings))
        except ConnectionLost:
            return None
        return self._pings

    def _cancelled(self, call_id: int, task: asyncio.Task[None]) -> None:
        if self._tasks.get(call_id) is task:
            del self._tasks[call_id]
            if not self.closed:
                self._answer_error(call_id, Cancelled(f"{task.get_name()} was cancelled"))

    def _start_call(self, call: Call) -> None:
        server = self.server
        try:
            method = server.methods[call.method]
        except KeyError:
            self._answer_error(call.id, UnknownMethod(f"unknown method {call.method[:128]!r}"))
            return
        params: Any
        try:
            params = decode_payload(server.decoders[method.params], call.params)
        except msgspec.DecodeError as exc:
            if isinstance(exc, NestingTooDeep):
                log.info(
                    "connection %d: params of %s nested too deeply", self.connection_id, method.name
                )
            self._answer_error(call.id, InvalidParams(f"invalid params for {method.name}: {exc}"))
            return
        ctx: Dispatched = _CallContext(self, call.id)
        if call.rid is not None:
            method, ctx = server.requests.dispatch(method, ctx, call.rid)
        # Named for the method: a fixed string costs nothing, a numbered name would.
        task = calls.start(
            self._loop, self._run(call.id, method, params, ctx), method.name, method.direct
        )
        if task is not None:
            self._tasks[call.id] = task
            ctx.running()

    async def _run(self, call_id: int, method: Method, params: Any, ctx: Dispatched) -> None:
        """Run one call's handler and answer it; ``ctx`` hears how the call ended."""
        try:
            error: ExecdError | None
            try:
                result = await method.handler(params, ctx)
                encoded = ENCODER.encode(result)
                del result  # a large result is held once (as its encoding), not twice
            except asyncio.CancelledError:
                self._tasks.pop(call_id, None)
                ctx.cancelled()
                if not self.closed:
                    self._answer_error(call_id, Cancelled(f"{method.name} was cancelled"))
                raise
            except ExecdError as exc:
                error = exc
            except ConnectionLost:
                error = ctx.upload_lost()
            except Exception:
                log.exception("connection %d: %s failed", self.connection_id, method.name)
                error = InternalError(f"internal error in {method.name}")
            else:
                self._tasks.pop(call_id, None)
                # The answer first, the books after: keeping the outcome is not on the
                # caller's path (nothing else runs in between, so a copy of the call
                # still finds its outcome kept).
                try:
                    if not self.closed:
                        self._reply(call_id, method, msgspec.Raw(encoded))
                finally:
                    ctx.finished(encoded)
                return
            self._tasks.pop(call_id, None)
            if error is not None:
                try:
                    self._answer_error(call_id, error)
                finally:
                    ctx.finished(error)
        finally:
            # Large buffers the call held are free now: look at the heap in a moment.
            self.server.trimmer.activity()
            self.server.requests.answered(self.connection_id, self._receipt_ping)

    def _reply(self, call_id: int, method: Method, payload: msgspec.Raw) -> None:
        budget = self.max_result
        if len(payload) > budget:
            log.info(
                "connection %d: result of %s (%d bytes) exceeds the client's frame cap",
                self.connection_id,
                method.name,
                len(payload),
            )
            self._answer_error(
                call_id,
                TooLarge(
                    f"the result of {method.name} takes {len(payload)} bytes, more than fit "
                    f"one reply frame to this client ({budget})",
                    {"size": len(payload), "limit": budget},
                ),
            )
            return
        self._send_final(Reply(id=call_id, result=payload), call_id)

    def _answer_error(self, call_id: int, exc: ExecdError) -> None:
        if self.closed:
            return
        try:
            data = to_raw(exc.data) if exc.data is not None else _NIL
        except (TypeError, msgspec.EncodeError):
            data = _NIL
        message = exc.message[: limits.MAX_ERROR_MESSAGE]
        code = int(exc.code)
        if len(message.encode("utf-8", "replace")) + len(data) > self.max_result:
            # Cut to what a frame takes: the code always gets through.
            message, data = message[:_SHORT_MESSAGE], _NIL
        self._send_final(Error(id=call_id, code=code, message=message, data=data), call_id)

    def _send_final(self, message: Reply | Error, call_id: int) -> None:
        try:
            self.send(message)
        except ConnectionLost:
            pass  # every call of a closed connection is lost (PROTOCOL.md 8)
        except LocalProtocolError as exc:
            log.error(
                "connection %d: cannot send answer to call %d: %s", self.connection_id, call_id, exc
            )


class _Decoders(dict[type, msgspec.msgpack.Decoder[Any]]):
    """Params decoders by params type: a lookup of a type not seen yet makes its decoder."""

    def __missing__(self, params: type) -> msgspec.msgpack.Decoder[Any]:
        decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(params)
        self[params] = decoder
        return decoder


class Server:
    """The listening side of execd: admission limits, the lease, the dispatch table."""

    def __init__(
        self,
        config: Config,
        token: bytes,
        methods: dict[str, Method],
        requests: RequestTable | None = None,
    ) -> None:
        self.config = config
        self.token = token
        self.methods = methods
        self.requests = requests if requests is not None else RequestTable(config.limits)
        self.requests.abort_connection = self.abort_connection
        self.pid = os.getpid()
        # Insertion-ordered: the oldest unauthenticated connection comes first.
        self._unauthenticated: dict[ServerProtocol, None] = {}
        self._authenticated: set[ServerProtocol] = set()
        self._shed_count = 0
        self._shed_logged = -_SHED_LOG_INTERVAL
        self.trimmer = Trimmer()
        self._background: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self._lease_timer: asyncio.TimerHandle | None = None
        self._liveness_timer: asyncio.TimerHandle | None = None
        self._lease_since = time.monotonic()
        self.stopping = asyncio.Event()
        self.host = config.host
        self.port = config.port
        #: Params decoders by params type, each made on first use and kept.
        self.decoders = _Decoders()

    async def start(self) -> None:
        """Bind and listen; afterwards ``self.port`` is the port the kernel picked."""
        loop = asyncio.get_running_loop()
        bound = _bind_literal(self.config.host, self.config.port)
        if bound is not None:
            try:
                self._server = await loop.create_server(
                    lambda: ServerProtocol(self), sock=bound, backlog=1024
                )
            except BaseException:
                bound.close()
                raise
        else:
            self._server = await loop.create_server(
                lambda: ServerProtocol(self),
                host=self.config.host,
                port=self.config.port,
                reuse_address=True,
                backlog=1024,
            )
        sock = self._server.sockets[0]
        self.host, self.port = sock.getsockname()[:2]
        self.trimmer.start()
        self._arm_lease()
        self._sweep_silent()

    def admit(self, proto: ServerProtocol) -> bool:
        """Count a new connection in, shedding an unauthenticated one if need be.

        False only when every slot is held by an authenticated connection.
        """
        lim = self.config.limits
        unauthenticated = self._unauthenticated
        while unauthenticated and (
            len(unauthenticated) >= lim.max_unauthenticated
            or len(unauthenticated) + len(self._authenticated) >= lim.max_connections
        ):
            self._shed(self._oldest_unauthenticated())
        if len(self._authenticated) >= lim.max_connections:
            log.warning("connection limit reached (%d authenticated)", len(self._authenticated))
            return False
        unauthenticated[proto] = None
        return True

    def _oldest_unauthenticated(self) -> ServerProtocol:
        """The oldest connection that has sent nothing yet, else the oldest of all."""
        for proto in self._unauthenticated:
            if proto.last_received <= proto.connected_at:
                return proto
        return next(iter(self._unauthenticated))

    def _shed(self, proto: ServerProtocol) -> None:
        self._unauthenticated.pop(proto, None)
        self._shed_count += 1
        now = time.monotonic()
        if now - self._shed_logged >= _SHED_LOG_INTERVAL:
            log.warning(
                "unauthenticated connections at their limit (%d): shed %d oldest so far",
                self.config.limits.max_unauthenticated,
                self._shed_count,
            )
            self._shed_logged = now
        proto.abort(
            None,
            code=ErrorCode.CONNECTION_LIMIT,
            message="shed: too many connections waiting for their handshake",
        )

    def authenticated(self, proto: ServerProtocol) -> None:
        """A connection finished its handshake."""
        self._unauthenticated.pop(proto, None)
        self._authenticated.add(proto)

    def release(self, proto: ServerProtocol) -> None:
        """A connection closed."""
        self._unauthenticated.pop(proto, None)
        if proto in self._authenticated:
            self._authenticated.discard(proto)
            if not self._authenticated:
                self._lease_since = time.monotonic()

    def abort_connection(self, connection_id: int) -> None:
        """Close an authenticated connection by its id (a reattach has superseded it)."""
        for proto in list(self._authenticated):
            if proto.connection_id == connection_id:
                log.info("connection %d: superseded by a reattach; closing it", connection_id)
                proto.abort(None, code=ErrorCode.GOING_AWAY, message="superseded by a reattach")

    def spawn_background(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` as a task the server keeps a reference to."""

        async def runner() -> None:
            await coro

        task = asyncio.get_running_loop().create_task(runner())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _sweep_silent(self) -> None:
        """Ping authenticated connections silent for half the idle timeout; give up on those
        silent for all of it (see the module docstring). Re-arms itself."""
        idle = self.config.limits.idle_timeout
        now = time.monotonic()
        for proto in list(self._authenticated):
            heard = proto.last_received
            if now - heard >= idle:
                log.info(
                    "connection %d: nothing received for %.0f s; giving it up",
                    proto.connection_id,
                    now - heard,
                )
                proto.give_up(f"nothing received for {now - heard:.0f} s")
            elif now - heard >= idle / 2 and proto.liveness_ping_for != heard:
                proto.liveness_ping_for = heard
                proto.ping()
        if not self.stopping.is_set():
            loop = asyncio.get_running_loop()
            self._liveness_timer = loop.call_later(idle / 4, self._sweep_silent)

    def _arm_lease(self) -> None:
        if self.config.lease is None or self.stopping.is_set():
            return
        self._lease_since = time.monotonic()
        self._lease_check()

    def _lease_check(self) -> None:
        lease = self.config.lease
        assert lease is not None
        self._lease_timer = None
        if self.stopping.is_set():
            return
        heard = max((p.last_received for p in self._authenticated), default=self._lease_since)
        left = heard + lease - time.monotonic()
        if left > 0:
            self._lease_timer = asyncio.get_running_loop().call_later(left, self._lease_check)
            return
        if self._authenticated:
            log.warning(
                "lease expired: no frame from any authenticated client for %g s; shutting down",
                lease,
            )
        else:
            log.warning("lease expired with no authenticated connection; shutting down")
        self.stopping.set()

    async def close(self) -> None:
        """Stop listening, drop every connection, wait for background work."""
        if self._lease_timer is not None:
            self._lease_timer.cancel()
        if self._liveness_timer is not None:
            self._liveness_timer.cancel()
        self.trimmer.stop()
        if self._server is not None:
            self._server.close()
        for proto in [*self._unauthenticated, *self._authenticated]:
            proto.abort(None, code=ErrorCode.GOING_AWAY, message="execd is shutting down")
        self.requests.close()
        if self._background:
            await asyncio.wait(list(self._background), timeout=10)
