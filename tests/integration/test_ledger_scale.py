"""A 100 MiB ledger built from 10,000 appends over the wire, no frame above the cap."""

from __future__ import annotations

import os

import pytest

import harnessd
from harnessd.ledger_sync import LedgerSync, LocalLedger
from tests.conftest import one_loop
from tests.support.daemon import RunningExecd

FRAME_CAP = 1024 * 1024

pytestmark = [pytest.mark.anyio, one_loop]


@pytest.mark.execd_args("--max-frame", str(FRAME_CAP))
async def test_hundred_mib_ledger_from_ten_thousand_appends(execd: RunningExecd) -> None:
    client = await harnessd.connect(execd.host, execd.port, execd.token, max_frame=FRAME_CAP)
    async with client:
        # Both sides refuse frames over 1 MiB: any oversized frame would
        # abort the connection, so success proves every frame fit.
        assert client.info.peer_max_frame == FRAME_CAP
        local = LocalLedger()
        sync = LedgerSync("scale", local)
        sent = 0
        for index in range(10_000):
            # Mostly ~10 KiB entries; every 1000th is 3 MiB, bigger than a frame.
            size = 3 * 1024 * 1024 if index % 1000 == 999 else 10 * 1024
            local.append_payload(os.urandom(16) + bytes(size - 16))
            report = await sync.sync(client)
            sent += report.entries
        assert sent == 10_000
        head = await client.ledger_head("scale")
        assert (head.seq, head.hash) == (local.seq, local.head_hash)
        tail = await client.ledger_read("scale", 9_990, prev_hash=local.hash_at(9_989))
        assert [r.payload for r in tail] == list(local.payloads(9_990))
    data = next((execd.state_dir / "ledger").glob("scale*.ledger"))
    assert data.stat().st_size > 100 * 1024 * 1024
