"""The typed user API of the client: one method per execd RPC.

:class:`ExecdClient` is what :func:`connect` returns. Methods
that move bytes (command output, file content, ledger entries) stream them in
flow-controlled chunks, so neither side holds more than a window at a time.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import os
import stat
from collections.abc import AsyncIterator, Mapping
from typing import BinaryIO, Generic, TypeVar

from harnessd import keepalive as keepalive_group
from harnessd.api_services import ServicesClient
from harnessd.api_watch import WatchClient
from harnessd.calls import StreamCursor
from harnessd.client import CallHandle, open_connection
from harnessd.errors import (
    ConnectionLost,
    HandshakeFailed,
    LocalFileError,
    NotSent,
    ProtocolViolation,
    UploadCut,
)
from harnessd.opening import Opening
from harnessd.terminal import TerminalsClient
from protocol import limits
from protocol.errors import ErrorCode
from protocol.handshake import token_bytes
from protocol.rpc import core, files, ledger, shell
from protocol.rpc.resources import Limits, as_limits

R = TypeVar("R")
_NO_PARAMS = core.NoParams()
#: Block size for uploads from local files.
UPLOAD_BLOCK = 1024 * 1024
#: Most bytes ``read_file`` takes inline in the reply; larger content is streamed. A
#: result is copied as it is decoded, and kept whole for an attach while the call's
#: outcome is retained (a stream's chunks are neither).
READ_INLINE_MAX = 64 * 1024


def _local_error(action: str, local_path: str, exc: OSError) -> LocalFileError:
    name = errno.errorcode.get(exc.errno or 0)
    reason = exc.strerror or name or "cannot be used"
    return LocalFileError(f"{action}: {local_path}: {reason}", local_path, name)


def _upload_cut(path: str, untouched: bool, lost: ConnectionLost) -> UploadCut:
    """The error of an upload whose connection was lost before the end of its content."""
    left = "the target is untouched" if untouched else "the target may hold part of it"
    return UploadCut(f"upload to {path} cut before its end ({lost}); {left}", path, untouched)


def _open_for_upload(local_path: str) -> BinaryIO:
    """``local_path`` opened for reading, if it is a regular file."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer before it is refused.
    try:
        fd = os.open(local_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _local_error("upload", local_path, exc) from None
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            what = "is a directory" if stat.S_ISDIR(kind) else "is not a regular file"
            name = "EISDIR" if stat.S_ISDIR(kind) else None
            raise LocalFileError(f"upload: {local_path} {what}", local_path, name)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class ExecdClient(ServicesClient, TerminalsClient, WatchClient):
    """An authenticated connection to execd with one typed method per RPC."""

    # -- core ------------------------------------------------------------------

    async def noop(self) -> None:
        """A call that does nothing: the round-trip floor."""
        await self.call(core.NOOP, _NO_PARAMS)

    async def echo(self, data: bytes) -> bytes:
        """Send ``data`` and get it back."""
        return await self.call(core.ECHO, core.EchoParams(data=data))

    async def server_info(self) -> core.ServerInfo:
        """execd's pid, uid, marker, protocol version and methods."""
        return await self.call(core.INFO, _NO_PARAMS)

    async def shutdown(self, *, timeout: float = 10.0) -> core.CloseReport:
        """Stop execd: kill every process carrying the marker, answer, then exit.

        The report says what was killed and what survived ``timeout``; the
        connection closes as execd exits.
        """
        self.request_ids = False  # execd exits after it: nothing to reattach to
        return await self.call(core.CLOSE, core.CloseParams(shutdown=True, timeout=timeout))

    async def cleanup(self, *, timeout: float = 10.0) -> core.CloseReport:
        """Kill every process carrying the marker (services, sessions, commands); execd stays up."""
        return await self.call(core.CLOSE, core.CloseParams(shutdown=False, timeout=timeout))

    # -- shell -----------------------------------------------------------------

    async def run(
        self,
        argv: list[str] | None = None,
        *,
        command: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        unset: list[str] | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        output_cap: int | None = None,
        drain_grace: float | None = None,
        kill_grace: float | None = None,
        limits: Limits | Mapping[str, float] | None = None,
    ) -> shell.RunResult:
        """Run a command (``argv``, or ``command`` through ``/bin/sh -c``) and collect its output.

        ``limits``: resource limits (``{"memory": 256 << 20, "cpu": 1.0}`` or a
        :class:`~protocol.rpc.resources.Limits`); the result's ``limit_exceeded`` names one hit.
        """
        params = shell.RunParams(
            argv=argv,
            command=command,
            cwd=cwd,
            env=env,
            unset=unset,
            stdin=stdin,
            timeout=timeout,
            idle_timeout=idle_timeout,
            output_cap=output_cap,
            drain_grace=drain_grace,
            kill_grace=kill_grace,
            limits=as_limits(limits),
        )
        return await self.call(shell.RUN, params)

    def run_streaming(
        self,
        argv: list[str] | None = None,
        *,
        command: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        unset: list[str] | None = None,
        stdin_stream: bool = False,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        drain_grace: float | None = None,
        kill_grace: float | None = None,
        limits: Limits | Mapping[str, float] | None = None,
    ) -> RunningCommand[shell.RunResult]:
        """Start a command whose output streams live; see :class:`RunningCommand`."""
        params = shell.RunParams(
            argv=argv,
            command=command,
            cwd=cwd,
            env=env,
            unset=unset,
            stdin_stream=stdin_stream,
            timeout=timeout,
            idle_timeout=idle_timeout,
            stream=True,
            drain_grace=drain_grace,
            kill_grace=kill_grace,
            limits=as_limits(limits),
        )
        return RunningCommand(self, self.start(shell.RUN, params))

    async def run_detached(
        self,
        argv: list[str] | None = None,
        *,
        command: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        limits: Limits | Mapping[str, float] | None = None,
    ) -> shell.RunResult:
        """Start a command that outlives this connection; the result carries its command_id."""
        params = shell.RunParams(
            argv=argv,
            command=command,
            cwd=cwd,
            env=env,
            timeout=timeout,
            detached=True,
            limits=as_limits(limits),
        )
        return await self.call(shell.RUN, params)

    async def signal_command(
        self,
        signal: int,
        *,
        call_id: int | None = None,
        command_id: str | None = None,
        rid: bytes | None = None,
    ) -> shell.SignalResult:
        """Send ``signal`` to a running command: exactly one of the three names it.

        ``call_id``: a streaming call of this connection; ``rid``: one by its
        request id (:attr:`~harnessd.client.CallHandle.request_id`), from any connection, also
        after it was reattached; ``command_id``: a detached command. A call id
        names a call of this connection only: such a signal is never carried
        over to another connection (on a lost one it fails with NotSent).
        """
        params = shell.SignalParams(signal=signal, call_id=call_id, command_id=command_id, rid=rid)
        if call_id is not None:
            return await self.call_here(shell.SIGNAL, params)
        return await self.call(shell.SIGNAL, params)

    async def list_commands(self) -> shell.ListResult:
        """Every detached command execd remembers."""
        return await self.call(shell.LIST, shell.ListParams())

    async def command_status(self, command_id: str) -> shell.CommandInfo:
        """A detached command's state, without waiting."""
        params = shell.StatusParams(command_id=command_id)
        return await self.call(shell.STATUS, params)

    async def wait_command(
        self, command_id: str, timeout: float | None = None
    ) -> shell.CommandInfo:
        """Wait for a detached command to exit (or ``timeout``)."""
        params = shell.WaitParams(command_id=command_id, timeout=timeout)
        return await self.call(shell.WAIT, params)

    def attach(self, command_id: str, *, follow: bool = True) -> RunningCommand[shell.AttachResult]:
        """Replay a detached command's retained output, then follow it live."""
        params = shell.AttachParams(command_id=command_id, follow=follow)
        return RunningCommand(self, self.start(shell.ATTACH, params))

    # -- files -----------------------------------------------------------------

    async def read_file(
        self,
        path: str,
        *,
        offset: int = 0,
        length: int | None = None,
        max_bytes: int | None = None,
        checksum: bool = False,
    ) -> bytes:
        """The bytes of a workspace file (whole, or a range); large files arrive streamed.

        Content of at most :data:`READ_INLINE_MAX` bytes comes inline in the
        reply (one frame); more comes on the stream, whose chunks cost no copy.
        Blocks are copied into one growing buffer as they arrive and dropped,
        so the content is written into fresh memory once (a list joined at the
        end would be twice) and the next block reuses the last one's memory.
        """
        params = files.ReadParams(
            path=path,
            offset=offset,
            length=length,
            max_bytes=max_bytes,
            checksum=checksum,
            inline_max=READ_INLINE_MAX,
        )
        read = _FileRead(self, params)
        try:
            first = await read.next()
            if first is None:
                return b""
            if read.finished:
                return first  # inline in the reply: nothing can follow it
            data = await read.next()
            if data is None:
                return first  # one block (the common case) is returned as it is
            gathered = io.BytesIO()
            gathered.write(first)
            del first
            while data is not None:
                gathered.write(data)
                data = await read.next()
        finally:
            read.close()
        # getvalue() hands out the buffer itself, without a copy.
        return gathered.getvalue()

    def iter_file(
        self,
        path: str,
        *,
        offset: int = 0,
        length: int | None = None,
        max_bytes: int | None = None,
        checksum: bool = False,
        stream: bool = True,
        inline_max: int | None = None,
    ) -> AsyncIterator[bytes]:
        """Yield a workspace file's bytes block by block, with bounded memory.

        With ``checksum`` both sides hash the content and a mismatch raises
        ProtocolViolation (it costs a SHA-256 pass on each side). With
        ``stream=False`` content that fits one reply frame (and is at most
        ``inline_max`` bytes, when given) comes inline in the result (one
        frame instead of three); larger content streams anyway.
        """
        params = files.ReadParams(
            path=path,
            offset=offset,
            length=length,
            max_bytes=max_bytes,
            stream=stream,
            checksum=checksum,
            inline_max=inline_max,
        )
        return self._read(params)

    async def _read(self, params: files.ReadParams) -> AsyncIterator[bytes]:
        read = _FileRead(self, params)
        try:
            while (data := await read.next()) is not None:
                yield data
        finally:
            read.close()

    async def download(self, path: str, local_path: str) -> int:
        """Copy a workspace file to ``local_path`` on this machine; return its size.

        Raises :class:`~harnessd.errors.LocalFileError` when ``local_path``
        cannot be opened for writing (a directory, a missing parent).
        """
        size = 0
        try:
            out = await asyncio.to_thread(open, local_path, "wb")
        except OSError as exc:
            raise _local_error("download", local_path, exc) from None
        try:
            async for data in self.iter_file(path):
                await asyncio.to_thread(out.write, data)
                size += len(data)
        finally:
            await asyncio.to_thread(out.close)
        return size

    async def write_file(
        self,
        path: str,
        data: bytes,
        *,
        mode: int | None = None,
        create_parents: bool = False,
        atomic: bool = True,
        append: bool = False,
        durable: bool = False,
    ) -> files.WriteResult:
        """Write ``data`` to a workspace file (atomically by default); big data is streamed.

        ``durable``: the content is on disk when this returns (the rename too,
        for an atomic write); see ``files.write`` in PROTOCOL.md.
        """
        if len(data) <= self.inline_limit:
            params = files.WriteParams(
                path=path,
                data=data,
                create_parents=create_parents,
                mode=mode,
                atomic=atomic and not append,
                durable=durable,
                append=append,
            )
            return await self.call(files.WRITE, params)

        async def blocks() -> AsyncIterator[bytes]:
            yield data

        return await self.write_stream(
            path,
            blocks(),
            size=len(data),
            mode=mode,
            create_parents=create_parents,
            atomic=atomic,
            append=append,
            durable=durable,
        )

    async def write_stream(
        self,
        path: str,
        blocks: AsyncIterator[bytes],
        *,
        size: int | None = None,
        mode: int | None = None,
        create_parents: bool = False,
        atomic: bool = True,
        append: bool = False,
        durable: bool = False,
    ) -> files.WriteResult:
        """Write a workspace file from an async iterator of blocks (flow-controlled).

        Raises :class:`~harnessd.errors.UploadCut` when the connection is
        lost before all of the content was sent (an atomic write then left
        the target untouched).
        """
        params = files.WriteParams(
            path=path,
            stream=True,
            create_parents=create_parents,
            mode=mode,
            atomic=atomic and not append,
            durable=durable,
            append=append,
            expected_size=size,
        )
        handle = self.start(files.WRITE, params)
        ending = False
        try:
            async for block in blocks:
                if handle.done:
                    break
                await handle.send(files.DATA_STREAM, block)
            if not handle.done:
                ending = True  # from here on the end of the content may reach execd
                await handle.send(files.DATA_STREAM, b"", end=True)
            return await handle.result()
        except ConnectionLost as exc:
            handle.cancel()
            if ending or isinstance(exc, NotSent):
                raise
            raise _upload_cut(path, atomic and not append, exc) from exc
        except BaseException:
            handle.cancel()
            raise

    async def upload(
        self, local_path: str, path: str, *, mode: int | None = None
    ) -> files.WriteResult:
        """Copy a local regular file into the workspace with bounded memory.

        Raises :class:`~harnessd.errors.LocalFileError` before anything is sent
        when ``local_path`` cannot be opened or is not a regular file (a
        directory, a FIFO, a device).
        """
        src = await asyncio.to_thread(_open_for_upload, local_path)

        async def blocks() -> AsyncIterator[bytes]:
            while block := await asyncio.to_thread(src.read, UPLOAD_BLOCK):
                yield block

        try:
            size = os.fstat(src.fileno()).st_size
            return await self.write_stream(path, blocks(), size=size, mode=mode)
        finally:
            await asyncio.to_thread(src.close)

    async def stat(self, path: str, *, follow_symlinks: bool = True) -> files.StatResult:
        """Type, size, mode, times and owner of a workspace path."""
        params = files.StatParams(path=path, follow_symlinks=follow_symlinks)
        return await self.call(files.STAT, params)

    async def list_dir(
        self,
        path: str,
        *,
        recursive: bool = False,
        limit: int | None = None,
        include_hidden: bool = True,
    ) -> files.ListResult:
        """Entries of a workspace directory (optionally recursive, bounded by ``limit``)."""
        params = files.ListParams(
            path=path, recursive=recursive, limit=limit, include_hidden=include_hidden
        )
        return await self.call(files.LIST, params)

    async def mkdir(
        self, path: str, *, parents: bool = True, exist_ok: bool = True, mode: int | None = None
    ) -> files.MkdirResult:
        """Create a workspace directory."""
        params = files.MkdirParams(path=path, parents=parents, exist_ok=exist_ok, mode=mode)
        return await self.call(files.MKDIR, params)

    async def remove(
        self, path: str, *, recursive: bool = False, missing_ok: bool = False
    ) -> files.RemoveResult:
        """Remove a workspace file or directory."""
        params = files.RemoveParams(path=path, recursive=recursive, missing_ok=missing_ok)
        return await self.call(files.REMOVE, params)

    async def move(self, src: str, dst: str, *, overwrite: bool = True) -> files.MoveResult:
        """Rename (or copy across filesystems) a workspace path."""
        params = files.MoveParams(src=src, dst=dst, overwrite=overwrite)
        return await self.call(files.MOVE, params)

    async def chmod(self, path: str, mode: int) -> files.ChmodResult:
        """Change a workspace path's mode."""
        return await self.call(files.CHMOD, files.ChmodParams(path=path, mode=mode))

    async def sha256(self, path: str) -> files.Sha256Result:
        """SHA-256 of a workspace file, computed in the workspace."""
        return await self.call(files.SHA256, files.Sha256Params(path=path))

    # -- ledger ----------------------------------------------------------------

    async def ledger_head(self, session: str) -> ledger.LedgerHead:
        """execd's head of a session ledger (seq 0 for a new one)."""
        return await self.call(ledger.HEAD, ledger.HeadParams(session=session))

    async def ledger_append(
        self,
        session: str,
        first_seq: int,
        prev_hash: bytes,
        entries: list[bytes],
        hashes: list[bytes] | None = None,
    ) -> ledger.LedgerHead:
        """Append a batch; LedgerConflict (with execd's head in ``data``) when it does not follow."""
        params = ledger.AppendParams(
            session=session,
            first_seq=first_seq,
            prev_hash=prev_hash,
            entries=entries,
            hashes=hashes,
        )
        return await self.call(ledger.APPEND, params)

    async def ledger_append_large(
        self, session: str, seq: int, prev_hash: bytes, payload: bytes
    ) -> ledger.LedgerHead:
        """Append one entry too large for a frame, streamed in chunks."""
        params = ledger.AppendLargeParams(
            session=session,
            seq=seq,
            prev_hash=prev_hash,
            size=len(payload),
            sha256=hashlib.sha256(payload).digest(),
        )
        handle = self.start(ledger.APPEND_LARGE, params)
        try:
            await handle.send(ledger.DATA_STREAM, payload, end=True)
        except BaseException:
            handle.cancel()
            raise
        return await handle.result()

    async def ledger_read(
        self,
        session: str,
        from_seq: int = 1,
        *,
        limit: int | None = None,
        prev_hash: bytes | None = None,
    ) -> list[ledger.LedgerRecord]:
        """Entries from ``from_seq``; with ``prev_hash`` the chain is verified as they arrive."""
        handle = self.start(
            ledger.READ, ledger.ReadParams(session=session, from_seq=from_seq, limit=limit)
        )
        decoder = ledger.RecordDecoder(from_seq, prev_hash)
        records: list[ledger.LedgerRecord] = []
        try:
            async for data in handle.stream(ledger.ENTRIES_STREAM):
                records.extend(decoder.feed(data))
            decoder.close()
        except ledger.RecordFormatError as exc:
            handle.cancel()
            raise ProtocolViolation(f"ledger stream is invalid: {exc}") from None
        result = await handle.result()
        if result.count != len(records):
            raise ProtocolViolation("ledger.read sent a different number of entries than it said")
        return records

    async def ledger_sessions(self) -> ledger.ListResult:
        """Every session ledger execd keeps, with heads."""
        return await self.call(ledger.LIST, ledger.ListParams())

    @property
    def inline_limit(self) -> int:
        """Largest payload sent inline in one call; bigger ones are streamed."""
        return max(4096, self.info.peer_max_frame // 2)


class _FileRead:
    """One files.read call, its blocks one :meth:`next` at a time: streamed, then inline.

    The bytes received are counted (and hashed with ``checksum``) and
    checked against the result before its inline part, the last block, is
    handed out: a mismatch raises ProtocolViolation.
    """

    __slots__ = ("_cursor", "_digest", "_handle", "_path", "_received")

    def __init__(self, client: ExecdClient, params: files.ReadParams) -> None:
        self._path = params.path
        self._handle = client.start(files.READ, params)
        self._cursor: StreamCursor | None = self._handle.cursor(files.DATA_STREAM)
        self._digest = hashlib.sha256() if params.checksum else None
        self._received = 0

    @property
    def finished(self) -> bool:
        """Whether the call has ended and its result was checked: :meth:`next` has no more."""
        return self._cursor is None

    async def next(self) -> bytes | None:
        """The next non-empty block of the file; None after the last."""
        cursor = self._cursor
        while cursor is not None:
            data = await cursor.next()
            if data is None:
                self._cursor = None
                return self._finish(await self._handle.result())
            if data:
                self._count(data)
                return data
        return None

    def close(self) -> None:
        """Cancel the call if it has not finished (the reader stopped early)."""
        if not self._handle.done:
            self._handle.cancel()

    def _count(self, data: bytes) -> None:
        if self._digest is not None:
            self._digest.update(data)
        self._received += len(data)

    def _finish(self, result: files.ReadResult) -> bytes | None:
        if result.data:
            self._count(result.data)
        path = self._path
        if self._received != result.bytes_sent:
            raise ProtocolViolation(
                f"files.read of {path!r}: got {self._received} bytes, execd sent "
                f"{result.bytes_sent}"
            )
        if self._digest is not None and self._digest.hexdigest() != result.sha256:
            raise ProtocolViolation(f"files.read of {path!r}: content does not match its sha256")
        return result.data or None


class RunningCommand(Generic[R]):
    """A streaming command: iterate its output, feed its stdin, signal it, await its result.

    ``R`` is the answer of the call that streams it: ``shell.RunResult`` for
    :meth:`ExecdClient.run_streaming`, ``shell.AttachResult`` for
    :meth:`ExecdClient.attach`.
    """

    def __init__(self, client: ExecdClient, handle: CallHandle[R]) -> None:
        self._client = client
        self.handle = handle
        # Bound now, not at the first iteration: a command may be over before that.
        self._cursors = [
            (name, handle.cursor(name)) for name in (shell.STDOUT_STREAM, shell.STDERR_STREAM)
        ]

    @property
    def call_id(self) -> int:
        return self.handle.id

    async def output(self) -> AsyncIterator[tuple[str, bytes]]:
        """``(stream name, bytes)`` pairs from stdout and stderr, as they arrive.

        Every byte the command wrote comes out, however late iteration
        starts (the streams are bound when the command is started), and
        across a reattach. Raises ConnectionLost when the connection is lost
        before both streams ended.
        """
        reads: dict[asyncio.Task[bytes | None], tuple[str, StreamCursor]] = {
            asyncio.ensure_future(cursor.next()): (name, cursor) for name, cursor in self._cursors
        }
        try:
            while reads:
                done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                # Both ready: stdout first, as a terminal would show them.
                for read in sorted(done, key=lambda task: reads[task][0] != shell.STDOUT_STREAM):
                    name, cursor = reads.pop(read)
                    data = read.result()
                    if data is not None:
                        reads[asyncio.ensure_future(cursor.next())] = (name, cursor)
                        yield name, data
        finally:
            # Left early (or failed): a read not taken yet takes nothing from its stream.
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to the command's stdin (needs ``stdin_stream=True``)."""
        await self.handle.send(shell.STDIN_STREAM, data)

    async def close_stdin(self) -> None:
        """Signal end of input on the command's stdin."""
        await self.handle.send(shell.STDIN_STREAM, b"", end=True)

    async def signal(self, signum: int) -> shell.SignalResult:
        """Send a signal to the command's process group.

        The command is named by its request id, so the signal goes on the
        connection its call is on now and reaches it across a reattach. A call
        without one (a client with ``request_ids`` off) is named by its call
        id, through the connection it was started on only: once that is lost,
        NotSent.
        """
        rid = self.handle.request_id
        if rid is None:
            return await self._client.signal_command(signum, call_id=self.handle.id)
        # Through whichever client carries the command's call now.
        carrier = await self.handle.carrier()
        return await carrier.call(shell.SIGNAL, shell.SignalParams(signal=signum, rid=rid))

    async def result(self) -> R:
        """Wait for the command to finish; its output has all been delivered by then."""
        return await self.handle.result()

    def cancel(self) -> None:
        """Cancel the call: execd kills the command's group (after a reattach too)."""
        self.handle.cancel()


#: Connections :func:`connect` opens when execd times out the handshake (the first included).
HANDSHAKE_ATTEMPTS = 3


def connect(
    host: str,
    port: int,
    token: bytes | str,
    *,
    encrypt: bool | str = False,
    timeout: float = 10.0,
    keepalive: float | None = keepalive_group.DEFAULT_INTERVAL,
    max_frame: int = limits.DEFAULT_MAX_FRAME,
    window: int = limits.DEFAULT_STREAM_WINDOW,
    reattach_within: float = 0.0,
) -> Opening[ExecdClient]:
    """Connect to execd at ``host:port``, authenticate with ``token``, return the client.

    ``client = await connect(...)`` leaves closing to the caller;
    ``async with connect(...) as client:`` closes the connection on exit.
    ``token`` is taken as execd takes it (PROTOCOL.md 6.8): a ``str`` is
    encoded as UTF-8, and leading and trailing ASCII whitespace is removed, so
    the content of a token file can be passed as read. ``encrypt``: False for
    plaintext frames (loopback), True to require authenticated encryption, or
    a cipher name. ``keepalive``: seconds between pings (default
    :data:`harnessd.keepalive.DEFAULT_INTERVAL`, 5); a connection silent for
    three intervals fails with ConnectionLost. ``reattach_within``: seconds
    the calls in flight on a lost connection wait for another client to
    take them on (:meth:`~harnessd.client.Client.adopt`, :mod:`harnessd.calls`;
    0, the default: they fail with ConnectionLost at once).

    A handshake execd gave up waiting for (HANDSHAKE_TIMEOUT: this side did
    not finish within execd's limit, as when its event loop is starved) is
    tried again on a new connection, at most :data:`HANDSHAKE_ATTEMPTS` times
    in all.

    Raises ValueError at once for an empty or overlong token; then
    ConnectFailed, AuthenticationFailed or HandshakeFailed.
    """
    secret = token_bytes(token)

    async def open_client() -> ExecdClient:
        for attempt in range(1, HANDSHAKE_ATTEMPTS + 1):
            try:
                proto, info = await open_connection(
                    host,
                    port,
                    secret,
                    encrypt=encrypt,
                    timeout=timeout,
                    max_frame=max_frame,
                    window=window,
                )
                break
            except HandshakeFailed as exc:
                if exc.code != ErrorCode.HANDSHAKE_TIMEOUT or attempt == HANDSHAKE_ATTEMPTS:
                    raise
        return ExecdClient(proto, info, keepalive, reattach_within=reattach_within)

    return Opening(open_client, ExecdClient.close)
