"""The asyncio glue in process: client, bridge and execd's dispatch over an in-memory transport.

No socket and no subprocess: :mod:`tests.support.memory_transport` joins a
real :class:`~harnessd.client.ClientProtocol` to a real
:class:`~execd.server.ServerProtocol` serving a small dispatch table, so
sending, flow control, backpressure, cancellation, events and loss of the
connection are exercised on the glue itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from execd.config import Config, Limits
from execd.context import CallContext, Method, bind
from execd.requests import RequestTable
from execd.server import Server, ServerProtocol
from harnessd.api import ExecdClient
from harnessd.client import ClientProtocol
from harnessd.errors import ConnectionLost, ProtocolViolation, UnknownMethod
from protocol import limits
from protocol.bridge import HOLD_FRAMES
from protocol.connection import ClientConnection
from protocol.errors import ErrorCode
from protocol.framing import FrameReader
from protocol.rpc import Rpc, Schema, core
from tests.conftest import eventually
from tests.support.memory_transport import MemoryTransport, connect_pair

pytestmark = pytest.mark.anyio

TOKEN = b"\x17" * 32
WINDOW = 16 * 1024


class Size(Schema):
    size: int = 0


class Topic(Schema):
    topic: int
    count: int


DOWNLOAD = Rpc("test.download", Size, int)
UPLOAD = Rpc("test.upload", Size, int)
HANG = Rpc("test.hang", Size, type(None))
PUSH = Rpc("test.push", Topic, int)


@dataclass
class Handlers:
    """A small dispatch table, with what its handlers saw."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    send_failed: list[BaseException] = field(default_factory=list)

    async def server_noop(self, params: core.NoParams, ctx: CallContext) -> None:
        return None

    async def server_echo(self, params: core.EchoParams, ctx: CallContext) -> bytes:
        return params.data

    async def test_download(self, params: Size, ctx: CallContext) -> int:
        await ctx.send("data", b"d" * params.size, end=True)
        return params.size

    async def test_upload(self, params: Size, ctx: CallContext) -> int:
        return sum([len(data) async for data in ctx.receive("data")])

    async def test_hang(self, params: Size, ctx: CallContext) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def test_push(self, params: Topic, ctx: CallContext) -> int:
        for n in range(params.count):
            await ctx.push_event(params.topic, "tick", {"n": n})
        return params.topic

    def table(self) -> dict[str, Method]:
        # The no-op as execd marks it: its first step may run outside a task (3.11).
        methods = bind(self, [core.NOOP, core.ECHO, DOWNLOAD, UPLOAD, HANG, PUSH], [core.NOOP])
        return {method.name: method for method in methods}


@dataclass
class Wired:
    client: ExecdClient
    server: ServerProtocol
    handlers: Handlers
    to_server: MemoryTransport
    to_client: MemoryTransport


async def wire(
    *, high: int = 256 * 1024, cipher: str = "none", grace: float = 0.2, reattach_within: float = 0
) -> Wired:
    handlers = Handlers()
    # Calls carry request ids, so a handler outlives a lost connection by the grace: keep it short.
    config = Config(
        marker="m",
        limits=Limits(stream_window=WINDOW, max_frame=64 * 1024, request_grace=grace),
    )
    requests = RequestTable(config.limits)
    methods = handlers.table() | {method.name: method for method in requests.methods()}
    server = ServerProtocol(Server(config, TOKEN, methods, requests))
    client, to_server, to_client = await dial(
        server, high=high, cipher=cipher, reattach_within=reattach_within
    )
    return Wired(client, server, handlers, to_server, to_client)


async def dial(
    server: ServerProtocol,
    *,
    high: int = 256 * 1024,
    cipher: str = "none",
    reattach_within: float = 0,
) -> tuple[ExecdClient, MemoryTransport, MemoryTransport]:
    """A client of ``server`` over a fresh in-memory connection to it."""
    conn = ClientConnection(TOKEN, window=WINDOW, max_frame=64 * 1024, ciphers=(cipher,))
    proto = ClientProtocol(conn)
    to_server, to_client = connect_pair(proto, server, high=high, piece=5000)
    info = await proto.ready
    client = ExecdClient(proto, info, None, reattach_within=reattach_within)
    return client, to_server, to_client


@pytest.fixture(params=["none", "chacha20-poly1305"])
async def wired(request: pytest.FixtureRequest) -> AsyncIterator[Wired]:
    pair = await wire(cipher=request.param)
    try:
        yield pair
    finally:
        await pair.client.close()


async def test_calls_round_trip(wired: Wired) -> None:
    await wired.client.noop()
    assert await wired.client.echo(b"hi") == b"hi"
    assert await wired.client.call(core.ECHO, core.EchoParams(data=b"x" * 40_000)) == b"x" * 40_000


async def test_a_download_beyond_the_window_waits_for_credit(wired: Wired) -> None:
    size = 10 * WINDOW + 7
    handle = wired.client.start(DOWNLOAD, Size(size=size))
    received = b"".join([data async for data in handle.stream("data")])
    assert received == b"d" * size
    assert await handle.result() == size
    assert wired.server.server_conn.open_calls == 0 and wired.server._streams == {}


async def test_an_upload_beyond_the_window_waits_for_credit(wired: Wired) -> None:
    size = 10 * WINDOW + 3
    handle = wired.client.start(UPLOAD, Size())
    await handle.send("data", b"u" * size, end=True)
    assert await handle.result() == size


async def test_a_slow_transport_pauses_the_sender() -> None:
    wired = await wire(high=4096)
    try:
        handle = wired.client.start(DOWNLOAD, Size(size=20 * WINDOW))
        assert len(b"".join([data async for data in handle.stream("data")])) == 20 * WINDOW
        assert await handle.result() == 20 * WINDOW
        assert wired.to_client.pauses > 0
    finally:
        await wired.client.close()


async def test_cancelling_the_caller_cancels_the_handler(wired: Wired) -> None:
    task = asyncio.create_task(wired.client.call(HANG, Size()))
    await wired.handlers.started.wait()
    task.cancel()
    await wired.handlers.cancelled.wait()
    with pytest.raises(asyncio.CancelledError):
        await task
    # execd still answers the cancelled call (CANCELLED); then nothing is in flight.
    await eventually(lambda: wired.server.server_conn.open_calls == 0)
    await eventually(lambda: wired.client._proto.client_conn.pending_calls == 0)


async def test_events_reach_their_subscription(wired: Wired) -> None:
    queue = wired.client.subscribe(7)
    assert await wired.client.call(PUSH, Topic(topic=7, count=3)) == 7
    events = [queue.get_nowait() for _ in range(3)]
    assert [event.name if event else None for event in events] == ["tick"] * 3


async def test_an_unknown_method_is_an_error_for_that_call_only(wired: Wired) -> None:
    with pytest.raises(UnknownMethod):
        await wired.client.call("no.such")
    await wired.client.noop()


async def test_losing_the_connection_fails_calls_and_handlers_alike(wired: Wired) -> None:
    task = asyncio.create_task(wired.client.call(HANG, Size()))
    await wired.handlers.started.wait()
    wired.server.abort(None, code=ErrorCode.GOING_AWAY)
    with pytest.raises(ConnectionLost):
        await task
    await wired.handlers.cancelled.wait()
    assert wired.client.closed
    with pytest.raises(ConnectionLost):
        await wired.client.noop()
    with pytest.raises(ConnectionLost):
        await wired.server.send_stream(1, "data", b"x", end=True)


async def test_garbage_from_the_client_closes_with_a_protocol_error(wired: Wired) -> None:
    task = asyncio.create_task(wired.client.call(HANG, Size()))
    await wired.handlers.started.wait()
    wired.to_server.write(b"\x00\x00\x00\x01\xc1")
    with pytest.raises((ProtocolViolation, ConnectionLost)):
        await task
    await eventually(lambda: wired.server.closed and wired.client.closed)


async def test_a_stream_of_a_finished_call_ends_at_once(wired: Wired) -> None:
    handle = wired.client.start(DOWNLOAD, Size(size=10))
    assert await handle.result() == 10
    late: list[Any] = [data async for data in handle.stream("never-bound")]
    assert late == []


async def test_a_call_made_alone_is_answered_at_once_and_a_batch_in_one_write() -> None:
    """The answer to a lone call is written before its handling returns (its books come
    after it); the answers to calls that arrive together leave in one write after them."""
    pair = await wire()
    log: list[str] = []
    server, out = pair.server, pair.to_client
    # The memory transport's writelines() is asyncio's: one write() of the joined frames.
    handle, write = server.handle_event, out.write

    def handled(event: Any) -> None:
        handle(event)
        log.append("handled")

    def wrote(data: Any) -> None:
        log.append("write")
        write(data)

    server.handle_event = handled  # type: ignore[method-assign]
    out.write = wrote  # type: ignore[method-assign]
    try:
        await pair.client.noop()
        assert log == ["write", "handled"]
        log.clear()
        # Three calls sent in one round: the first goes out at once, the other two
        # together (one write, so one read at the server): answered in one write.
        await asyncio.gather(pair.client.noop(), pair.client.noop(), pair.client.noop())
        assert log == ["write", "handled", "handled", "handled", "write"]
    finally:
        await pair.client.close()


async def test_a_large_batch_leaves_in_parts_so_the_peer_starts_on_the_first() -> None:
    """Calls sent in one round leave HOLD_FRAMES at a time (the first at once), and the
    answers to one read's calls likewise: the peer works on a part while the next is made."""
    pair = await wire()
    sent: list[int] = []
    answered: list[int] = []

    def counting(transport: MemoryTransport, log: list[int]) -> None:
        write = transport.write

        def wrote(data: Any) -> None:
            log.append(_frames_in(bytes(data)))
            write(data)

        transport.write = wrote  # type: ignore[method-assign]

    counting(pair.to_server, sent)
    counting(pair.to_client, answered)
    try:
        calls = 2 * HOLD_FRAMES + 5
        await asyncio.gather(*(pair.client.noop() for _ in range(calls)))
        assert sent == [1, HOLD_FRAMES, HOLD_FRAMES, 4]
        # The first call is answered alone; the others come in reads of the memory
        # transport's pieces, each read's answers in writes of at most HOLD_FRAMES.
        assert sum(answered) == calls
        assert max(answered) == HOLD_FRAMES
    finally:
        await pair.client.close()


def _frames_in(data: bytes) -> int:
    """How many frames ``data`` holds, split by the protocol's own reader (whole frames only)."""
    reader = FrameReader(limits.MAX_MAX_FRAME)
    reader.feed(data)
    bodies = []
    while (body := reader.next_frame()) is not None:
        bodies.append(body)
    assert sum(limits.HEADER_SIZE + len(body) for body in bodies) == len(data)
    return len(bodies)


async def test_a_carried_stream_keeps_its_bytes_and_they_earn_no_credit_on_the_new_one() -> None:
    wired = await wire(grace=30, reattach_within=30)
    client = wired.client
    handle = client.start(DOWNLOAD, Size(size=4 * WINDOW))
    cursor = handle.cursor("data")
    held = handle.call.stream("data")
    await eventually(lambda: held.buffered == WINDOW, what="a window received, unread")
    wired.server.abort(None, code=ErrorCode.GOING_AWAY)
    await eventually(lambda: client.closed, what="the loss noticed")
    # A second connection to the same execd takes the call on from the bytes held.
    fresh, _, _ = await dial(ServerProtocol(wired.server.server), reattach_within=30)
    try:
        fresh.adopt(client.take_orphans())
        await eventually(lambda: held.buffered == 2 * WINDOW, what="a window from the new one")
        assert await cursor.next() == b"d" * WINDOW  # what the first connection brought
        for _ in range(3):
            await fresh.noop()  # time for an undue grant to bring more than a window
        assert held.buffered <= WINDOW
        rest = bytearray()
        while (data := await cursor.next()) is not None:
            rest += data
        assert bytes(rest) == b"d" * (3 * WINDOW)
        assert await handle.result() == 4 * WINDOW
    finally:
        await fresh.close()
        await client.close()
