"""Files, watches and the ledger over real sockets against a real execd."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import harnessd
from harnessd import ExecdClient, errors
from harnessd.api import READ_INLINE_MAX
from protocol.ledger_chain import GENESIS_HASH, chain_hashes
from tests.conftest import one_loop
from tests.support.daemon import RunningExecd, start_execd

pytestmark = [pytest.mark.anyio, one_loop]


async def test_small_and_large_files_round_trip(tmp_path: Path, client: ExecdClient) -> None:
    small = tmp_path / "w" / "small.txt"
    await client.write_file(str(small), b"hello\n", create_parents=True, mode=0o640)
    assert small.read_bytes() == b"hello\n"
    assert (small.stat().st_mode & 0o777) == 0o640
    assert await client.read_file(str(small)) == b"hello\n"
    # durable is carried by both the inline and the streamed form of the call.
    await client.write_file(str(small), b"durable\n", durable=True)
    assert small.read_bytes() == b"durable\n"
    await client.write_file(str(small), b"too\n", atomic=False, append=True, durable=True)
    assert small.read_bytes() == b"durable\ntoo\n"
    streamed = os.urandom(3 * 1024 * 1024)
    assert (await client.write_file(str(small), streamed, durable=True)).size == len(streamed)
    assert small.read_bytes() == streamed

    big = os.urandom(1024 * 1024) * 40  # 40 MiB: several frames and windows
    result = await client.write_file(str(tmp_path / "big.bin"), big)
    assert result.size == len(big)
    assert (tmp_path / "big.bin").read_bytes() == big
    assert await client.read_file(str(tmp_path / "big.bin")) == big
    digest = await client.sha256(str(tmp_path / "big.bin"))
    assert digest.sha256 == hashlib.sha256(big).hexdigest()

    listing = await client.list_dir(str(tmp_path / "w"))
    assert [e.path for e in listing.entries] == ["small.txt"]
    with pytest.raises(errors.NotFound):
        await client.read_file(str(tmp_path / "missing"))
    with pytest.raises(errors.IsADirectory):
        await client.read_file(str(tmp_path / "w"))
    await client.noop()


async def test_read_file_returns_every_block_in_order(tmp_path: Path, client: ExecdClient) -> None:
    """Inline and streamed content (spliced frames at execd, gathered in one buffer here) arrive
    whole and in order, on either side of read_file's inline bound."""
    block = 1024 * 1024
    content = hashlib.shake_256(b"order").digest(5 * block // 2)  # no block repeats another
    inline = READ_INLINE_MAX  # up to it in the reply, more on the stream
    sizes = (0, 1, inline - 1, inline, inline + 1, block - 1, block, block + 1, 2 * block)
    for size in (*sizes, len(content)):
        path = tmp_path / f"f{size}"
        path.write_bytes(content[:size])
        assert await client.read_file(str(path)) == content[:size]
    whole = str(tmp_path / f"f{len(content)}")
    assert (
        await client.read_file(whole, offset=block - 5, length=block + 10)
        == (content[block - 5 : 2 * block + 5])
    )


async def test_one_gib_file_streams_with_bounded_memory(
    execd: RunningExecd, tmp_path: Path, client: ExecdClient
) -> None:
    sparse = tmp_path / "sparse.bin"
    with open(sparse, "wb") as handle:
        handle.truncate(1024 * 1024 * 1024)
        handle.seek(-5, os.SEEK_END)
        handle.write(b"tail!")
    total = 0
    peak = 0
    last = b""
    async for data in client.iter_file(str(sparse)):
        total += len(data)
        last = data
        peak = max(peak, execd.rss_kib())
    assert total == 1024 * 1024 * 1024
    assert last.endswith(b"tail!")
    assert peak < 200 * 1024, f"execd RSS peaked at {peak} KiB"

    async def blocks() -> AsyncIterator[bytes]:
        block = b"z" * (1024 * 1024)
        for _ in range(256):
            yield block

    result = await client.write_stream(str(tmp_path / "up.bin"), blocks(), size=256 * 1024 * 1024)
    assert result.size == 256 * 1024 * 1024
    assert execd.rss_kib() < 200 * 1024
    assert (tmp_path / "up.bin").stat().st_size == 256 * 1024 * 1024


async def test_watch_events_arrive_over_the_wire(tmp_path: Path, client: ExecdClient) -> None:
    root = tmp_path / "watched"
    root.mkdir()
    watch = await client.watch(str(root), recursive=True)
    (root / "sub").mkdir()
    await asyncio.sleep(0.2)
    (root / "sub" / "file.txt").write_text("x")
    seen: list[tuple[str, str]] = []
    while not any(p.endswith("sub/file.txt") and k == "closed_write" for k, p in seen):
        kind, event = await watch.next(timeout=10)
        seen.append((kind, event.path))
    assert ("created", str(root / "sub")) in seen
    assert ("created", str(root / "sub" / "file.txt")) in seen
    await watch.close()

    waiter = asyncio.create_task(client.wait_for_path(str(tmp_path / "later" / "x"), timeout=10))
    await asyncio.sleep(0.2)
    (tmp_path / "later").mkdir()
    (tmp_path / "later" / "x").write_text("1")
    result = await waiter
    assert result.met


async def test_ledger_appends_conflicts_and_survives_restart(tmp_path: Path) -> None:
    payloads = [f"entry {i}".encode() for i in range(1, 11)]
    hashes = chain_hashes(GENESIS_HASH, 1, payloads)
    with start_execd(tmp_path) as daemon:
        async with harnessd.connect(daemon.host, daemon.port, daemon.token) as client:
            head = await client.ledger_append("s1", 1, GENESIS_HASH, payloads[:5])
            assert (head.seq, head.hash) == (5, hashes[4])
            with pytest.raises(errors.LedgerConflict) as caught:
                await client.ledger_append("s1", 7, hashes[5], payloads[6:])
            assert caught.value.data["seq"] == 5
            assert caught.value.data["hash"] == hashes[4]
    with start_execd(tmp_path) as daemon:
        async with harnessd.connect(daemon.host, daemon.port, daemon.token) as client:
            head = await client.ledger_head("s1")
            assert head.seq == 5
            head = await client.ledger_append("s1", 6, head.hash, payloads[5:])
            assert head.hash == hashes[-1]
            big = os.urandom(20 * 1024 * 1024)
            head = await client.ledger_append_large("s1", 11, head.hash, big)
            assert head.seq == 11
            records = await client.ledger_read("s1", 1, prev_hash=GENESIS_HASH)
            assert [r.payload for r in records] == [*payloads, big]
