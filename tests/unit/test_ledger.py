"""The ledger capability: appends, conflicts, durability across restarts, recovery, reads."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from execd.config import Config
from execd.errors import EntryTooLarge, InvalidParams, LedgerConflict, ShuttingDown
from execd.ledger import LedgerCapability, LedgerStore
from execd.ledger_store import MAGIC
from protocol.ledger_chain import GENESIS_HASH, chain_hashes, entry_hash
from protocol.rpc.ledger import (
    AppendLargeParams,
    AppendParams,
    HeadParams,
    LedgerHead,
    LedgerRecord,
    ListParams,
    ReadParams,
    RecordDecoder,
)
from tests.support.ledger import chain_head
from tests.support.local_ctx import LocalContext

T = TypeVar("T")
SESSION = "sess-1"


pytestmark = pytest.mark.anyio


def make_config(tmp_path: Path) -> Config:
    return Config(state_dir=str(tmp_path))


def data_file(tmp_path: Path, session: str = SESSION) -> Path:
    return tmp_path / "ledger" / f"{session}.ledger"


def index_file(tmp_path: Path, session: str = SESSION) -> Path:
    return tmp_path / "ledger" / f"{session}.index"


def payloads(first_seq: int, count: int, size: int = 100) -> list[bytes]:
    rng = random.Random(first_seq)
    return [rng.randbytes(rng.randrange(size + 1)) for _ in range(count)]


class Client:
    """Calls the capability's handlers the way the dispatcher would."""

    def __init__(self, cap: LedgerCapability) -> None:
        self.cap = cap

    async def append(
        self,
        first_seq: int,
        prev_hash: bytes,
        entries: list[bytes],
        session: str = SESSION,
        hashes: list[bytes] | None = None,
    ) -> LedgerHead:
        params = AppendParams(
            session=session,
            first_seq=first_seq,
            prev_hash=prev_hash,
            entries=entries,
            hashes=hashes,
        )
        return await self.cap.ledger_append(params, LocalContext())

    async def head(self, session: str = SESSION) -> LedgerHead:
        return await self.cap.ledger_head(HeadParams(session=session), LocalContext())

    async def read(
        self, from_seq: int, limit: int | None = None, session: str = SESSION
    ) -> tuple[list[LedgerRecord], Any, LocalContext]:
        ctx = LocalContext(max_chunk=4096)
        params = ReadParams(session=session, from_seq=from_seq, limit=limit)
        result = await self.cap.ledger_read(params, ctx)
        assert "entries" in ctx.ended
        decoder = RecordDecoder(from_seq)
        records: list[LedgerRecord] = []
        for chunk in ctx.sent["entries"]:
            assert len(chunk) <= ctx.max_chunk
            records.extend(decoder.feed(chunk))
        decoder.close()
        return records, result, ctx

    async def append_large(
        self,
        seq: int,
        prev_hash: bytes,
        payload: bytes,
        *,
        max_chunk: int = 64 * 1024,
        sha256: bytes | None = None,
        size: int | None = None,
        session: str = SESSION,
    ) -> LedgerHead:
        ctx = LocalContext(max_chunk=max_chunk)
        for start in range(0, len(payload), max_chunk):
            ctx.feed("data", payload[start : start + max_chunk])
        ctx.feed("data", b"", end=True)
        params = AppendLargeParams(
            session=session,
            seq=seq,
            prev_hash=prev_hash,
            size=len(payload) if size is None else size,
            sha256=hashlib.sha256(payload).digest() if sha256 is None else sha256,
        )
        return await self.cap.ledger_append_large(params, ctx)


@contextlib.asynccontextmanager
async def ledger(tmp_path: Path) -> AsyncIterator[Client]:
    """A ledger capability on ``tmp_path``, open for the block (a restart is a new block)."""
    cap = LedgerCapability(make_config(tmp_path))
    try:
        yield Client(cap)
    finally:
        await cap.close()


async def build(tmp_path: Path, batches: list[list[bytes]]) -> tuple[int, bytes]:
    """Append ``batches`` to SESSION; return the head (seq, hash) they must give."""
    async with ledger(tmp_path) as client:
        seq, digest = 0, GENESIS_HASH
        for batch in batches:
            head = await client.append(seq + 1, digest, batch)
            seq, digest = chain_head(digest, seq + 1, batch)
            assert (head.seq, head.hash) == (seq, digest)
    flat = [entry for batch in batches for entry in batch]
    return chain_head(GENESIS_HASH, 1, flat)


async def current_head(tmp_path: Path, session: str = SESSION) -> tuple[int, bytes]:
    async with ledger(tmp_path) as client:
        head = await client.head(session)
        return head.seq, head.hash


# -- appends and conflicts -----------------------------------------------------------


async def test_contiguous_appends_return_chained_heads(tmp_path: Path) -> None:
    batches = [payloads(1, 1), payloads(2, 5), [b""], payloads(8, 30, size=5000)]
    seq, digest = await build(tmp_path, batches)
    assert seq == 37
    assert await current_head(tmp_path) == (seq, digest)


async def test_head_of_unknown_session_is_zero_and_creates_nothing(tmp_path: Path) -> None:
    assert await current_head(tmp_path, "never-seen") == (0, GENESIS_HASH)
    assert not data_file(tmp_path, "never-seen").exists()


async def test_conflicts_carry_the_head_and_allow_resuming(tmp_path: Path) -> None:
    first = payloads(1, 3)
    seq, digest = await build(tmp_path, [first])
    more = payloads(4, 2)

    async with ledger(tmp_path) as client:
        cases = [
            (seq + 2, digest),  # gap
            (seq, chain_hashes(GENESIS_HASH, 1, first)[1]),  # repeat of the last entry
            (1, GENESIS_HASH),  # repeat from the start
            (seq + 1, b"\x01" * 32),  # wrong prev_hash
        ]
        for first_seq, prev in cases:
            with pytest.raises(LedgerConflict) as info:
                await client.append(first_seq, prev, more)
            assert info.value.data == {"seq": seq, "hash": digest}
        # resume from the head carried by the conflict
        head_data = info.value.data
        head = await client.append(head_data["seq"] + 1, head_data["hash"], more)
        assert (head.seq, head.hash) == chain_head(digest, seq + 1, more)


async def test_empty_append_probes_the_head(tmp_path: Path) -> None:
    seq, digest = await build(tmp_path, [payloads(1, 2)])

    async with ledger(tmp_path) as client:
        head = await client.append(seq + 1, digest, [])
        assert (head.seq, head.hash) == (seq, digest)
        with pytest.raises(LedgerConflict):
            await client.append(seq + 1, GENESIS_HASH, [])


async def test_client_hashes_are_verified(tmp_path: Path) -> None:
    entries = payloads(1, 4)
    hashes = chain_hashes(GENESIS_HASH, 1, entries)

    async with ledger(tmp_path) as client:
        bad = [*hashes[:2], b"\x07" * 32, hashes[3]]
        with pytest.raises(InvalidParams) as info:
            await client.append(1, GENESIS_HASH, entries, hashes=bad)
        assert info.value.data == {"seq": 3, "hash": hashes[2]}
        with pytest.raises(InvalidParams):
            await client.append(1, GENESIS_HASH, entries, hashes=hashes[:3])
        assert (await client.head()).seq == 0
        head = await client.append(1, GENESIS_HASH, entries, hashes=hashes)
        assert (head.seq, head.hash) == (4, hashes[-1])


async def test_concurrent_appends_to_one_session_are_serialized(tmp_path: Path) -> None:
    async with ledger(tmp_path) as client:
        batches = [payloads(10 + i, 3) for i in range(8)]
        outcomes = await asyncio.gather(
            *(client.append(1, GENESIS_HASH, batch) for batch in batches),
            return_exceptions=True,
        )
        winners = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, LedgerHead)]
        assert len(winners) == 1
        losers = [outcome for i, outcome in enumerate(outcomes) if i not in winners]
        assert all(isinstance(outcome, LedgerConflict) for outcome in losers)
        head = await client.head()
        assert (head.seq, head.hash) == chain_head(GENESIS_HASH, 1, batches[winners[0]])


async def test_sessions_are_independent_and_listed(tmp_path: Path) -> None:
    async with ledger(tmp_path) as client:
        expected = {}
        for index, name in enumerate(["b.x", "a_1", "C-2"]):
            entries = payloads(index, index + 1)
            head = await client.append(1, GENESIS_HASH, entries, session=name)
            expected[name] = (head.seq, head.hash)
        await client.head("not-created")
        listed = await client.cap.ledger_list(ListParams(), LocalContext())
        assert [info.session for info in listed.sessions] == sorted(expected)
        assert {info.session: (info.seq, info.hash) for info in listed.sessions} == expected
        assert not listed.truncated


def test_session_names_are_bounded_by_the_schema() -> None:
    good = {"session": "a.b_c-D9", "first_seq": 1, "prev_hash": bytes(32), "entries": []}
    msgspec.convert(good, AppendParams)
    for bad_name in ["", "../x", "a/b", "x" * 129, "sp ace", "é"]:
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({**good, "session": bad_name}, AppendParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**good, "prev_hash": bytes(31)}, AppendParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**good, "first_seq": 0}, AppendParams)


async def test_store_evicts_idle_ledgers_and_reopens_them(tmp_path: Path) -> None:
    store = LedgerStore(str(tmp_path / "ledger"), max_open=2)
    heads = {f"s{i}": (0, GENESIS_HASH) for i in range(6)}
    try:
        for round_ in range(3):
            for name, (seq, digest) in heads.items():
                entries = payloads(round_ * 10 + seq, 2)
                head = await store.append(name, seq + 1, digest, entries)
                heads[name] = (head.seq, head.hash)
                assert heads[name] == chain_head(digest, seq + 1, entries)
        for name, expected in heads.items():
            head = await store.head(name)
            assert (head.seq, head.hash) == expected
    finally:
        await store.close()
    with pytest.raises(ShuttingDown):
        await store.head("s0")


# -- durability and recovery ------------------------------------------------------------


async def test_restart_sees_the_same_head_and_continues(tmp_path: Path) -> None:
    first = payloads(1, 10)
    seq, digest = await build(tmp_path, [first])
    assert await current_head(tmp_path) == (seq, digest)
    more = payloads(11, 5)

    async with ledger(tmp_path) as client:
        head = await client.append(seq + 1, digest, more)
        assert (head.seq, head.hash) == chain_head(GENESIS_HASH, 1, first + more)
    assert await current_head(tmp_path) == chain_head(GENESIS_HASH, 1, first + more)


async def test_files_follow_the_documented_layout(tmp_path: Path) -> None:
    entries = payloads(3, 20, size=300)
    await build(tmp_path, [entries[:7], entries[7:]])
    data = data_file(tmp_path).read_bytes()
    index = index_file(tmp_path).read_bytes()
    assert data[:8] == b"XLEDGER1" == MAGIC
    assert len(index) == 8 * len(entries)
    prev = GENESIS_HASH
    position = 8
    for seq, payload in enumerate(entries, start=1):
        (offset,) = struct.unpack_from(">Q", index, (seq - 1) * 8)
        assert offset == position
        length, stored_seq, digest = struct.unpack_from(">QQ32s", data, offset)
        assert (length, stored_seq) == (len(payload), seq)
        assert data[offset + 48 : offset + 48 + length] == payload
        assert digest == entry_hash(prev, seq, payload)
        prev = digest
        position = offset + 48 + length
    assert position == len(data)


def truncate(path: Path, size: int) -> None:
    with path.open("r+b") as handle:
        handle.truncate(size)


async def test_torn_data_tail_is_cut_back_to_the_last_good_record(tmp_path: Path) -> None:
    entries = payloads(1, 12, size=400)
    await build(tmp_path, [entries[:5], entries[5:]])
    size = data_file(tmp_path).stat().st_size
    truncate(data_file(tmp_path), size - 3)
    assert await current_head(tmp_path) == chain_head(GENESIS_HASH, 1, entries[:11])
    assert len(index_file(tmp_path).read_bytes()) == 11 * 8
    # the lost entry can be appended again
    seq, digest = chain_head(GENESIS_HASH, 1, entries[:11])

    async with ledger(tmp_path) as client:
        head = await client.append(seq + 1, digest, entries[11:])
        assert (head.seq, head.hash) == chain_head(GENESIS_HASH, 1, entries)
    assert await current_head(tmp_path) == chain_head(GENESIS_HASH, 1, entries)


async def test_garbage_after_the_last_record_is_dropped(tmp_path: Path) -> None:
    entries = payloads(2, 6)
    expected = await build(tmp_path, [entries])
    size = data_file(tmp_path).stat().st_size
    with data_file(tmp_path).open("ab") as handle:
        handle.write(os.urandom(5000))
    assert await current_head(tmp_path) == expected
    assert data_file(tmp_path).stat().st_size == size


async def test_header_without_its_payload_is_dropped(tmp_path: Path) -> None:
    entries = payloads(4, 3)
    expected = await build(tmp_path, [entries])
    size = data_file(tmp_path).stat().st_size
    with data_file(tmp_path).open("ab") as handle:
        handle.write(struct.pack(">QQ32s", 1000, 4, bytes(32)) + b"partial")
    assert await current_head(tmp_path) == expected
    assert data_file(tmp_path).stat().st_size == size


async def test_index_past_the_data_is_cut(tmp_path: Path) -> None:
    entries = payloads(5, 8)
    await build(tmp_path, [entries])
    size = data_file(tmp_path).stat().st_size
    # crash during the last record: data cut inside it, index already names it
    truncate(data_file(tmp_path), size - len(entries[-1]) - 20)
    with index_file(tmp_path).open("ab") as handle:
        handle.write(struct.pack(">Q", size) + b"\x00\x01\x02")
    assert await current_head(tmp_path) == chain_head(GENESIS_HASH, 1, entries[:7])
    assert len(index_file(tmp_path).read_bytes()) == 7 * 8


async def test_complete_records_missing_from_the_index_are_indexed(tmp_path: Path) -> None:
    entries = payloads(6, 9)
    expected = await build(tmp_path, [entries])
    index_size = index_file(tmp_path).stat().st_size
    truncate(index_file(tmp_path), index_size - 3 * 8 - 5)
    assert await current_head(tmp_path) == expected
    assert index_file(tmp_path).stat().st_size == index_size

    async with ledger(tmp_path) as client:
        records, _, _ = await client.read(1)
        assert [record.payload for record in records] == entries


async def test_a_lost_index_is_rebuilt_from_the_data(tmp_path: Path) -> None:
    entries = payloads(8, 25)
    expected = await build(tmp_path, [entries[:10], entries[10:]])
    index = index_file(tmp_path).read_bytes()
    index_file(tmp_path).unlink()
    assert await current_head(tmp_path) == expected
    assert index_file(tmp_path).read_bytes() == index


async def test_corrupted_last_payload_is_cut(tmp_path: Path) -> None:
    entries = [b"a" * 50, b"b" * 50, b"c" * 50]
    await build(tmp_path, [entries])
    raw = bytearray(data_file(tmp_path).read_bytes())
    raw[-10] ^= 0xFF
    data_file(tmp_path).write_bytes(bytes(raw))
    assert await current_head(tmp_path) == chain_head(GENESIS_HASH, 1, entries[:2])


async def test_torn_creation_is_reinitialized(tmp_path: Path) -> None:
    (tmp_path / "ledger").mkdir()
    data_file(tmp_path).write_bytes(MAGIC[:3])
    assert await current_head(tmp_path) == (0, GENESIS_HASH)
    expected = await build(tmp_path, [payloads(9, 2)])
    assert await current_head(tmp_path) == expected


async def test_foreign_data_file_is_refused_not_truncated(tmp_path: Path) -> None:
    (tmp_path / "ledger").mkdir()
    content = b"this is not a ledger at all"
    data_file(tmp_path).write_bytes(content)

    async with ledger(tmp_path) as client:
        with pytest.raises(Exception) as info:
            await client.head()
        assert getattr(info.value, "code", None) == 602
    assert data_file(tmp_path).read_bytes() == content


# -- reads ----------------------------------------------------------------------------


async def test_read_streams_entries_from_any_seq(tmp_path: Path) -> None:
    entries = payloads(7, 40, size=9000)
    await build(tmp_path, [entries[:13], entries[13:14], entries[14:]])
    hashes = chain_hashes(GENESIS_HASH, 1, entries)

    async with ledger(tmp_path) as client:
        for from_seq in (1, 2, 13, 14, 15, 39, 40):
            records, result, _ = await client.read(from_seq)
            assert [r.payload for r in records] == entries[from_seq - 1 :]
            assert [r.hash for r in records] == hashes[from_seq - 1 :]
            assert [r.seq for r in records] == list(range(from_seq, 41))
            assert (result.last_seq, result.count, result.head.seq) == (40, 41 - from_seq, 40)
        records, result, _ = await client.read(5, limit=3)
        assert [r.seq for r in records] == [5, 6, 7]
        assert (result.last_seq, result.count) == (7, 3)
        # the chain verifies from a known predecessor
        decoder = RecordDecoder(5, hashes[3])
        _, _, ctx = await client.read(5, limit=3)
        assert [r.seq for r in decoder.feed(ctx.received("entries"))] == [5, 6, 7]
        for from_seq in (41, 100):
            records, result, ctx = await client.read(from_seq)
            assert records == []
            assert (result.last_seq, result.count) == (from_seq - 1, 0)
        records, result, _ = await client.read(1, session="unknown")
        assert records == [] and result.head.seq == 0


def test_record_decoder_rejects_broken_streams() -> None:
    hashes = chain_hashes(GENESIS_HASH, 1, [b"x", b"y"])
    good = struct.pack(">QQ32s", 1, 1, hashes[0]) + b"x"
    assert RecordDecoder(1, GENESIS_HASH).feed(good)[0].payload == b"x"
    with pytest.raises(ValueError):
        RecordDecoder(2).feed(good)
    with pytest.raises(ValueError):
        RecordDecoder(1, GENESIS_HASH).feed(good[:-1] + b"z")
    decoder = RecordDecoder(1)
    decoder.feed(good[:-1])
    with pytest.raises(ValueError):
        decoder.close()


# -- large entries ----------------------------------------------------------------------


async def test_append_large_streams_an_entry_bigger_than_a_chunk(tmp_path: Path) -> None:
    small = payloads(1, 3)
    big = random.Random(5).randbytes(300_000)
    seq, digest = await build(tmp_path, [small])

    async with ledger(tmp_path) as client:
        head = await client.append_large(seq + 1, digest, big, max_chunk=8192)
        assert (head.seq, head.hash) == (seq + 1, entry_hash(digest, seq + 1, big))
        after = payloads(20, 2)
        head = await client.append(head.seq + 1, head.hash, after)
        assert (head.seq, head.hash) == chain_head(GENESIS_HASH, 1, [*small, big, *after])
        records, _, ctx = await client.read(1)
        assert [r.payload for r in records] == [*small, big, *after]
        assert len(ctx.sent["entries"]) > 300_000 // ctx.max_chunk
    expected = chain_head(GENESIS_HASH, 1, [*small, big, *payloads(20, 2)])
    assert await current_head(tmp_path) == expected


async def test_append_large_with_a_bad_payload_leaves_the_ledger_unchanged(tmp_path: Path) -> None:
    seq, digest = await build(tmp_path, [payloads(1, 2)])
    size = data_file(tmp_path).stat().st_size
    big = os.urandom(200_000)

    async with ledger(tmp_path) as client:
        with pytest.raises(InvalidParams):
            await client.append_large(seq + 1, digest, big, sha256=bytes(32))
        with pytest.raises(InvalidParams):
            await client.append_large(seq + 1, digest, big, size=len(big) + 1)
        with pytest.raises(EntryTooLarge):
            await client.append_large(seq + 1, digest, big, size=len(big) - 1)
        with pytest.raises(LedgerConflict):
            await client.append_large(seq, digest, big)
        with pytest.raises(LedgerConflict):
            await client.append_large(seq + 1, GENESIS_HASH, big)
        head = await client.head()
        assert (head.seq, head.hash) == (seq, digest)
        assert data_file(tmp_path).stat().st_size == size
    assert await current_head(tmp_path) == (seq, digest)
    assert data_file(tmp_path).stat().st_size == size


async def test_cancelled_append_large_leaves_the_ledger_unchanged(tmp_path: Path) -> None:
    seq, digest = await build(tmp_path, [payloads(1, 2)])
    size = data_file(tmp_path).stat().st_size

    async with ledger(tmp_path) as client:
        ctx = LocalContext()
        for _ in range(40):
            ctx.feed("data", os.urandom(64 * 1024))
        params = AppendLargeParams(
            session=SESSION, seq=seq + 1, prev_hash=digest, size=10 << 20, sha256=bytes(32)
        )
        task = asyncio.create_task(client.cap.ledger_append_large(params, ctx))
        deadline = time.monotonic() + 30
        while data_file(tmp_path).stat().st_size <= size + (1 << 20):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        head = await client.head()
        assert (head.seq, head.hash) == (seq, digest)
        assert data_file(tmp_path).stat().st_size == size
        more = payloads(3, 2)
        head = await client.append(seq + 1, digest, more)
        assert (head.seq, head.hash) == chain_head(digest, seq + 1, more)


# -- scale -------------------------------------------------------------------------------


async def test_ten_thousand_entries_in_batches_stay_correct(tmp_path: Path) -> None:
    block = os.urandom(20_000)
    rng = random.Random(42)

    def entry(seq: int) -> bytes:
        start = rng.randrange(10_000)
        return seq.to_bytes(8, "big") + block[start : start + rng.randrange(6_000, 14_000)]

    async with ledger(tmp_path) as client:
        seq, digest, total = 0, GENESIS_HASH, 0
        tail: list[bytes] = []
        for _ in range(100):
            batch = [entry(seq + 1 + i) for i in range(100)]
            total += sum(map(len, batch))
            head = await client.append(seq + 1, digest, batch)
            seq, digest = chain_head(digest, seq + 1, batch)
            assert (head.seq, head.hash) == (seq, digest)
            tail = (tail + batch)[-150:]
        assert seq == 10_000 and total > 90 << 20
        records, result, _ = await client.read(9_851)
        assert [r.payload for r in records] == tail
        assert records[-1].hash == digest
        assert (result.last_seq, result.count) == (10_000, 150)
        records, _, _ = await client.read(5_000, limit=2)
        assert [r.seq for r in records] == [5_000, 5_001]
        assert records[0].payload[:8] == (5_000).to_bytes(8, "big")
    assert (await current_head(tmp_path))[0] == 10_000
