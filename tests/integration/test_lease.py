"""execd's lease against a real execd: only frames from an authenticated client hold it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import harnessd
from execd.marker import find_marked
from tests.support import cli
from tests.support.daemon import start_execd

pytestmark = pytest.mark.timeout(120)

LEASE = 2.0
SLACK = 12.0


def test_a_silent_authenticated_connection_does_not_hold_the_lease(tmp_path: Path) -> None:
    with start_execd(tmp_path, "--lease", str(LEASE)) as daemon:

        async def main() -> None:
            # No keepalive: the connection stays open and says nothing, as one
            # to a harness that vanished without closing TCP.
            client = await harnessd.connect(daemon.host, daemon.port, daemon.token, keepalive=None)
            try:
                started = await client.run_detached(["sleep", "300"])
                assert started.pid in find_marked("EXECD_MARKER", daemon.marker)
                status = await asyncio.to_thread(daemon.proc.wait, LEASE + SLACK)
                assert status == 0
                assert cli.wait_gone([started.pid], 5) == []
            finally:
                await client.close()

        asyncio.run(main())
        assert "no frame from any authenticated client" in daemon.log()
        assert find_marked("EXECD_MARKER", daemon.marker) == []


def test_keepalive_pings_hold_the_lease_until_the_client_goes(tmp_path: Path) -> None:
    with start_execd(tmp_path, "--lease", str(LEASE)) as daemon:

        async def main() -> None:
            client = await harnessd.connect(daemon.host, daemon.port, daemon.token, keepalive=0.25)
            try:
                held_until = time.monotonic() + 3 * LEASE
                while time.monotonic() < held_until:
                    await asyncio.sleep(0.5)
                    assert daemon.proc.poll() is None, "execd left while pinged"
                await client.noop()
            finally:
                await client.close()

        asyncio.run(main())
        assert daemon.proc.wait(timeout=LEASE + SLACK) == 0
        assert "no authenticated connection" in daemon.log()
