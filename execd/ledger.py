"""The ``ledger`` capability: per-session append-only, hash-chained histories.

The harness keeps each agent session's history as a ledger and syncs it here
after every turn; tools in the workspace read the files (layout, durability
and recovery: :mod:`execd.ledger_store`; method semantics and the ``entries``
stream framing: :mod:`protocol.rpc.ledger`; the hash chain:
:mod:`protocol.ledger_chain`).

Theory of operation. :class:`LedgerStore` keeps one slot per session it has
touched: an ``asyncio.Lock`` and the open :class:`~execd.ledger_store.LedgerFile`.
Every operation on a session takes its slot's lock to open (and recover) the
ledger on first use; appends keep the lock until they are durable, so the
appends of one session are serialized while sessions proceed independently.
Reads take the lock only to snapshot the head, then stream committed records
through their own read-only descriptors, so a slow reader never holds up the
writer. All file I/O runs in worker threads; a blocking job, once started, is
always waited for (a cancelled caller re-raises the cancellation only after
the job finished), so the lock is never released while a thread still writes
and the in-memory head always matches the disk. At most ``max_open`` slots
stay open; idle ones (no holder, no waiter) are closed least recently used
first and reopened, with tail recovery, on next use, and a ledger that would
be one more open than that while all are in use is refused (LIMIT_EXCEEDED).
A read's own descriptors are held against execd's open-files budget
(:mod:`execd.budget`) for as long as it streams.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from execd import budget
from execd.budget import LEDGERS_OPEN, Budget
from execd.config import Config
from execd.context import CallContext, Method, bind
from execd.errors import EntryTooLarge, LimitExceeded, ShuttingDown, from_oserror
from execd.fit import fit_list, result_budget
from execd.ledger_store import (
    DATA_SUFFIX,
    Head,
    LargeEntryWriter,
    LedgerFile,
    LedgerReader,
)
from protocol.rpc import ledger as rpc
from protocol.rpc.ledger import (
    AppendLargeParams,
    AppendParams,
    HeadParams,
    LedgerHead,
    LedgerInfo,
    ListParams,
    ListResult,
    ReadParams,
    ReadResult,
)

__all__ = ["LedgerCapability", "LedgerStore", "ReadOutcome"]

_P = ParamSpec("_P")
_T = TypeVar("_T")

_LIST_FIELDS = 32
"""Room for the fields of a list result beside its sessions."""

READ_PIECE = 1 << 20
"""Bytes read from disk (and handed to the stream) at a time by ``ledger.read``."""

WRITE_PIECE = 1 << 20
"""Bytes of a large entry buffered before they are written."""

_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


async def _blocking(fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Run ``fn`` in a worker thread and wait for it to finish, even when cancelled.

    A cancellation that arrives meanwhile is re-raised once the job is done,
    so callers holding a lock never release it under a running writer.
    ``OSError`` becomes the matching typed :class:`~execd.errors.FileError`.
    """
    job = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    cancelled = False
    while not job.done():
        try:
            await asyncio.wait({job})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        job.exception()
        raise asyncio.CancelledError
    try:
        return job.result()
    except OSError as exc:
        raise from_oserror(exc) from exc


def _valid_name(session: str) -> bool:
    return 1 <= len(session) <= 128 and all(char in _NAME_CHARS for char in session)


class _Slot:
    __slots__ = ("file", "lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.file: LedgerFile | None = None
        self.users = 0


@dataclass(slots=True, eq=False)
class ReadOutcome:
    """What :meth:`LedgerStore.read` streamed."""

    last_seq: int
    count: int
    head: Head


class LedgerStore:
    """All ledgers under one directory. Session names are validated by the caller."""

    def __init__(self, directory: str, *, max_open: int = 64, max_list: int = 100_000) -> None:
        self.directory = directory
        self._max_open = max(1, max_open)
        self._max_list = max_list
        self._slots: OrderedDict[str, _Slot] = OrderedDict()
        self._closed = False

    @asynccontextmanager
    async def _ledger(self, session: str) -> AsyncIterator[LedgerFile]:
        """Hold ``session``'s lock with its ledger open."""
        if self._closed:
            raise ShuttingDown("the ledger store is closed")
        slot = self._slots.get(session)
        if slot is None:
            slot = self._slots[session] = _Slot()
        self._slots.move_to_end(session)
        slot.users += 1
        try:
            async with slot.lock:
                if self._closed:
                    raise ShuttingDown("the ledger store is closed")
                if slot.file is None:
                    self._make_room()
                    slot.file = await _blocking(LedgerFile.open, self.directory, session)
                yield slot.file
        finally:
            slot.users -= 1
            self._evict()

    def _make_room(self) -> None:
        """Room for one more open ledger: close the least recently used idle one if all
        ``max_open`` are open, or refuse when every one of them is in use."""
        opened = [(name, slot) for name, slot in self._slots.items() if slot.file is not None]
        if len(opened) < self._max_open:
            return
        for name, slot in opened:
            if slot.users == 0 and slot.file is not None:
                del self._slots[name]
                slot.file.close()
                return
        raise LimitExceeded(
            f"too many ledgers in use at once (limit {self._max_open})",
            {"limit": self._max_open},
        )

    def _evict(self) -> None:
        excess = len(self._slots) - self._max_open
        if excess <= 0:
            return
        idle = [name for name, slot in self._slots.items() if slot.users == 0][:excess]
        for name in idle:
            slot = self._slots.pop(name)
            if slot.file is not None:
                slot.file.close()

    async def head(self, session: str) -> Head:
        """The head of ``session`` (the empty head if it has no ledger)."""
        async with self._ledger(session) as ledger:
            return ledger.head

    async def append(
        self,
        session: str,
        first_seq: int,
        prev_hash: bytes,
        entries: list[bytes],
        hashes: list[bytes] | None = None,
    ) -> Head:
        """Durably append ``entries`` as seqs ``first_seq ..``; return the new head."""
        async with self._ledger(session) as ledger:
            ledger.check_continues(first_seq, prev_hash)
            if entries or hashes:
                await _blocking(ledger.append, first_seq, prev_hash, entries, hashes)
            return ledger.head

    async def append_large(
        self,
        session: str,
        seq: int,
        prev_hash: bytes,
        size: int,
        sha256: bytes,
        chunks: AsyncIterable[bytes],
        expected_hash: bytes | None = None,
    ) -> Head:
        """Append one entry of ``size`` bytes read from ``chunks``; return the new head.

        The payload is written as it arrives, ``WRITE_PIECE`` bytes at a time,
        and committed only if exactly ``size`` bytes came and their SHA-256 is
        ``sha256``. On any failure or cancellation the head is unchanged.
        """
        async with self._ledger(session) as ledger:
            ledger.check_continues(seq, prev_hash)
            writer = await _blocking(ledger.start_large, seq, prev_hash, size)
            try:
                await self._receive_large(writer, size, chunks)
                await _blocking(writer.commit, sha256, expected_hash)
            finally:
                if not writer.committed:
                    await _blocking(writer.abort)
            return ledger.head

    @staticmethod
    async def _receive_large(
        writer: LargeEntryWriter, size: int, chunks: AsyncIterable[bytes]
    ) -> None:
        buffer = bytearray()
        received = 0
        async for chunk in chunks:
            received += len(chunk)
            if received > size:
                raise EntryTooLarge(
                    f"the payload exceeds its declared size of {size} bytes", {"size": size}
                )
            buffer += chunk
            if len(buffer) >= WRITE_PIECE:
                piece = bytes(buffer)
                buffer.clear()
                await _blocking(writer.write, piece)
        if buffer:
            await _blocking(writer.write, bytes(buffer))

    async def read(
        self,
        session: str,
        from_seq: int,
        limit: int | None,
        send: Callable[[bytes], Awaitable[None]],
    ) -> ReadOutcome:
        """Hand the records ``from_seq ..`` (at most ``limit``) to ``send``, in pieces.

        The records are the exact bytes of the data file (the framing of
        :mod:`protocol.rpc.ledger`); the range ends at the head current when the
        read starts.
        """
        async with self._ledger(session) as ledger:
            head = ledger.head
        last = head.seq if limit is None else min(head.seq, from_seq - 1 + limit)
        if last < from_seq:
            return ReadOutcome(from_seq - 1, 0, head)
        reader = await _blocking(LedgerReader, self.directory, session)
        try:
            position, stop = await _blocking(reader.span, from_seq, last)
            while position < stop:
                size = min(READ_PIECE, stop - position)
                await send(await _blocking(reader.read, position, size))
                position += size
        finally:
            reader.close()
        return ReadOutcome(last, last - from_seq + 1, head)

    async def sessions(self) -> tuple[list[tuple[str, Head]], bool]:
        """Every session with a ledger file, sorted, with its head; and whether truncated."""
        names = await _blocking(self._scan)
        truncated = len(names) > self._max_list
        heads: list[tuple[str, Head]] = []
        for name in names[: self._max_list]:
            heads.append((name, await self.head(name)))
        return heads, truncated

    def _scan(self) -> list[str]:
        try:
            entries = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        names = (entry[: -len(DATA_SUFFIX)] for entry in entries if entry.endswith(DATA_SUFFIX))
        return sorted(name for name in names if _valid_name(name))

    async def close(self) -> None:
        """Wait for running appends, then close every ledger; later calls fail."""
        self._closed = True
        for slot in list(self._slots.values()):
            async with slot.lock:
                if slot.file is not None:
                    slot.file.close()
                    slot.file = None
        self._slots.clear()


def _wire(head: Head) -> LedgerHead:
    return LedgerHead(seq=head.seq, hash=head.hash)


class LedgerCapability:
    """The ``ledger.*`` RPC methods over the ledgers in ``config.ledger_dir``."""

    def __init__(self, config: Config, open_files: Budget | None = None) -> None:
        self.store = LedgerStore(
            config.ledger_dir, max_open=LEDGERS_OPEN, max_list=config.limits.max_list_entries
        )
        self._open_files = (
            open_files if open_files is not None else budget.open_files(config.limits)
        )

    def methods(self) -> list[Method]:
        """The dispatch-table entries of this capability."""
        return bind(self, rpc.RPCS)

    async def close(self) -> None:
        """Finish running appends and release every file."""
        await self.store.close()

    async def ledger_append(self, params: AppendParams, ctx: CallContext) -> LedgerHead:
        """``ledger.append``."""
        head = await self.store.append(
            params.session, params.first_seq, params.prev_hash, params.entries, params.hashes
        )
        return _wire(head)

    async def ledger_append_large(self, params: AppendLargeParams, ctx: CallContext) -> LedgerHead:
        """``ledger.append_large``: the payload comes on client stream ``"data"``."""
        head = await self.store.append_large(
            params.session,
            params.seq,
            params.prev_hash,
            params.size,
            params.sha256,
            ctx.receive(rpc.DATA_STREAM),
            params.hash,
        )
        return _wire(head)

    async def ledger_head(self, params: HeadParams, ctx: CallContext) -> LedgerHead:
        """``ledger.head``."""
        return _wire(await self.store.head(params.session))

    async def ledger_read(self, params: ReadParams, ctx: CallContext) -> ReadResult:
        """``ledger.read``: records on stream ``"entries"``, then the stream's end."""

        async def send(data: bytes) -> None:
            await ctx.send(rpc.ENTRIES_STREAM, data)

        # The reader's two descriptors (data and index), held while the records stream.
        give_back = self._open_files.take(abs(ctx.connection_id), 2)
        try:
            outcome = await self.store.read(params.session, params.from_seq, params.limit, send)
        finally:
            give_back()
        await ctx.send(rpc.ENTRIES_STREAM, b"", end=True)
        return ReadResult(last_seq=outcome.last_seq, count=outcome.count, head=_wire(outcome.head))

    async def ledger_list(self, params: ListParams, ctx: CallContext) -> ListResult:
        """``ledger.list``."""
        heads, truncated = await self.store.sessions()
        sessions = [LedgerInfo(session=name, seq=h.seq, hash=h.hash) for name, h in heads]
        # As many as fit the reply frame: ``truncated`` tells the client there are more.
        sessions, cut = fit_list(sessions, result_budget(ctx) - _LIST_FIELDS)
        return ListResult(sessions=sessions, truncated=truncated or cut)
