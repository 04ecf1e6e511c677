"""The ``ledger.*`` methods: schemas, and the record framing of the ``entries`` stream.

A ledger is one agent session's append-only history, hash-chained as
:mod:`protocol.ledger_chain` defines. execd keeps it; the harness appends to it
after every turn and can read it back.

Methods
-------

``ledger.append`` (:class:`AppendParams` -> :class:`LedgerHead`)
    Appends ``entries`` as seqs ``first_seq, first_seq + 1, ...``. Accepted
    only if ``first_seq == head.seq + 1`` and ``prev_hash == head.hash``;
    otherwise the call fails with ``LEDGER_CONFLICT`` (600) and the error's
    ``data`` is the current head ``{"seq": int, "hash": bytes}``, so the caller
    can resume from there. If the optional ``hashes`` is given (one entry hash
    per entry, as the caller computed them), execd checks each against its own
    computation and rejects the whole batch with ``INVALID_PARAMS`` (101) on
    the first mismatch (``data``: ``{"seq": int, "hash": bytes}``, the hash
    execd computed). The reply is sent only once the batch is durable. An
    empty ``entries`` list appends nothing and answers the head if
    ``first_seq`` and ``prev_hash`` match it, which makes it a cheap
    "are we in sync" probe.

    One call must fit one frame, so a batch's total size is bounded by the
    frame cap; a caller splits a long history into several batches. An entry
    that does not fit a frame on its own goes through ``ledger.append_large``.

``ledger.append_large`` (:class:`AppendLargeParams` -> :class:`LedgerHead`)
    Appends one entry of ``size`` bytes as seq ``seq`` after ``prev_hash``
    (same conflict rule as above). The payload travels on the client stream
    ``"data"``, in as many chunks as needed, ended by the stream's end mark.
    execd writes it to disk as it arrives (bounded memory) and commits it only
    when exactly ``size`` bytes arrived and their SHA-256 equals ``sha256``
    (else ``INVALID_PARAMS``, or ``ENTRY_TOO_LARGE`` (603) for bytes beyond
    ``size``); a failed or cancelled upload leaves the head unchanged. The
    optional ``hash`` is checked like ``hashes`` above.

``ledger.head`` (:class:`HeadParams` -> :class:`LedgerHead`)
    The current head; ``{seq: 0, hash: 32 zero bytes}`` for a session that has
    no ledger (not an error).

``ledger.read`` (:class:`ReadParams` -> :class:`ReadResult`)
    Streams the entries ``from_seq ..`` (at most ``limit`` of them, default
    all up to the head at the time of the call) to the client on stream
    ``"entries"``, then ends the stream and replies. The stream is a plain
    concatenation of *records* (below), so a record can span any number of
    chunks and a chunk can hold several records. ``ReadResult.count`` records
    were sent and ``last_seq == from_seq - 1 + count``; reading again from
    ``last_seq + 1`` resumes. ``head`` is the head the read was bounded by.

``ledger.list`` (:class:`ListParams` -> :class:`ListResult`)
    Every session with a ledger, sorted by name, with its head.

Record framing
--------------

One record carries one entry; the same bytes are used on the ``entries``
stream and in execd's data file (see ``execd/ledger_store.py``)::

    offset  size  field
    0       8     length   payload length, u64 big-endian
    8       8     seq      u64 big-endian
    16      32    hash     the entry hash of this entry
    48      length payload

:class:`RecordDecoder` turns a byte stream back into records and checks that
seqs are consecutive and, given the previous hash, that the chain holds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec

from protocol.ledger_chain import HASH_SIZE, MAX_SEQ, entry_hash
from protocol.rpc import Rpc, Schema

SESSION_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"
"""Session names: 1 to 128 characters from ``[A-Za-z0-9_.-]``."""

MAX_BATCH_ENTRIES = 65_536
"""The most entries one ``ledger.append`` may carry."""

MAX_ENTRY_SIZE = 1 << 32
"""The largest entry ``ledger.append_large`` accepts (4 GiB)."""


DATA_STREAM = "data"
"""Client stream carrying an ``append_large`` payload."""
ENTRIES_STREAM = "entries"
"""Server stream carrying ``read`` records."""

RECORD_HEADER = struct.Struct(">QQ32s")
"""Record header: payload length, seq, entry hash."""

RECORD_HEADER_SIZE = RECORD_HEADER.size

SessionName = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=SESSION_PATTERN)]
Hash = Annotated[bytes, msgspec.Meta(min_length=HASH_SIZE, max_length=HASH_SIZE)]
Seq = Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQ)]
HeadSeq = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]


class LedgerHead(Schema):
    """The last entry of a ledger: its seq (0 when empty) and hash."""

    seq: HeadSeq
    hash: Hash


class AppendParams(Schema):
    """``ledger.append``: entries for seqs ``first_seq ..``, continuing ``prev_hash``."""

    session: SessionName
    first_seq: Seq
    prev_hash: Hash
    entries: Annotated[list[bytes], msgspec.Meta(max_length=MAX_BATCH_ENTRIES)]
    hashes: Annotated[list[Hash], msgspec.Meta(max_length=MAX_BATCH_ENTRIES)] | None = None


class AppendLargeParams(Schema):
    """``ledger.append_large``: one entry of ``size`` bytes, sent on stream ``"data"``."""

    session: SessionName
    seq: Seq
    prev_hash: Hash
    size: Annotated[int, msgspec.Meta(ge=0, le=MAX_ENTRY_SIZE)]
    sha256: Hash
    hash: Hash | None = None


class HeadParams(Schema):
    """``ledger.head``."""

    session: SessionName


class ReadParams(Schema):
    """``ledger.read``: stream entries ``from_seq ..``, at most ``limit`` of them."""

    session: SessionName
    from_seq: Seq
    limit: Seq | None = None


class ReadResult(Schema):
    """What ``ledger.read`` sent: ``count`` records, the last one being ``last_seq``."""

    last_seq: HeadSeq
    count: HeadSeq
    head: LedgerHead


class ListParams(Schema):
    """``ledger.list`` takes no parameters."""


class LedgerInfo(Schema):
    """One session's ledger in ``ledger.list``."""

    session: str
    seq: int
    hash: bytes


class ListResult(Schema):
    """``ledger.list``: sessions by name; ``truncated`` when the list hit its cap."""

    sessions: list[LedgerInfo]
    truncated: bool = False


# -- record framing --------------------------------------------------------------


class RecordFormatError(ValueError):
    """A record stream is malformed, out of sequence or breaks the hash chain."""


@dataclass(frozen=True, slots=True)
class LedgerRecord:
    """One decoded entry."""

    seq: int
    hash: bytes
    payload: bytes


def encode_record_header(seq: int, entry_hash_: bytes, length: int) -> bytes:
    """The 48-byte header that precedes a payload of ``length`` bytes."""
    return RECORD_HEADER.pack(length, seq, entry_hash_)


class RecordDecoder:
    """Incremental decoder of a record stream (sans-I/O).

    ``first_seq`` is the seq the first record must carry; each next record
    must carry the next seq. With ``prev_hash`` (the hash of entry
    ``first_seq - 1``; :data:`~protocol.ledger_chain.GENESIS_HASH` when reading from 1) every record's
    hash is recomputed and must match. ``max_payload`` bounds the memory one
    record may claim.
    """

    def __init__(
        self,
        first_seq: int,
        prev_hash: bytes | None = None,
        *,
        max_payload: int = MAX_ENTRY_SIZE,
    ) -> None:
        self._next_seq = first_seq
        self._prev_hash = prev_hash
        self._max_payload = max_payload
        self._buffer = bytearray()
        self._pending: tuple[int, int, bytes] | None = None

    @property
    def next_seq(self) -> int:
        """The seq the next record must carry."""
        return self._next_seq

    def feed(self, data: bytes | bytearray | memoryview) -> list[LedgerRecord]:
        """Consume ``data``; return every record it completed."""
        self._buffer += data
        records: list[LedgerRecord] = []
        pos = 0
        buffer = self._buffer
        while True:
            if self._pending is None:
                if len(buffer) - pos < RECORD_HEADER_SIZE:
                    break
                length, seq, digest = RECORD_HEADER.unpack_from(buffer, pos)
                pos += RECORD_HEADER_SIZE
                if seq != self._next_seq:
                    raise RecordFormatError(f"record seq {seq}, expected {self._next_seq}")
                if length > self._max_payload:
                    raise RecordFormatError(f"record {seq} claims {length} bytes")
                self._pending = (length, seq, digest)
            length, seq, digest = self._pending
            if len(buffer) - pos < length:
                break
            payload = bytes(buffer[pos : pos + length])
            pos += length
            if self._prev_hash is not None:
                if entry_hash(self._prev_hash, seq, payload) != digest:
                    raise RecordFormatError(f"record {seq} breaks the hash chain")
                self._prev_hash = digest
            records.append(LedgerRecord(seq=seq, hash=digest, payload=payload))
            self._pending = None
            self._next_seq += 1
        del buffer[:pos]
        return records

    def close(self) -> None:
        """Declare the stream finished; raises if it stopped inside a record."""
        if self._pending is not None or self._buffer:
            raise RecordFormatError("record stream ends inside a record")


# -- the methods --------------------------------------------------------------
APPEND: Final = Rpc("ledger.append", AppendParams, LedgerHead)
APPEND_LARGE: Final = Rpc("ledger.append_large", AppendLargeParams, LedgerHead)
HEAD: Final = Rpc("ledger.head", HeadParams, LedgerHead)
READ: Final = Rpc("ledger.read", ReadParams, ReadResult)
LIST: Final = Rpc("ledger.list", ListParams, ListResult)

RPCS: Final = (APPEND, APPEND_LARGE, HEAD, READ, LIST)
