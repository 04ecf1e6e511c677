"""The session ledger on disk: file layout, durable appends and crash recovery.

Everything here blocks; :mod:`execd.ledger` calls it from worker threads and
serializes the writers of one session.

Layout
------

The ledgers live in ``config.ledger_dir`` (exported to workspace processes as
``$EXECD_LEDGER_DIR``). A session ``S`` (1..128 characters of
``[A-Za-z0-9_.-]``) has two files there; every integer is big-endian:

``S.ledger``, the data file::

    offset 0   8 bytes   magic b"XLEDGER1"
    offset 8   records of seq 1, 2, 3, ... back to back, each:
               +0   8 bytes   payload length L (u64)
               +8   8 bytes   seq (u64)
               +16  32 bytes  entry hash (protocol.ledger_chain.entry_hash)
               +48  L bytes   payload (opaque; the harness stores msgpack)

``S.index``, the index: one u64 per entry, the data-file offset of the
record of seq N at byte ``(N - 1) * 8``; its length is ``8 * head.seq``.

To read entry N a reader takes the offset at ``(N - 1) * 8`` of the index and
reads the 48-byte header there, then the payload. Readers (tools in the
workspace) must only read: both files are appended to by execd, and only
entries up to ``index size / 8`` are committed. The data file may hold a torn
record past the last indexed one while an append is in flight or after a
crash.

Durability
----------

An append (a batch of entries, or one large entry) is acknowledged only after:
its records are written past the end of the data file, the data file is
``fdatasync``-ed, its index entries are written, and the index is
``fdatasync``-ed. File creation syncs the directory (and its parent when the
directory was created). So the index never names a record that is not
durable, and a crash at any point loses at most the unacknowledged append.
A failed append truncates both files back to the previous head.

Recovery at open
----------------

The head is kept in memory and rebuilt when a ledger is opened, from the tail
only (the cost does not depend on the ledger's size): starting from the last
complete index slot, execd walks back to the newest indexed record that lies
inside the data file, follows its predecessor without a gap, carries the
expected seq and whose hash verifies against its payload and its
predecessor's hash. Complete, chain-verified records after it that the index
does not name yet (written, but the append did not finish) are then indexed.
The data file is truncated after the last good record and the index to its
seq. Opening therefore reads the last record's payload; only that one
payload, whatever the ledger's size.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
from dataclasses import dataclass

from execd.errors import InvalidParams, LedgerConflict, LedgerCorrupt
from protocol.ledger_chain import GENESIS_HASH, EntryHasher, chain_hashes
from protocol.rpc.ledger import RECORD_HEADER, RECORD_HEADER_SIZE, encode_record_header

logger = logging.getLogger(__name__)

MAGIC = b"XLEDGER1"
"""The first 8 bytes of every data file."""

DATA_SUFFIX = ".ledger"
INDEX_SUFFIX = ".index"

_SLOT = struct.Struct(">Q")
_SLOT_SIZE = _SLOT.size
_PIECE = 1 << 20
_IOV_MAX = 1024
_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW


@dataclass(frozen=True, slots=True)
class Head:
    """The last committed entry: its seq (0 when empty) and hash."""

    seq: int
    hash: bytes

    def as_data(self) -> dict[str, object]:
        """The head as the ``data`` of a conflict error."""
        return {"seq": self.seq, "hash": self.hash}


EMPTY_HEAD = Head(0, GENESIS_HASH)


def data_path(directory: str, session: str) -> str:
    """Where the records of ``session`` live."""
    return os.path.join(directory, session + DATA_SUFFIX)


def index_path(directory: str, session: str) -> str:
    """Where the index of ``session`` lives."""
    return os.path.join(directory, session + INDEX_SUFFIX)


def _hash_mismatch(seq: int, computed: bytes) -> InvalidParams:
    return InvalidParams(
        f"entry {seq}: the given hash differs from the computed one",
        {"seq": seq, "hash": computed},
    )


# -- low-level helpers -------------------------------------------------------------


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    """Read ``size`` bytes at ``offset``; fewer only at end of file."""
    parts: list[bytes] = []
    while size:
        part = os.pread(fd, size, offset)
        if not part:
            break
        parts.append(part)
        size -= len(part)
        offset += len(part)
    return b"".join(parts)


def _pwrite_all(fd: int, buffers: list[bytes], offset: int) -> int:
    """Write every buffer back to back at ``offset``; return the end offset."""
    views = [memoryview(buffer) for buffer in buffers if buffer]
    first = 0
    while first < len(views):
        written = os.pwritev(fd, views[first : first + _IOV_MAX], offset)
        if written <= 0:
            raise OSError(5, "short write", None)
        offset += written
        while written:
            size = len(views[first])
            if written >= size:
                written -= size
                first += 1
            else:
                views[first] = views[first][written:]
                written = 0
    return offset


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class _Record:
    offset: int
    length: int
    seq: int
    hash: bytes

    @property
    def end(self) -> int:
        return self.offset + RECORD_HEADER_SIZE + self.length


class _Files:
    """The two open descriptors of one ledger and read helpers over them."""

    def __init__(self, data_fd: int, index_fd: int) -> None:
        self.data_fd = data_fd
        self.index_fd = index_fd

    def close(self) -> None:
        for fd in (self.data_fd, self.index_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def slot(self, seq: int) -> int | None:
        """The data offset the index gives for ``seq``, or None past its end."""
        raw = _pread_exact(self.index_fd, _SLOT_SIZE, (seq - 1) * _SLOT_SIZE)
        if len(raw) != _SLOT_SIZE:
            return None
        offset: int = _SLOT.unpack(raw)[0]
        return offset

    def record(self, offset: int, data_size: int) -> _Record | None:
        """The record whose header is at ``offset`` if it lies wholly in the file."""
        if offset < len(MAGIC) or offset + RECORD_HEADER_SIZE > data_size:
            return None
        raw = _pread_exact(self.data_fd, RECORD_HEADER_SIZE, offset)
        if len(raw) != RECORD_HEADER_SIZE:
            return None
        length, seq, digest = RECORD_HEADER.unpack(raw)
        record = _Record(offset, length, seq, digest)
        return record if record.end <= data_size else None

    def payload_hash(self, prev_hash: bytes, record: _Record) -> bytes:
        """Recompute ``record``'s entry hash from its payload, in bounded pieces."""
        hasher = EntryHasher(prev_hash, record.seq, record.length)
        position = record.offset + RECORD_HEADER_SIZE
        while hasher.remaining:
            piece = _pread_exact(self.data_fd, min(_PIECE, hasher.remaining), position)
            if not piece:
                raise LedgerCorrupt("ledger data file shrank while being verified")
            hasher.update(piece)
            position += len(piece)
        return hasher.digest()


# -- the writer --------------------------------------------------------------------


class LedgerFile:
    """One session's ledger, open for appending. Every method blocks.

    ``head`` is replaced (never mutated) when an append commits, so the event
    loop may read it at any time; all other methods must be serialized by the
    caller.
    """

    def __init__(self, directory: str, session: str) -> None:
        self.directory = directory
        self.session = session
        self.head: Head = EMPTY_HEAD
        self._end = len(MAGIC)
        self._files: _Files | None = None

    @classmethod
    def open(cls, directory: str, session: str) -> LedgerFile:
        """Open (and recover) the ledger of ``session``; creates nothing if it has none."""
        ledger = cls(directory, session)
        ledger._recover()
        return ledger

    def close(self) -> None:
        """Release the descriptors; the object must not be used afterwards."""
        if self._files is not None:
            self._files.close()
            self._files = None

    def check_continues(self, first_seq: int, prev_hash: bytes) -> None:
        """Raise :class:`LedgerConflict` unless the head is (first_seq - 1, prev_hash)."""
        head = self.head
        if first_seq != head.seq + 1 or prev_hash != head.hash:
            if first_seq == head.seq + 1:
                reason = f"prev_hash is not the hash of seq {head.seq}"
            else:
                reason = f"append must start at seq {head.seq + 1}, not {first_seq}"
            raise LedgerConflict(f"ledger {self.session}: {reason}", head.as_data())

    # -- appends --

    def append(
        self,
        first_seq: int,
        prev_hash: bytes,
        payloads: list[bytes],
        expected: list[bytes] | None = None,
    ) -> list[bytes]:
        """Durably append ``payloads`` as seqs ``first_seq ..``; return their hashes.

        Raises :class:`LedgerConflict` unless the batch continues the head, and
        :class:`InvalidParams` if ``expected`` (the caller's hashes) differs
        from the computed hashes; nothing is written then.
        """
        self.check_continues(first_seq, prev_hash)
        hashes = chain_hashes(prev_hash, first_seq, payloads)
        if expected is not None:
            if len(expected) != len(payloads):
                raise InvalidParams(
                    f"{len(expected)} hashes given for {len(payloads)} entries",
                    {"entries": len(payloads), "hashes": len(expected)},
                )
            for index, (mine, theirs) in enumerate(zip(hashes, expected, strict=True)):
                if mine != theirs:
                    raise _hash_mismatch(first_seq + index, mine)
        if not payloads:
            return hashes
        files = self._writable()
        buffers: list[bytes] = []
        slots: list[bytes] = []
        offset = self._end
        for index, payload in enumerate(payloads):
            buffers.append(encode_record_header(first_seq + index, hashes[index], len(payload)))
            buffers.append(payload)
            slots.append(_SLOT.pack(offset))
            offset += RECORD_HEADER_SIZE + len(payload)
        self._commit(files, first_seq, buffers, b"".join(slots), offset, hashes[-1])
        return hashes

    def start_large(self, seq: int, prev_hash: bytes, size: int) -> LargeEntryWriter:
        """Begin writing one entry of ``size`` bytes as ``seq``; see :class:`LargeEntryWriter`."""
        self.check_continues(seq, prev_hash)
        return LargeEntryWriter(self, self._writable(), seq, prev_hash, size)

    def _commit(
        self,
        files: _Files,
        first_seq: int,
        buffers: list[bytes],
        slots: bytes,
        new_end: int,
        new_hash: bytes,
    ) -> None:
        """Write records at the end of the data, sync, index them, sync, move the head."""
        start = self._end
        try:
            _pwrite_all(files.data_fd, buffers, start)
            os.fdatasync(files.data_fd)
            _pwrite_all(files.index_fd, [slots], (first_seq - 1) * _SLOT_SIZE)
            os.fdatasync(files.index_fd)
        except BaseException:
            self.rollback(files)
            raise
        self._end = new_end
        self.head = Head(first_seq - 1 + len(slots) // _SLOT_SIZE, new_hash)

    def rollback(self, files: _Files) -> None:
        """Best effort: cut both files back to the committed head."""
        with contextlib.suppress(OSError):
            os.ftruncate(files.data_fd, self._end)
        with contextlib.suppress(OSError):
            os.ftruncate(files.index_fd, self.head.seq * _SLOT_SIZE)

    # -- creation and recovery --

    def _writable(self) -> _Files:
        if self._files is None:
            self._files = self._create()
        return self._files

    def _create(self) -> _Files:
        """Create an empty ledger (magic only) and make its existence durable."""
        parent = os.path.dirname(os.path.abspath(self.directory))
        created_dir = not os.path.isdir(self.directory)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        if created_dir:
            _fsync_dir(parent)
        flags = os.O_RDWR | os.O_CREAT | _OPEN_FLAGS
        index_fd = os.open(index_path(self.directory, self.session), flags, 0o600)
        try:
            data_fd = os.open(data_path(self.directory, self.session), flags, 0o600)
        except BaseException:
            os.close(index_fd)
            raise
        files = _Files(data_fd, index_fd)
        try:
            os.ftruncate(index_fd, 0)
            os.fdatasync(index_fd)
            os.ftruncate(data_fd, 0)
            _pwrite_all(data_fd, [MAGIC], 0)
            os.fdatasync(data_fd)
            _fsync_dir(self.directory)
        except BaseException:
            files.close()
            raise
        self._end = len(MAGIC)
        self.head = EMPTY_HEAD
        return files

    def _recover(self) -> None:
        """Open existing files and rebuild the head from the tail (see the module doc)."""
        flags = os.O_RDWR | _OPEN_FLAGS
        try:
            data_fd = os.open(data_path(self.directory, self.session), flags)
        except FileNotFoundError:
            return
        try:
            index_fd = os.open(index_path(self.directory, self.session), flags | os.O_CREAT, 0o600)
        except BaseException:
            os.close(data_fd)
            raise
        files = _Files(data_fd, index_fd)
        try:
            data_size = os.fstat(data_fd).st_size
            magic = _pread_exact(data_fd, len(MAGIC), 0)
            if magic != MAGIC:
                if data_size < len(MAGIC) and MAGIC.startswith(magic):
                    files.close()
                    self._files = self._create()
                    return
                raise LedgerCorrupt(f"ledger {self.session}: data file has no ledger magic")
            self._rebuild(files, data_size)
        except BaseException:
            files.close()
            raise
        self._files = files

    def _rebuild(self, files: _Files, data_size: int) -> None:
        index_size = os.fstat(files.index_fd).st_size
        seq = index_size // _SLOT_SIZE
        tail: tuple[int, bytes] | None = None
        while seq > 0:
            tail = self._verify_indexed(files, seq, data_size)
            if tail is not None:
                break
            seq -= 1
        end, digest = tail if tail is not None else (len(MAGIC), GENESIS_HASH)

        slots: list[bytes] = []
        while True:
            record = files.record(end, data_size)
            if record is None or record.seq != seq + 1:
                break
            if files.payload_hash(digest, record) != record.hash:
                break
            slots.append(_SLOT.pack(end))
            seq, end, digest = record.seq, record.end, record.hash

        if data_size != end:
            logger.warning(
                "ledger %s: dropped %d bytes of torn tail after seq %d",
                self.session,
                data_size - end,
                seq,
            )
            os.ftruncate(files.data_fd, end)
        if slots or data_size != end:
            os.fdatasync(files.data_fd)
        if slots:
            logger.warning("ledger %s: indexed %d unindexed records", self.session, len(slots))
            first = seq - len(slots) + 1
            _pwrite_all(files.index_fd, [b"".join(slots)], (first - 1) * _SLOT_SIZE)
        if index_size != seq * _SLOT_SIZE or slots:
            os.ftruncate(files.index_fd, seq * _SLOT_SIZE)
            os.fdatasync(files.index_fd)
        self._end = end
        self.head = Head(seq, digest)

    @staticmethod
    def _verify_indexed(files: _Files, seq: int, data_size: int) -> tuple[int, bytes] | None:
        """(end, hash) of indexed record ``seq`` if it is complete and chains; else None."""
        offset = files.slot(seq)
        record = files.record(offset, data_size) if offset is not None else None
        if record is None or record.seq != seq:
            return None
        if seq == 1:
            if record.offset != len(MAGIC):
                return None
            prev_hash = GENESIS_HASH
        else:
            prev_offset = files.slot(seq - 1)
            prev = files.record(prev_offset, data_size) if prev_offset is not None else None
            if prev is None or prev.seq != seq - 1 or prev.end != record.offset:
                return None
            prev_hash = prev.hash
        if files.payload_hash(prev_hash, record) != record.hash:
            return None
        return record.end, record.hash


class LargeEntryWriter:
    """Writes one entry piece by piece past the end of the data, then commits it.

    The payload goes first, at ``end + 48``; the header is written only at
    commit, after the payload's size and SHA-256 have been checked, followed by
    the same sync-then-index sequence as any append. Until then the bytes are
    an unindexed torn tail: :meth:`abort` (or recovery after a crash) cuts them.
    """

    def __init__(
        self, ledger: LedgerFile, files: _Files, seq: int, prev_hash: bytes, size: int
    ) -> None:
        self._ledger = ledger
        self._files = files
        self._seq = seq
        self._start = ledger._end
        self._position = self._start + RECORD_HEADER_SIZE
        self._hasher = EntryHasher(prev_hash, seq, size)
        self._sha256 = hashlib.sha256()
        self._size = size
        self.committed = False

    @property
    def remaining(self) -> int:
        """Payload bytes not received yet."""
        return self._hasher.remaining

    def write(self, data: bytes) -> None:
        """Write the next piece of the payload."""
        self._hasher.update(data)
        self._sha256.update(data)
        self._position = _pwrite_all(self._files.data_fd, [data], self._position)

    def commit(self, sha256: bytes, expected_hash: bytes | None) -> bytes:
        """Check the payload, make the entry durable and move the head; return its hash.

        Raises :class:`InvalidParams` when the payload is short, its SHA-256
        differs from ``sha256`` or its entry hash from ``expected_hash``.
        """
        if self._hasher.remaining:
            raise InvalidParams(
                f"entry {self._seq}: payload ended {self._hasher.remaining} bytes short",
                {"size": self._size, "received": self._size - self._hasher.remaining},
            )
        if self._sha256.digest() != sha256:
            raise InvalidParams(f"entry {self._seq}: payload sha256 does not match")
        digest = self._hasher.digest()
        if expected_hash is not None and expected_hash != digest:
            raise _hash_mismatch(self._seq, digest)
        header = encode_record_header(self._seq, digest, self._size)
        ledger, files = self._ledger, self._files
        try:
            _pwrite_all(files.data_fd, [header], self._start)
        except BaseException:
            ledger.rollback(files)
            raise
        ledger._commit(files, self._seq, [], _SLOT.pack(self._start), self._position, digest)
        self.committed = True
        return digest

    def abort(self) -> None:
        """Drop whatever was written, unless the entry was committed."""
        if not self.committed:
            self._ledger.rollback(self._files)


# -- the reader --------------------------------------------------------------------


class LedgerReader:
    """A read-only view of a ledger with its own descriptors. Every method blocks.

    It never changes the files, so it may run while the writer appends; it
    must only be asked for seqs up to a head that was already committed.
    """

    def __init__(self, directory: str, session: str) -> None:
        flags = os.O_RDONLY | _OPEN_FLAGS
        data_fd = os.open(data_path(directory, session), flags)
        try:
            index_fd = os.open(index_path(directory, session), flags)
        except BaseException:
            os.close(data_fd)
            raise
        self._files = _Files(data_fd, index_fd)
        self._session = session

    def close(self) -> None:
        """Release the descriptors."""
        self._files.close()

    def span(self, first_seq: int, last_seq: int) -> tuple[int, int]:
        """The data-file byte range holding the records ``first_seq .. last_seq``."""
        data_size = os.fstat(self._files.data_fd).st_size
        first = self._indexed(first_seq, data_size)
        last = first if last_seq == first_seq else self._indexed(last_seq, data_size)
        if last.offset < first.offset:
            raise LedgerCorrupt(f"ledger {self._session}: index is not increasing")
        return first.offset, last.end

    def read(self, offset: int, size: int) -> bytes:
        """Exactly ``size`` bytes of the data file at ``offset``."""
        data = _pread_exact(self._files.data_fd, size, offset)
        if len(data) != size:
            raise LedgerCorrupt(f"ledger {self._session}: data file is shorter than its index")
        return data

    def _indexed(self, seq: int, data_size: int) -> _Record:
        offset = self._files.slot(seq)
        record = self._files.record(offset, data_size) if offset is not None else None
        if record is None or record.seq != seq:
            raise LedgerCorrupt(f"ledger {self._session}: index entry {seq} is invalid")
        return record
