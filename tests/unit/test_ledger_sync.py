"""Incremental ledger sync against a real execd: batching, large entries, resume, divergence."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from harnessd import connect
from harnessd.api import ExecdClient
from harnessd.errors import ConnectionLost
from harnessd.ledger_sync import (
    LedgerDiverged,
    LedgerSync,
    LocalLedger,
    decode_entry,
)
from protocol.rpc import ledger as rpc
from tests.conftest import one_loop
from tests.support.daemon import RunningExecd

MAX_FRAME = 64 * 1024

pytestmark = [
    pytest.mark.anyio,
    one_loop,
    pytest.mark.timeout(60),
    pytest.mark.execd_args("--max-frame", str(MAX_FRAME)),
]


class Recorder:
    """Stands in for a real client (duck-typed) and records the size of every call it makes.

    ``lose_reply_after``: after that many appends reach execd, the next one is
    forwarded and then its reply is "lost" (ConnectionLost raised instead).
    What it does not record (``info``, ``ledger_read``) goes to the client as is.
    """

    def __init__(self, client: ExecdClient, *, lose_reply_after: int | None = None) -> None:
        self.client = client
        self.appends: list[tuple[int, int, int]] = []
        self.large: list[tuple[int, int]] = []
        self.heads = 0
        self.lose_reply_after = lose_reply_after

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def ledger_head(self, session: str) -> rpc.LedgerHead:
        self.heads += 1
        return await self.client.ledger_head(session)

    async def ledger_append(self, *args: Any, **kwargs: Any) -> rpc.LedgerHead:
        """``ExecdClient.ledger_append``: its arguments are AppendParams' fields."""
        params = rpc.AppendParams(*args, **kwargs)
        self.appends.append(
            (params.first_seq, len(params.entries), len(msgspec.msgpack.encode(params)))
        )
        head = await self.client.ledger_append(*args, **kwargs)
        if self.lose_reply_after is not None and len(self.appends) > self.lose_reply_after:
            raise ConnectionLost("reply lost (simulated)")
        return head

    async def ledger_append_large(
        self, session: str, seq: int, prev_hash: bytes, payload: bytes
    ) -> rpc.LedgerHead:
        self.large.append((seq, len(payload)))
        return await self.client.ledger_append_large(session, seq, prev_hash, payload)


def fill(ledger: LocalLedger, count: int, *, seed: int, max_size: int = 3000) -> LocalLedger:
    """``ledger`` with ``count`` more random messages (the same ones for the same ``seed``)."""
    rng = random.Random(seed)
    for _ in range(count):
        ledger.append({"kind": "message", "content": rng.randbytes(rng.randrange(max_size)).hex()})
    return ledger


async def test_batches_stay_within_the_budget(client: ExecdClient) -> None:
    ledger = fill(LocalLedger(), 400, seed=1)
    sync = LedgerSync("budget", ledger)
    peer = Recorder(client)
    assert client.info.peer_max_frame == MAX_FRAME
    budget = sync.budget(peer)
    assert budget == MAX_FRAME // 2
    report = await sync.sync(peer)
    assert report.entries == 400 and report.head == 400
    assert report.batches == len(peer.appends) > 10
    assert all(size <= budget for _, _, size in peer.appends), peer.appends
    # The batches are contiguous and cover every entry once.
    seqs = [seq for first, count, _ in peer.appends for seq in range(first, first + count)]
    assert seqs == list(range(1, 401))
    assert await sync.verify_remote(peer) == 400

    small = LedgerSync("small-budget", ledger, batch_bytes=4096)
    peer2 = Recorder(client)
    await small.sync(peer2)
    assert all(size <= 4096 for _, _, size in peer2.appends)
    assert sum(count for _, count, _ in peer2.appends) + len(peer2.large) == 400


async def test_an_entry_larger_than_the_budget_goes_through_append_large(
    client: ExecdClient,
) -> None:
    ledger = fill(LocalLedger(), 5, seed=2, max_size=100)
    ledger.append({"kind": "tool_result", "content": "x" * (3 * MAX_FRAME)})
    fill(ledger, 5, seed=3, max_size=100)
    sync = LedgerSync("large", ledger)
    peer = Recorder(client)
    report = await sync.sync(peer)
    assert peer.large == [(6, len(ledger.payload(6)))]
    assert report.large == 1 and report.batches == 3 and report.entries == 11
    assert all(size <= sync.budget(peer) for _, _, size in peer.appends)
    records = await client.ledger_read("large", 1, prev_hash=ledger.hash_at(0))
    assert [r.payload for r in records] == list(ledger.payloads())
    assert decode_entry(records[5].payload)["content"] == "x" * (3 * MAX_FRAME)


async def test_each_sync_sends_only_the_new_entries(client: ExecdClient) -> None:
    ledger = LocalLedger()
    sync = LedgerSync("incremental", ledger)
    peer = Recorder(client)
    fill(ledger, 200, seed=4)
    first = await sync.sync(peer)
    assert first.head_queries == 1 and first.entries == 200
    for turn in range(5):
        before = ledger.seq
        fill(ledger, 3, seed=10 + turn)
        peer.appends.clear()
        report = await sync.sync(peer)
        new_bytes = sum(len(p) for p in ledger.payloads(before + 1))
        assert report.entries == 3 and report.bytes == new_bytes
        assert report.batches == 1 and report.head_queries == 0 and report.conflicts == 0
        assert [(first_seq, count) for first_seq, count, _ in peer.appends] == [(before + 1, 3)]
    idle = await sync.sync(peer)
    assert idle.entries == 0 and idle.batches == 0
    assert peer.heads == 1
    assert await sync.verify_remote(client) == 215


async def test_resume_after_a_lost_reply_and_a_reconnect(
    execd: RunningExecd, client: ExecdClient
) -> None:
    ledger = fill(LocalLedger(), 300, seed=5)
    sync = LedgerSync("lost-ack", ledger)
    # The third append reaches execd but its answer never comes back.
    lossy = Recorder(client, lose_reply_after=2)
    with pytest.raises(ConnectionLost):
        await sync.sync(lossy)
    assert sync.acked is None
    landed = sum(count for _, count, _ in lossy.appends)
    head = await client.ledger_head("lost-ack")
    assert head.seq == landed

    # A new connection: the sync asks for execd's head and sends only the rest.
    fresh = await connect(execd.host, execd.port, execd.token)
    try:
        peer = Recorder(fresh)
        report = await sync.sync(peer)
        assert report.head_queries == 1 and report.resumed_from == landed
        assert report.entries == 300 - landed
        assert peer.appends[0][0] == landed + 1
        assert await sync.verify_remote(fresh) == 300
    finally:
        await fresh.close()


async def test_conflict_data_moves_the_sync_to_execds_head(
    execd: RunningExecd, client: ExecdClient
) -> None:
    ledger = fill(LocalLedger(), 10, seed=6)
    sync = LedgerSync("conflict", ledger)
    await sync.sync(client)
    fill(ledger, 6, seed=7)
    # Entries 11..13 reach execd behind the sync's back (an ack it never saw).
    await client.ledger_append("conflict", 11, ledger.hash_at(10), list(ledger.payloads(11, 13)))
    peer = Recorder(client)
    report = await sync.sync(peer)
    assert report.conflicts == 1 and report.resumed_from == 13
    assert report.entries == 3 and report.head == 16
    assert await sync.verify_remote(client) == 16


async def test_divergence_is_detected_and_nothing_is_overwritten(
    execd: RunningExecd, client: ExecdClient
) -> None:
    original = fill(LocalLedger(), 5, seed=8)
    await LedgerSync("shared", original).sync(client)

    cases: list[tuple[str, LocalLedger]] = []
    behind = fill(LocalLedger(), 3, seed=8)  # same first 3 entries, but execd is ahead
    cases.append(("ahead", behind))
    different = fill(LocalLedger(), 5, seed=9)  # same length, different content
    cases.append(("differs", different))
    longer = fill(LocalLedger(), 8, seed=10)  # longer, different prefix
    cases.append(("differs", longer))

    for why, local in cases:
        sync = LedgerSync("shared", local)
        with pytest.raises(LedgerDiverged, match=why) as info:
            await sync.sync(client)
        assert info.value.remote_seq == 5
        with pytest.raises(LedgerDiverged):
            await sync.verify_remote(client)

    # A stale ack (execd's entry differs at our acked seq) is a conflict we cannot adopt.
    stale = LedgerSync("shared", different)
    stale.acked = 5
    different.append({"kind": "more"})
    with pytest.raises(LedgerDiverged):
        await stale.sync(client)

    records = await client.ledger_read("shared", 1, prev_hash=original.hash_at(0))
    assert [r.payload for r in records] == list(original.payloads())


def test_session_names_and_budgets_are_validated() -> None:
    with pytest.raises(msgspec.ValidationError):
        LedgerSync("bad name!", LocalLedger())
    with pytest.raises(ValueError, match="batch_bytes"):
        LedgerSync("ok", LocalLedger(), batch_bytes=10)
    ledger = LocalLedger()
    assert ledger.seq == 0 and ledger.hash_at(0) == bytes(32)
    seq = ledger.append({"a": 1})
    entry: dict[str, Any] = decode_entry(ledger.payload(seq))
    assert entry == {"a": 1}
    with pytest.raises(IndexError):
        ledger.hash_at(2)
