"""The ``files.*`` capability: read, write and manage files in the workspace.

Paths: a relative path resolves against execd's current working directory,
exactly as the operating system resolves it; execd does not confine paths to a
root (it runs with the workspace user's own rights).

Blocking work: every filesystem call runs in a worker thread of the
capability's own :class:`~execd.workers.WorkerPool`, one bounded unit at a
time (a block of at most :data:`execd.fsops.BLOCK` bytes for content, one
metadata operation, or one listing bounded by its limit), so a large file
never stalls the event loop and memory stays bounded by a few blocks whatever
the file size. Each connection has a bounded share of the pool's threads, so
work that hangs (a dead network filesystem) stalls only the connection that
asked for it. A call that opens files holds as many units of execd's
open-files budget as it may keep descriptors open (:mod:`execd.budget`), in
total and of its connection's share: past either bound it is refused with
LIMIT_EXCEEDED before it opens anything. Opening never waits: files are
opened non-blocking and only regular files are read or written (a FIFO or a
device is NOT_SUPPORTED).

Cancellation: a cancelled call waits briefly for the unit in flight (long
units notice a cancel event and stop early); the cancel is answered at the
latest :data:`execd.workers.CANCEL_GRACE` seconds later even if the unit
still runs. Descriptors and temporaries are released once no unit of the call
runs any more (:meth:`execd.workers.Work.release`); a small local file that an
atomic write replaced is freed just after the call is answered
(:func:`_free_replaced`). A unit that was still
running when the cancel was answered is not undone: a write's final rename
may still land.

Errors: every ``OSError`` becomes the typed error of its errno
(:func:`execd.errors.from_oserror`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import time
from collections.abc import AsyncIterator, Coroutine
from types import TracebackType
from typing import Any

from execd import budget, fsops
from execd.budget import Budget
from execd.config import Config
from execd.context import CallContext, Method, bind
from execd.errors import InvalidParams, StreamError, TooLarge, from_oserror
from execd.fit import result_budget
from execd.local_fs import INLINE_MAX, INLINE_READ_MAX, SYNC_INLINE_MAX, LocalFiles
from execd.workers import Work, WorkerPool
from protocol.rpc import files as rpc
from protocol.rpc.files import (
    DATA_STREAM,
    ChmodParams,
    ChmodResult,
    ListParams,
    ListResult,
    MkdirParams,
    MkdirResult,
    MoveParams,
    MoveResult,
    ReadParams,
    ReadResult,
    RemoveParams,
    RemoveResult,
    Sha256Params,
    Sha256Result,
    StatParams,
    StatResult,
    WriteParams,
    WriteResult,
)

REPLY_OVERHEAD = 1024
"""Room kept in a reply frame for everything but inline file content."""

LIST_OVERHEAD = 4096
"""Room kept in a reply frame for everything but the list entries."""


def _close_opened(opened: tuple[int, object]) -> None:
    os.close(opened[0])


class _typed_errors:
    """Turn an ``OSError`` into its typed error, naming ``path`` (else the OS's filename).

    A class rather than a generator context manager: entering and leaving it
    costs a fifth as much (it wraps every files call, small writes included).
    """

    __slots__ = ("_path",)

    def __init__(self, path: str | None = None) -> None:
        self._path = path

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, OSError):
            raise from_oserror(exc, self._path) from None


def _read_unit(
    fd: int, want: int, position: int, hasher: hashlib._Hash | None, size: int = -1
) -> tuple[bytes, bool]:
    """Up to ``want`` bytes at ``position``, and whether the end of the file was seen.

    A short read is followed by another at once, in the same worker-thread
    unit: for a regular file it comes back empty and proves the end (the
    common case costs no further trip to a thread); a pseudo-file that hands
    out its content piecemeal is read on until ``want`` bytes or its end.
    ``size``: the ``st_size`` of a regular file on a local filesystem, whose
    reads come up short only at its end: a short read that stops exactly
    there is the end, without the read that would come back empty.
    """
    pieces: list[bytes] = []
    got = 0
    while got < want:
        data = fsops.read_block(fd, want - got, position + got, hasher)
        if not data:
            return b"".join(pieces), True
        pieces.append(data)
        got += len(data)
        if got < want and position + got == size:
            break
    return pieces[0] if len(pieces) == 1 else b"".join(pieces), got < want


def _write_whole(
    sink: fsops.FileSink, data: bytes, expected_size: int | None, *, opened: bool = False
) -> None:
    """Open (unless ``opened``), fill and commit ``sink`` with ``data``: one unit."""
    if not opened:
        sink.open()
    if expected_size is not None:
        sink.preallocate(expected_size)
    if data:
        sink.write(data)
    sink.commit()


def _free_replaced(sink: fsops.FileSink) -> None:
    """Close the file a committed atomic write replaced once the call is answered.

    Its last close frees it (on ext4 ~0.1 ms for a small file, which the
    rename itself would otherwise spend before the answer): the answer is
    written before the event loop runs what is scheduled now.
    """
    replaced = sink.take_replaced()
    if replaced is not None:
        asyncio.get_running_loop().call_soon(_close_quietly, replaced)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


async def _abandon(ahead: asyncio.Future[Any]) -> None:
    """Stop a read ahead nobody will use; its unit is released as a cancelled one is."""
    ahead.cancel()
    await asyncio.wait([ahead])
    if not ahead.cancelled():
        ahead.exception()  # retrieved: nobody wants the block


async def _close_stream(stream: AsyncIterator[bytes]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class _RangeRead:
    """One ``files.read`` of a byte range: the units that read it, and where the blocks go.

    Theory of operation. Blocks come one unit at a time (:meth:`_next_unit`):
    on the event loop while the file is small and local (``inline``), else in
    a worker thread. A streamed read sends each block as it comes while the
    worker reads the next one ahead (:meth:`_stream`). Otherwise blocks are
    held for the inline result (:meth:`_hold`) until they outgrow the inline
    limit (the file grew, or it is a pseudo-file): the read then switches to
    streaming and sends what it held. The stream is ended by its last block,
    or by an empty chunk when the end came without one.
    """

    __slots__ = (
        "ahead",
        "ctx",
        "ended",
        "fd",
        "hasher",
        "held",
        "hit_eof",
        "inline",
        "inline_limit",
        "params",
        "position",
        "size",
        "streaming",
        "total",
        "work",
    )

    def __init__(
        self, work: Work, inline: bool, fd: int, size: int, params: ReadParams, ctx: CallContext
    ) -> None:
        available = max(size - params.offset, 0)
        expected = available if params.length is None else min(params.length, available)
        if params.max_bytes is not None and expected > params.max_bytes:
            raise TooLarge(
                f"{expected} bytes requested, more than max_bytes={params.max_bytes}",
                {"size": expected, "max_bytes": params.max_bytes},
            )
        inline_limit = max(ctx.max_chunk - REPLY_OVERHEAD, 0)
        if params.inline_max is not None:
            inline_limit = min(inline_limit, params.inline_max)
        self.work, self.inline, self.fd, self.size = work, inline, fd, size
        self.params, self.ctx = params, ctx
        self.inline_limit = inline_limit
        self.streaming = params.stream or expected > inline_limit
        self.hasher = hashlib.sha256() if params.checksum else None
        self.held: list[bytes] = []
        self.total = 0
        self.position = params.offset
        self.hit_eof = False
        self.ended = False
        #: The next block, being read by a worker while the last one is sent.
        self.ahead: asyncio.Future[tuple[bytes, bool]] | None = None

    async def run(self) -> ReadResult:
        """Read the range; stream or hold its blocks; the call's result."""
        try:
            while True:
                ahead = self.ahead
                if ahead is not None:
                    self.ahead = None
                    block, at_end = await ahead
                else:
                    unit = self._next_unit()
                    if unit is None:
                        break
                    here, want = unit
                    if here:
                        block, at_end = _read_unit(
                            self.fd, want, self.position, self.hasher, self.size
                        )
                    else:
                        block, at_end = await self._in_thread(want)
                if not block:
                    self.hit_eof = True
                    break
                self._count(block, at_end)
                if self.streaming:
                    await self._stream(block, at_end)
                elif self._hold(block):
                    await self._send_held(at_end)
                if at_end:
                    break
        finally:
            if self.ahead is not None:
                await _abandon(self.ahead)
        if self.streaming and not self.ended:
            await self.ctx.send(DATA_STREAM, b"", end=True)
        return self._result()

    def _next_unit(self) -> tuple[bool, int] | None:
        """Whether the next read runs inline, and how much it takes (None: the range is done)."""
        want = fsops.BLOCK
        if self.params.length is not None:
            want = min(want, self.params.length - self.total)
        elif self.size > 0 and 0 <= self.size - self.position <= want:
            # The end is expected in this unit: one byte more lets it see the end.
            want = self.size - self.position + 1
        if want <= 0:
            return None
        if self.inline and self.total <= INLINE_READ_MAX:
            # Inline only while the file stays small (it may grow as it is read).
            return True, min(want, INLINE_READ_MAX + 1 - self.total)
        return False, want

    def _in_thread(self, want: int) -> Coroutine[Any, Any, tuple[bytes, bool]]:
        """A unit in a worker thread: ``want`` bytes from the current position."""
        read = functools.partial(_read_unit, self.fd, want, self.position, self.hasher)
        return self.work.run(read)

    def _count(self, block: bytes, at_end: bool) -> None:
        self.hit_eof = at_end
        self.total += len(block)
        self.position += len(block)
        max_bytes = self.params.max_bytes
        if max_bytes is not None and self.total > max_bytes:
            raise TooLarge(
                f"more than max_bytes={max_bytes} bytes to read (the file grew)",
                {"size": self.total, "max_bytes": max_bytes},
            )

    async def _stream(self, block: bytes, at_end: bool) -> None:
        """Send ``block``; meanwhile a worker reads the next one (the last block ends the stream)."""
        unit = None if at_end else self._next_unit()
        if unit is not None and not unit[0]:
            self.ahead = asyncio.ensure_future(self._in_thread(unit[1]))
        await self.ctx.send(DATA_STREAM, block, end=at_end)
        self.ended = at_end

    def _hold(self, block: bytes) -> bool:
        """Keep ``block`` for the inline result; True once the read must stream instead."""
        self.held.append(block)
        return self.total > self.inline_limit

    async def _send_held(self, at_end: bool) -> None:
        self.streaming = True
        held = self.held
        while held:
            piece = held.pop(0)
            self.ended = at_end and not held
            await self.ctx.send(DATA_STREAM, piece, end=self.ended)

    def _result(self) -> ReadResult:
        size, hasher = self.size, self.hasher
        return ReadResult(
            size=size,
            bytes_sent=self.total,
            sha256=hasher.hexdigest() if hasher is not None else None,
            data=None if self.streaming else b"".join(self.held),
            streamed=self.streaming,
            eof=self.hit_eof or (size > 0 and self.position >= size),
        )


class FilesCapability:
    """Handlers of the ``files.*`` methods."""

    def __init__(
        self,
        config: Config,
        pool: WorkerPool | None = None,
        local: LocalFiles | None = None,
        open_files: Budget | None = None,
    ) -> None:
        self._config = config
        self._pool = pool if pool is not None else WorkerPool()
        self._local = local if local is not None else LocalFiles()
        self._open_files = (
            open_files if open_files is not None else budget.open_files(config.limits)
        )

    async def close(self) -> None:
        """Nothing to wait for: every call releases what it holds (see the module docstring)."""

    def methods(self) -> list[Method]:
        """The dispatch table entries of this capability."""
        return bind(self, rpc.RPCS, direct=(rpc.READ, rpc.WRITE))

    def _work(self, ctx: CallContext, descriptors: int = 0) -> Work:
        """The blocking units of one call, in its connection's share of the pool.

        ``descriptors``: how many the call may hold open; they are taken from
        the open-files budget (LIMIT_EXCEEDED when it has no room) and given
        back once no unit of the call runs any more.
        """
        work = Work(self._pool, ctx.connection_id)
        if descriptors:
            # A call with a request id runs on its connection's virtual one: the same share.
            work.release(self._open_files.take(abs(ctx.connection_id), descriptors))
        return work

    # -- read ----------------------------------------------------------------------

    async def files_read(self, params: ReadParams, ctx: CallContext) -> ReadResult:
        """Read a byte range of a regular file, inline or on the ``data`` stream.

        The content is inline in the result when it fits one reply frame
        (at most ``max_chunk - REPLY_OVERHEAD`` bytes, and at most
        ``inline_max`` when the client sets it) and streaming was not
        requested; otherwise it is sent on the ``data`` stream in blocks
        (waiting for flow-control credit), ended with an empty final chunk. If
        the file turns out longer than its size said (it grew, or it is a
        pseudo-file), an inline read switches to streaming.
        """
        path = fsops.check_path(params.path)
        async with self._work(ctx, 1) as work:
            try:
                trusted = self._local.trusted(path)
                if trusted:
                    fd, info = fsops.open_for_read(path)
                else:
                    fd, info = await work.run(
                        functools.partial(fsops.open_for_read, path), discard=_close_opened
                    )
                work.release(os.close, fd)
                # A small file on a local filesystem is read on the event loop.
                inline = (
                    self._local.note(path, info.st_dev, trusted=trusted)
                    and info.st_size <= INLINE_READ_MAX
                )
                return await _RangeRead(work, inline, fd, info.st_size, params, ctx).run()
            except OSError as exc:
                raise from_oserror(exc, path) from None

    # -- write ---------------------------------------------------------------------

    async def files_write(self, params: WriteParams, ctx: CallContext) -> WriteResult:
        """Write inline ``data`` or the client's ``data`` stream to a regular file.

        Atomic mode (the default) never leaves a torn target: the content goes
        to a temporary file beside it that is renamed over it only once all
        bytes are on disk; any failure or cancellation removes the temporary.
        """
        path = fsops.check_path(params.path)
        if params.append and params.atomic:
            raise InvalidParams("append and atomic are exclusive: pass atomic=false to append")
        if params.stream and params.data is not None:
            raise InvalidParams("data and stream=true are exclusive")
        if not params.stream and params.data is None:
            raise InvalidParams("either data or stream=true is required")
        if (
            params.data is not None
            and params.expected_size is not None
            and len(params.data) != params.expected_size
        ):
            raise InvalidParams(
                f"data holds {len(params.data)} bytes, expected_size is {params.expected_size}"
            )
        trusted = self._local.trusted(path)
        sink = fsops.FileSink(
            path,
            atomic=params.atomic,
            append=params.append,
            mode=params.mode,
            create_parents=params.create_parents,
            checksum=params.checksum,
            durable=params.durable,
            # A local file it replaces is freed after the answer (see _free_replaced).
            keep_replaced=trusted,
        )
        async with self._work(ctx, 2) as work:
            # Once committed this does nothing; otherwise it removes the temporary.
            work.release(sink.abort)
            with _typed_errors(path):
                if params.data is not None:
                    await self._write_inline_data(work, sink, path, params, trusted)
                    _free_replaced(sink)
                    return WriteResult(
                        size=sink.size, sha256=sink.hexdigest() if params.checksum else None
                    )
                await work.run(sink.open)
                if params.expected_size is not None:
                    await work.run(functools.partial(sink.preallocate, params.expected_size))
                await self._write_stream(work, sink, params.expected_size, ctx)
                if params.expected_size is not None and sink.size != params.expected_size:
                    raise StreamError(
                        f"stream carried {sink.size} bytes, expected_size is "
                        f"{params.expected_size}",
                        {"expected_size": params.expected_size, "received": sink.size},
                    )
                await work.run(sink.commit)
                _free_replaced(sink)
        return WriteResult(size=sink.size, sha256=sink.hexdigest() if params.checksum else None)

    async def _write_inline_data(
        self, work: Work, sink: fsops.FileSink, path: str, params: WriteParams, trusted: bool
    ) -> None:
        """Write the content that came in the call itself (at most one frame).

        Small content to a local filesystem is written on the event loop (see
        :mod:`execd.local_fs`): in plain mode always, in atomic mode (fsync and
        rename) while the worker pool is idle and fsyncs are quick; anything
        else in one trip to a thread.
        """
        data = params.data
        assert data is not None
        if trusted and self._inline_write(params, len(data)):
            started = time.monotonic()
            sink.open()
            if self._local.note(path, sink.device, trusted=True):
                _write_whole(sink, data, params.expected_size, opened=True)
                if params.atomic:
                    self._local.synced(time.monotonic() - started)
                return
        await work.run(
            functools.partial(
                _write_whole, sink, data, params.expected_size, opened=sink.device is not None
            )
        )
        self._local.note(path, sink.device)

    def _inline_write(self, params: WriteParams, size: int) -> bool:
        """Whether inline content of ``size`` bytes may be written on the loop (a local file)."""
        if params.durable:
            return False  # two fsyncs, the second a journal commit: always the thread
        if not params.atomic:
            return size <= INLINE_MAX
        return size <= SYNC_INLINE_MAX and self._pool.idle and self._local.syncs_inline()

    async def _write_stream(
        self, work: Work, sink: fsops.FileSink, expected_size: int | None, ctx: CallContext
    ) -> None:
        stream = ctx.receive(DATA_STREAM)
        pending = bytearray()
        received = 0
        try:
            async for chunk in stream:
                received += len(chunk)
                if expected_size is not None and received > expected_size:
                    raise StreamError(
                        f"stream carried more than expected_size={expected_size} bytes",
                        {"expected_size": expected_size, "received": received},
                    )
                if not pending and len(chunk) >= fsops.BLOCK:
                    # A whole block already: write it as it is, without a copy.
                    await work.run(functools.partial(sink.write, chunk))
                    continue
                pending += chunk
                if len(pending) >= fsops.BLOCK:
                    block, pending = pending, bytearray()
                    await work.run(functools.partial(sink.write, block))
        finally:
            await _close_stream(stream)
        if pending:
            await work.run(functools.partial(sink.write, pending))

    # -- metadata ------------------------------------------------------------------

    async def files_stat(self, params: StatParams, ctx: CallContext) -> StatResult:
        """Type, size, permission bits, mtime, owner and link target of a path."""
        path = fsops.check_path(params.path)
        async with self._work(ctx) as work:
            with _typed_errors(path):
                return await work.run(
                    functools.partial(fsops.stat_path, path, params.follow_symlinks)
                )

    async def files_list(self, params: ListParams, ctx: CallContext) -> ListResult:
        """List a directory, optionally recursively, without following symlinks.

        At most ``limit`` entries (never more than the configured
        ``max_list_entries``), and never more than fit in one reply frame;
        ``truncated`` tells when entries were left out.
        """
        path = fsops.check_path(params.path)
        ceiling = self._config.limits.max_list_entries
        limit = ceiling if params.limit is None else min(params.limit, ceiling)
        room = max(result_budget(ctx) - LIST_OVERHEAD, result_budget(ctx) // 2)
        async with self._work(ctx, 1) as work:
            with _typed_errors(path):
                return await work.run_interruptible(
                    functools.partial(
                        fsops.list_directory,
                        path,
                        recursive=params.recursive,
                        limit=limit,
                        include_hidden=params.include_hidden,
                        byte_budget=room,
                    )
                )

    async def files_mkdir(self, params: MkdirParams, ctx: CallContext) -> MkdirResult:
        """Create a directory; ``created`` is false if it already existed."""
        path = fsops.check_path(params.path)
        async with self._work(ctx) as work:
            with _typed_errors(path):
                created = await work.run(
                    functools.partial(
                        fsops.make_directory, path, params.parents, params.exist_ok, params.mode
                    )
                )
        return MkdirResult(created=created)

    async def files_remove(self, params: RemoveParams, ctx: CallContext) -> RemoveResult:
        """Remove a path; a non-empty directory needs ``recursive`` (else NotEmpty)."""
        path = fsops.check_path(params.path)
        async with self._work(ctx, 1) as work:
            with _typed_errors():
                removed = await work.run(
                    functools.partial(fsops.remove_path, path, params.recursive, params.missing_ok)
                )
        return RemoveResult(removed=removed)

    async def files_move(self, params: MoveParams, ctx: CallContext) -> MoveResult:
        """Rename ``src`` to ``dst``, copying across filesystems (see ``fsops.move_path``)."""
        src = fsops.check_path(params.src)
        dst = fsops.check_path(params.dst)
        async with self._work(ctx, 2) as work:
            with _typed_errors():
                copied = await work.run_interruptible(
                    functools.partial(fsops.move_path, src, dst, params.overwrite)
                )
        return MoveResult(copied=copied)

    async def files_chmod(self, params: ChmodParams, ctx: CallContext) -> ChmodResult:
        """Set the permission bits of a path."""
        path = fsops.check_path(params.path)
        async with self._work(ctx) as work:
            with _typed_errors(path):
                mode = await work.run(functools.partial(fsops.change_mode, path, params.mode))
        return ChmodResult(mode=mode)

    async def files_sha256(self, params: Sha256Params, ctx: CallContext) -> Sha256Result:
        """SHA-256 of a regular file's content, hashed block by block."""
        path = fsops.check_path(params.path)
        hasher = hashlib.sha256()
        total = 0
        async with self._work(ctx, 1) as work:
            with _typed_errors(path):
                fd, _ = await work.run(
                    functools.partial(fsops.open_for_read, path), discard=_close_opened
                )
                work.release(os.close, fd)
                while True:
                    count = await work.run(functools.partial(fsops.hash_block, fd, total, hasher))
                    if count == 0:
                        break
                    total += count
        return Sha256Result(sha256=hasher.hexdigest(), size=total)
