"""Properties of the ledger hash chain (protocol.ledger_chain) and its record framing."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from protocol.ledger_chain import (
    GENESIS_HASH,
    MAX_SEQ,
    EntryHasher,
    chain_hashes,
    entry_hash,
)
from protocol.rpc.ledger import RecordDecoder
from tests.support.ledger import chain_head, encode_record

hashes = st.binary(min_size=32, max_size=32)
seqs = st.integers(min_value=1, max_value=MAX_SEQ)
payload = st.binary(max_size=512)
payload_lists = st.lists(st.binary(max_size=64), max_size=20)


@given(hashes, seqs, payload)
def test_matches_the_documented_encoding(prev: bytes, seq: int, data: bytes) -> None:
    encoded = b"ledger-v1\x00" + prev + struct.pack(">QQ", seq, len(data)) + data
    assert entry_hash(prev, seq, data) == hashlib.sha256(encoded).digest()


@given(hashes, seqs, payload, hashes, seqs, payload)
def test_any_change_changes_the_hash(
    prev: bytes, seq: int, data: bytes, prev2: bytes, seq2: int, data2: bytes
) -> None:
    assume((prev, seq, data) != (prev2, seq2, data2))
    assert entry_hash(prev, seq, data) != entry_hash(prev2, seq2, data2)


@given(hashes, seqs, payload, st.data())
def test_single_field_changes_change_the_hash(
    prev: bytes, seq: int, data: bytes, draw: st.DataObject
) -> None:
    digest = entry_hash(prev, seq, data)
    other_prev = draw.draw(hashes.filter(lambda h: h != prev))
    other_seq = draw.draw(seqs.filter(lambda s: s != seq))
    assert entry_hash(other_prev, seq, data) != digest
    assert entry_hash(prev, other_seq, data) != digest
    if data:
        position = draw.draw(st.integers(0, len(data) - 1))
        flipped = bytearray(data)
        flipped[position] ^= draw.draw(st.integers(1, 255))
        assert entry_hash(prev, seq, bytes(flipped)) != digest
        assert entry_hash(prev, seq, data[:-1]) != digest
    assert entry_hash(prev, seq, data + b"\x00") != digest


@given(payload_lists, st.integers(0, 20))
def test_incremental_chain_equals_recomputation(entries: list[bytes], split: int) -> None:
    split = min(split, len(entries))
    whole = chain_hashes(GENESIS_HASH, 1, entries)
    seq, head = chain_head(GENESIS_HASH, 1, entries[:split])
    rest = chain_hashes(head, seq + 1, entries[split:])
    assert whole == chain_hashes(GENESIS_HASH, 1, entries[:split]) + rest
    current = GENESIS_HASH
    for index, entry in enumerate(entries, start=1):
        current = entry_hash(current, index, entry)
        assert whole[index - 1] == current
    assert chain_head(GENESIS_HASH, 1, entries) == (len(entries), current)


@given(payload_lists, st.integers(0, 19), st.binary(max_size=64))
def test_changing_one_entry_changes_every_later_hash(
    entries: list[bytes], position: int, replacement: bytes
) -> None:
    assume(entries)
    position %= len(entries)
    assume(entries[position] != replacement)
    changed = [*entries[:position], replacement, *entries[position + 1 :]]
    before = chain_hashes(GENESIS_HASH, 1, entries)
    after = chain_hashes(GENESIS_HASH, 1, changed)
    assert before[:position] == after[:position]
    assert all(a != b for a, b in zip(before[position:], after[position:], strict=True))


@given(hashes, seqs, payload, st.lists(st.integers(0, 512), max_size=8))
def test_streaming_hasher_equals_one_shot(
    prev: bytes, seq: int, data: bytes, cuts: list[int]
) -> None:
    hasher = EntryHasher(prev, seq, len(data))
    position = 0
    for cut in sorted(min(cut, len(data)) for cut in cuts):
        hasher.update(data[position:cut])
        position = cut
    with pytest.raises(ValueError):
        hasher.update(data[position:] + b"!")
    hasher.update(data[position:])
    assert hasher.digest() == entry_hash(prev, seq, data)


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        entry_hash(bytes(31), 1, b"")
    with pytest.raises(ValueError):
        entry_hash(GENESIS_HASH, 0, b"")
    with pytest.raises(ValueError):
        EntryHasher(GENESIS_HASH, 1, 3).digest()


@settings(max_examples=50)
@given(payload_lists, st.lists(st.integers(1, 97), min_size=1, max_size=10))
def test_record_stream_decodes_at_any_chunking(entries: list[bytes], sizes: list[int]) -> None:
    digests = chain_hashes(GENESIS_HASH, 1, entries)
    stream = b"".join(
        encode_record(seq, digest, entry)
        for seq, (digest, entry) in enumerate(zip(digests, entries, strict=True), start=1)
    )
    decoder = RecordDecoder(1, GENESIS_HASH)
    records = []
    position, turn = 0, 0
    while position < len(stream):
        size = sizes[turn % len(sizes)]
        records.extend(decoder.feed(stream[position : position + size]))
        position += size
        turn += 1
    decoder.close()
    assert [r.payload for r in records] == entries
    assert [r.hash for r in records] == digests
    assert [r.seq for r in records] == list(range(1, len(entries) + 1))
