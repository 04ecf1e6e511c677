"""MCP over this process's stdin and stdout, on the event loop, with bounded messages.

The stdio transport of MCP is one JSON-RPC message per line. Here the lines
are read and written by the event loop itself (pipes, sockets and terminals
through the loop's pipe transports; a regular file, read in a worker thread,
never blocks for long), so cancelling the server (SIGTERM) never waits for a
line that may never come, and closing stdin ends the session at once.

While serving, descriptor 0 reads ``/dev/null`` and descriptor 1 writes to
stderr; the wire uses private duplicates. So nothing this process or a child
it starts prints can corrupt the stream, and nothing can steal its input.
Both are restored on exit.

A line longer than ``limit`` bytes is not buffered: it is skipped up to its
newline and reported to the server as a parse failure, and the session goes
on.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import stat
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio
import anyio.streams.memory
import mcp.shared.message
import mcp_types as types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.shared.message import SessionMessage

if TYPE_CHECKING:
    from harnessd.mcp.server import WorkspaceServer

MAX_MESSAGE = 64 * 1024 * 1024
"""Longest message (line) accepted, in bytes."""

_READ = 256 * 1024


class MessageTooLong(ValueError):
    """A line on stdin was longer than the transport accepts."""


class LineSplitter:
    """Bytes in, complete lines out; a line over ``limit`` comes out as None, unbuffered."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buffer = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> list[bytes | None]:
        """The lines ``data`` completes, in order (None for each one that was too long)."""
        lines: list[bytes | None] = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            piece = data[start:end]
            if self._skipping:
                self._skipping = False
            elif len(self._buffer) + len(piece) > self._limit:
                lines.append(None)
            else:
                self._buffer += piece
                lines.append(bytes(self._buffer))
            self._buffer.clear()
            start = end + 1
        rest = data[start:]
        if not self._skipping:
            if len(self._buffer) + len(rest) > self._limit:
                self._buffer.clear()
                self._skipping = True
                lines.append(None)
            else:
                self._buffer += rest
        return lines


def _claim_std() -> tuple[int, int, Callable[[], None]]:
    """Private duplicates of stdin and stdout; 0 then reads /dev/null and 1 writes to stderr."""
    wire_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    wire_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    keep_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    keep_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)

    def restore() -> None:
        for saved, fd in ((keep_in, 0), (keep_out, 1)):
            with contextlib.suppress(OSError):
                os.dup2(saved, fd)
                os.close(saved)

    return wire_in, wire_out, restore


def _is_regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)


class _Input:
    """Reads the wire's input: through the loop for pipes and the like, a thread for files."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._reader: asyncio.StreamReader | None = None
        self._transport: asyncio.BaseTransport | None = None

    async def open(self) -> None:
        if _is_regular(self._fd):
            return
        loop = asyncio.get_running_loop()
        reader = self._reader = asyncio.StreamReader(limit=_READ)
        pipe = os.fdopen(self._fd, "rb", buffering=0)
        self._transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )

    async def read(self) -> bytes:
        if self._reader is not None:
            return await self._reader.read(_READ)
        return await anyio.to_thread.run_sync(os.read, self._fd, _READ)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        else:
            with contextlib.suppress(OSError):
                os.close(self._fd)


class _Output:
    """Writes the wire's output with the loop's flow control (blocking writes for a file)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        if _is_regular(self._fd):
            return
        loop = asyncio.get_running_loop()
        pipe = os.fdopen(self._fd, "wb", buffering=0)
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, pipe)
        self._writer = asyncio.StreamWriter(transport, protocol, None, loop)

    async def write(self, data: bytes) -> None:
        if self._writer is not None:
            self._writer.write(data)
            await self._writer.drain()
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            with contextlib.suppress(OSError):
                os.close(self._fd)


async def _pump_in(
    source: _Input, sink: MemoryObjectSendStream[SessionMessage | Exception], limit: int
) -> None:
    splitter = LineSplitter(limit)
    async with sink:
        while True:
            try:
                data = await source.read()
            except OSError:
                data = b""
            if not data:
                return
            for line in splitter.feed(data):
                if line is None:
                    await sink.send(MessageTooLong(f"a message longer than {limit} bytes"))
                elif line.strip():
                    try:
                        message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                    except ValueError as exc:
                        await sink.send(exc)
                        continue
                    await sink.send(SessionMessage(message))


async def _pump_out(source: MemoryObjectReceiveStream[SessionMessage], sink: _Output) -> None:
    async with source:
        async for item in source:
            text = item.message.model_dump_json(by_alias=True, exclude_unset=True)
            try:
                await sink.write(text.encode() + b"\n")
            except (BrokenPipeError, ConnectionResetError):
                return


@contextlib.asynccontextmanager
async def stdio_streams(
    limit: int = MAX_MESSAGE,
) -> AsyncIterator[
    tuple[
        anyio.streams.memory.MemoryObjectReceiveStream[
            mcp.shared.message.SessionMessage | Exception
        ],
        anyio.streams.memory.MemoryObjectSendStream[mcp.shared.message.SessionMessage],
    ]
]:
    """The server's ends of the stdio wire: messages read, and where to send messages.

    The read stream ends when stdin reaches its end (the client went away).
    """
    wire_in, wire_out, restore = _claim_std()
    source, sink = _Input(wire_in), _Output(wire_out)
    try:
        await source.open()
        await sink.open()
        incoming_send, incoming = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        outgoing, outgoing_receive = anyio.create_memory_object_stream[SessionMessage](0)
        async with anyio.create_task_group() as group:
            group.start_soon(_pump_in, source, incoming_send, limit)
            group.start_soon(_pump_out, outgoing_receive, sink)
            try:
                yield incoming, outgoing
            finally:
                group.cancel_scope.cancel()
    finally:
        restore()
        source.close()
        sink.close()


async def serve_stdio(server: WorkspaceServer, limit: int = MAX_MESSAGE) -> None:
    """Serve ``server`` to the MCP client on stdin and stdout until stdin ends."""
    mcp_server = server.server
    async with stdio_streams(limit) as (incoming, outgoing):
        await mcp_server.run(incoming, outgoing, mcp_server.create_initialization_options())
