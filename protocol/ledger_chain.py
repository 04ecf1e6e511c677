"""The session ledger's hash chain: one pure function, shared by execd and harnessd.

Every ledger entry has a sequence number ``seq`` (the first entry is 1, then
2, 3, ... without gaps) and an opaque ``payload`` (bytes). Its *entry hash*
commits to the whole history before it::

    entry_hash(prev_hash, seq, payload) = SHA-256(
        b"ledger-v1\\x00"                 10 bytes, domain separator
        || prev_hash                      32 bytes, hash of entry seq-1
        || seq         as u64 big-endian   8 bytes
        || len(payload) as u64 big-endian  8 bytes
        || payload                        len(payload) bytes
    )

``prev_hash`` of entry 1 is :data:`GENESIS_HASH`, 32 zero bytes. The *head* of
a ledger is the pair (seq, hash) of its last entry, or (0, GENESIS_HASH) when
it is empty. Every field before the payload has a fixed width and the payload
length is explicit, so two different (prev_hash, seq, payload) triples never
produce the same hashed byte string; the domain separator keeps these hashes
apart from any other SHA-256 use in the protocol.

Because the payload length comes before the payload, an entry can be hashed
incrementally when its size is known in advance (:class:`EntryHasher`), which
is how large entries are hashed while they stream in.

This module performs no I/O.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

DOMAIN = b"ledger-v1\x00"
"""The domain separator that starts every hashed entry."""

HASH_SIZE = 32
"""Length in bytes of an entry hash (SHA-256)."""

GENESIS_HASH = bytes(HASH_SIZE)
"""The ``prev_hash`` of entry 1: 32 zero bytes."""

MAX_SEQ = (1 << 63) - 1
"""The largest sequence number (kept signed 64-bit for every implementation)."""

_SEQ_AND_LEN = struct.Struct(">QQ")


def _check(prev_hash: bytes, seq: int, size: int) -> None:
    if len(prev_hash) != HASH_SIZE:
        raise ValueError(f"prev_hash must be {HASH_SIZE} bytes, not {len(prev_hash)}")
    if not 1 <= seq <= MAX_SEQ:
        raise ValueError(f"seq must be in 1..{MAX_SEQ}, not {seq}")
    if not 0 <= size < 1 << 64:
        raise ValueError(f"payload size out of range: {size}")


class EntryHasher:
    """Compute one entry hash incrementally, for a payload of known ``size``.

    Feed exactly ``size`` bytes through :meth:`update`, then call
    :meth:`digest`. The result equals ``entry_hash(prev_hash, seq, payload)``.
    """

    __slots__ = ("_hash", "_remaining")

    def __init__(self, prev_hash: bytes, seq: int, size: int) -> None:
        _check(prev_hash, seq, size)
        self._hash = hashlib.sha256(DOMAIN)
        self._hash.update(prev_hash)
        self._hash.update(_SEQ_AND_LEN.pack(seq, size))
        self._remaining = size

    @property
    def remaining(self) -> int:
        """Payload bytes still expected."""
        return self._remaining

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Hash the next piece of the payload; refuses bytes beyond ``size``."""
        if len(data) > self._remaining:
            raise ValueError("more payload bytes than the declared size")
        self._hash.update(data)
        self._remaining -= len(data)

    def digest(self) -> bytes:
        """The entry hash; refuses to answer before all ``size`` bytes were fed."""
        if self._remaining:
            raise ValueError(f"payload incomplete: {self._remaining} bytes missing")
        return self._hash.digest()


def entry_hash(prev_hash: bytes, seq: int, payload: bytes | bytearray | memoryview) -> bytes:
    """The hash of entry ``seq`` with ``payload`` following an entry hashed ``prev_hash``."""
    hasher = EntryHasher(prev_hash, seq, len(payload))
    hasher.update(payload)
    return hasher.digest()


def chain_hashes(prev_hash: bytes, first_seq: int, payloads: Iterable[bytes]) -> list[bytes]:
    """The entry hashes of consecutive entries ``first_seq, first_seq + 1, ...``.

    ``prev_hash`` is the hash of entry ``first_seq - 1`` (:data:`GENESIS_HASH`
    when ``first_seq`` is 1). The last element is the new head hash.
    """
    hashes: list[bytes] = []
    current = prev_hash
    for offset, payload in enumerate(payloads):
        current = entry_hash(current, first_seq + offset, payload)
        hashes.append(current)
    return hashes
