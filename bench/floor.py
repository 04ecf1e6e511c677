"""The practical floor for Python: a bare msgpack RPC and a bare byte pipe on uvloop.

Theory of operation
-------------------
:class:`FloorServer` is an ``asyncio.Protocol`` that splits 4-byte
big-endian length-prefixed frames, decodes each body as a msgpack
:class:`FloorCall`, and writes back a :class:`FloorReply` with the same id:
the least any msgpack RPC server has to do (no authentication, no flow
control, no dispatch table, no tasks). :class:`FloorClient` is the matching
client: it encodes calls, keeps one future per id so any number of calls can
be in flight on one connection, and decodes replies.

Two more methods make the floors of work that crosses from the client's
process into another one, as every execd call does: ``spawn`` (params: an
argv list) starts the command as ``subprocess.run`` would with its output
captured (``posix_spawnp``, stdin on ``/dev/null``, stdout and stderr on
pipes), watches its pidfd and both pipes on the loop and answers
``[exit_code, stdout, stderr]`` once all three are done; ``write`` (params:
``[path, data]``) is :func:`write_fsync_rename` on the loop. Neither checks
anything or limits anything: what execd adds over them is its own cost.

:class:`BulkServer` is the floor for moving bytes. A request is one byte
(``R``, ``W`` or ``F``) and an 8-byte big-endian size. ``R``: the server sends
that many bytes from a block held in memory, honouring the transport's write
backpressure. ``W``: the server takes that many incoming bytes into one
reused buffer and discards them; ``F``: the same into a scratch file; both
then answer with the 8-byte count. :class:`BulkClient` receives straight into
one buffer of the final size (``BufferedProtocol``, no copy in Python) and
sends a ``bytes`` object in 1 MiB slices, waiting for drain. The transport is
the same uvloop TCP transport execd uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Callable
from typing import Final, cast

import msgspec

_HEADER: Final = struct.Struct(">I")
_BULK_REQUEST: Final = struct.Struct(">cQ")
_BULK_ACK: Final = struct.Struct(">Q")
BULK_BLOCK: Final = 1024 * 1024
EMPTY: Final = msgspec.Raw(b"\x80")
NIL: Final = msgspec.Raw(b"\xc0")


class FloorCall(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """A call: id, method name, msgpack params."""

    id: int
    method: str
    params: msgspec.Raw = EMPTY


class FloorReply(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """A reply: the call's id and a msgpack result."""

    id: int
    result: msgspec.Raw = NIL


_ENCODER: Final = msgspec.msgpack.Encoder()
_CALL_DECODER: Final = msgspec.msgpack.Decoder(FloorCall)
_REPLY_DECODER: Final = msgspec.msgpack.Decoder(FloorReply)


def _frame(message: object) -> bytearray:
    buf = bytearray(4)
    _ENCODER.encode_into(message, buf, 4)
    _HEADER.pack_into(buf, 0, len(buf) - 4)
    return buf


class _FrameSplitter:
    """Accumulates bytes and yields complete bodies."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        bodies: list[bytes] = []
        pos = 0
        end = len(buf)
        while end - pos >= 4:
            (length,) = _HEADER.unpack_from(buf, pos)
            if end - pos - 4 < length:
                break
            bodies.append(bytes(buf[pos + 4 : pos + 4 + length]))
            pos += 4 + length
        if pos:
            del buf[:pos]
        return bodies


def write_fsync_rename(path: str, data: bytes, *, sync_directory: bool = False) -> None:
    """The floor of an atomic write: a temporary written, fsynced, renamed over ``path``.

    ``sync_directory``: then fsync the directory too, which makes the rename
    itself durable (execd's atomic write with ``durable=True`` does).
    """
    temporary = path + ".floor-tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temporary, path)
    if sync_directory:
        directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


_WRITE_PARAMS: Final = msgspec.msgpack.Decoder(tuple[str, bytes])
_ARGV: Final = msgspec.msgpack.Decoder(list[str])
_TRUE: Final = msgspec.Raw(_ENCODER.encode(["true"]))
_SPAWN_RESULT: Final = msgspec.msgpack.Decoder(tuple[int, bytes, bytes])


class _Run:
    """One ``spawn`` call: a child, its two output pipes and its pidfd, watched on the loop."""

    __slots__ = ("_done", "_loop", "_open", "_output", "_pid", "_pidfd", "_status")

    def __init__(self, argv: list[str], done: Callable[[msgspec.Raw], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = done
        self._output: dict[int, bytearray] = {}
        self._status = 0
        # Nonblocking on the parent's ends only: the child writes as to any pipe.
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(out_r, False)
        os.set_blocking(err_r, False)
        try:
            self._pid = os.posix_spawnp(
                argv[0],
                argv,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, out_w, 1),
                    (os.POSIX_SPAWN_DUP2, err_w, 2),
                ],
            )
        except OSError:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        self._pidfd = os.pidfd_open(self._pid)
        self._open = 3
        for fd in (out_r, err_r):
            self._output[fd] = bytearray()
            self._loop.add_reader(fd, self._readable, fd)
        self._loop.add_reader(self._pidfd, self._exited)

    def _readable(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if data:
            self._output[fd] += data
            return
        self._loop.remove_reader(fd)
        os.close(fd)
        self._one_done()

    def _exited(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        _, status = os.waitpid(self._pid, 0)
        self._status = os.waitstatus_to_exitcode(status)
        self._one_done()

    def _one_done(self) -> None:
        self._open -= 1
        if not self._open:
            stdout, stderr = self._output.values()
            self._done(msgspec.Raw(_ENCODER.encode((self._status, stdout, stderr))))


class FloorServer(asyncio.Protocol):
    """Answers every FloorCall with a FloorReply (module docstring).

    The result is nil, the params for ``echo``, what ``spawn`` describes;
    ``write`` answers nil once its file is renamed into place.
    """

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._splitter = _FrameSplitter()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        assert transport is not None
        out = bytearray()
        for body in self._splitter.feed(data):
            call = _CALL_DECODER.decode(body)
            result = NIL
            if call.method == "echo":
                result = call.params
            elif call.method == "write":
                write_fsync_rename(*_WRITE_PARAMS.decode(call.params))
            elif call.method == "spawn":
                _Run(_ARGV.decode(call.params), self._replier(call.id))
                continue
            out += _frame(FloorReply(id=call.id, result=result))
        if out:
            transport.write(out)

    def _replier(self, call_id: int) -> Callable[[msgspec.Raw], None]:
        def reply(result: msgspec.Raw) -> None:
            if self._transport is not None and not self._transport.is_closing():
                self._transport.write(_frame(FloorReply(id=call_id, result=result)))

        return reply


class FloorClient(asyncio.Protocol):
    """Calls a FloorServer; any number of calls may be in flight."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._splitter = _FrameSplitter()
        self._pending: dict[int, asyncio.Future[msgspec.Raw]] = {}
        self._next_id = 1
        self._lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        for body in self._splitter.feed(data):
            reply = _REPLY_DECODER.decode(body)
            future = self._pending.pop(reply.id, None)
            if future is not None and not future.done():
                future.set_result(reply.result)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionError("floor server closed the connection")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(self._lost)
        self._pending.clear()

    async def call(self, method: str, params: msgspec.Raw = EMPTY) -> msgspec.Raw:
        """Send one call and wait for its result."""
        if self._lost is not None or self._transport is None:
            raise ConnectionError("not connected to the floor server")
        call_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[msgspec.Raw] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        self._transport.write(_frame(FloorCall(id=call_id, method=method, params=params)))
        return await future

    def close(self) -> None:
        """Close the connection."""
        if self._transport is not None:
            self._transport.close()

    async def spawn_true(self) -> None:
        """The server's ``spawn`` of ``true``; RuntimeError unless it exited with 0."""
        exit_code, _, _ = _SPAWN_RESULT.decode(await self.call("spawn", _TRUE))
        if exit_code != 0:
            raise RuntimeError(f"true exited with {exit_code} in the floor server")


def write_params(path: str, data: bytes) -> msgspec.Raw:
    """The params of the server's ``write`` of ``data`` to ``path`` (encoded once, reused)."""
    return msgspec.Raw(_ENCODER.encode((path, data)))


async def connect_floor(host: str, port: int) -> FloorClient:
    """A connected FloorClient."""
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(FloorClient, host, port)
    return proto


class _Writer(asyncio.BufferedProtocol):
    """Write backpressure shared by both ends of the bulk pipe."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(exc or ConnectionError("connection closed"))
            self._drained.exception()

    async def drain(self) -> None:
        while self._paused:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained


class BulkServer(_Writer):
    """Serves ``R`` (send N bytes), ``W`` (take N bytes) and ``F`` (take N bytes into a file).

    Incoming bytes land in one reused buffer (``recv_into``): taking bytes
    costs the kernel's copy and nothing else. ``F`` writes them to a scratch
    file (truncated first, never fsync-ed), the floor of a file upload.
    """

    def __init__(self, scratch_dir: str | None = None) -> None:
        super().__init__()
        self._block = bytes(BULK_BLOCK)
        self._buffer = bytearray(BULK_BLOCK)
        self._view = memoryview(self._buffer)
        self._head = bytearray()
        self._receiving = 0
        self._received_total = 0
        self._fd = -1
        self._scratch_path = (
            None if scratch_dir is None else os.path.join(scratch_dir, f"bulk-{id(self):x}")
        )
        self._sender: asyncio.Task[None] | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        view = self._view[:nbytes]
        while view:
            if self._receiving:
                take = min(self._receiving, len(view))
                if self._fd >= 0:
                    _write_all(self._fd, view[:take])
                self._receiving -= take
                view = view[take:]
                if not self._receiving:
                    self._finish_receive()
                continue
            need = _BULK_REQUEST.size - len(self._head)
            self._head += view[:need]
            view = view[need:]
            if len(self._head) == _BULK_REQUEST.size:
                op, size = _BULK_REQUEST.unpack(self._head)
                self._head.clear()
                self._start(op, size)

    def _start(self, op: bytes, size: int) -> None:
        transport = self.transport
        assert transport is not None
        if op == b"R":
            self._sender = asyncio.get_running_loop().create_task(self._send(size))
            return
        if op not in (b"W", b"F") or (op == b"F" and self._scratch_path is None):
            transport.close()
            return
        if op == b"F":
            assert self._scratch_path is not None
            self._fd = os.open(self._scratch_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._received_total = size
        self._receiving = size
        if size == 0:
            self._finish_receive()

    def _finish_receive(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        assert self.transport is not None
        self.transport.write(_BULK_ACK.pack(self._received_total))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._scratch_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._scratch_path)

    async def _send(self, size: int) -> None:
        transport = self.transport
        assert transport is not None
        view = memoryview(self._block)
        left = size
        while left > 0:
            step = min(left, BULK_BLOCK)
            transport.write(view[:step] if step < BULK_BLOCK else self._block)
            left -= step
            await self.drain()


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


class _BulkClient(_Writer):
    """Receives straight into the caller's buffer (``recv_into``)."""

    def __init__(self) -> None:
        super().__init__()
        self._target = memoryview(bytearray(0))
        self._spare = memoryview(bytearray(4096))
        self.received = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.received < len(self._target):
            return self._target[self.received :]
        # Nothing expected: anything that comes is a protocol error.
        return self._spare

    def buffer_updated(self, nbytes: int) -> None:
        if self.received >= len(self._target):
            assert self.transport is not None
            self.transport.close()
            return
        self.received += nbytes
        if self.received >= len(self._target) and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("bulk server closed the connection"))
            self.done.exception()  # retrieved here; a transfer awaiting it still raises

    def expect(self, target: bytearray) -> None:
        self._target = memoryview(target)
        self.received = 0
        self.done = asyncio.get_running_loop().create_future()
        if not target:
            self.done.set_result(None)


class BulkClient:
    """One connection to a BulkServer, reused for any number of transfers."""

    def __init__(self, proto: _BulkClient) -> None:
        self._proto = proto

    async def read(self, size: int) -> bytearray:
        """Receive ``size`` bytes from the server into one new buffer."""
        proto = self._proto
        assert proto.transport is not None
        target = bytearray(size)
        proto.expect(target)
        proto.transport.write(_BULK_REQUEST.pack(b"R", size))
        await proto.done
        return target

    async def write(self, data: bytes, *, to_file: bool = False) -> int:
        """Send ``data`` in 1 MiB slices (into the server's scratch file with ``to_file``).

        Returns the byte count the server acknowledged.
        """
        proto = self._proto
        assert proto.transport is not None
        ack = bytearray(_BULK_ACK.size)
        proto.expect(ack)
        proto.transport.write(_BULK_REQUEST.pack(b"F" if to_file else b"W", len(data)))
        view = memoryview(data)
        for start in range(0, len(data), BULK_BLOCK):
            proto.transport.write(view[start : start + BULK_BLOCK])
            await proto.drain()
        await proto.done
        (count,) = _BULK_ACK.unpack(ack)
        return int(count)

    def close(self) -> None:
        """Close the connection."""
        if self._proto.transport is not None:
            self._proto.transport.close()


async def connect_bulk(host: str, port: int) -> BulkClient:
    """A connected BulkClient."""
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(_BulkClient, host, port)
    return BulkClient(proto)
