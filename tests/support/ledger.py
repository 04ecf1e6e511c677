"""What tests compute about a ledger from the spec alone: heads after a batch, whole records."""

from __future__ import annotations

from collections.abc import Iterable

from protocol.ledger_chain import entry_hash
from protocol.rpc.ledger import encode_record_header


def chain_head(prev_hash: bytes, first_seq: int, payloads: Iterable[bytes]) -> tuple[int, bytes]:
    """The head (seq, hash) after appending ``payloads`` to the head (first_seq - 1, prev_hash)."""
    seq, current = first_seq - 1, prev_hash
    for payload in payloads:
        seq += 1
        current = entry_hash(current, seq, payload)
    return seq, current


def encode_record(seq: int, digest: bytes, payload: bytes) -> bytes:
    """One whole record of a ``ledger.read`` stream."""
    return encode_record_header(seq, digest, len(payload)) + payload
