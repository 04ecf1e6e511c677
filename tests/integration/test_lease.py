"""execd's lease against a real execd: only frames from an authenticated client hold it."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

import harnessd
from execd.marker import find_marked
from tests.conftest import eventually, one_loop
from tests.support import cli
from tests.support.daemon import RunningExecd

LEASE = 2.0
SLACK = 12.0

pytestmark = [
    pytest.mark.anyio,
    one_loop,
    pytest.mark.timeout(120),
    pytest.mark.execd_args("--lease", str(LEASE)),
]


async def test_a_silent_authenticated_connection_does_not_hold_the_lease(
    execd: RunningExecd,
) -> None:
    # No keepalive: the connection stays open and says nothing, as one
    # to a harness that vanished without closing TCP.
    client = await harnessd.connect(execd.host, execd.port, execd.token, keepalive=None)
    try:
        started = await client.run_detached(["sleep", "300"])
        await eventually(
            lambda: started.pid in find_marked("EXECD_MARKER", execd.marker), what="marked"
        )
        status = await asyncio.to_thread(execd.proc.wait, LEASE + SLACK)
        assert status == 0
        assert cli.wait_gone([started.pid], 5) == []
    finally:
        await client.close()
    assert "no frame from any authenticated client" in execd.log()
    assert find_marked("EXECD_MARKER", execd.marker) == []


async def test_keepalive_pings_hold_the_lease_until_the_client_goes(execd: RunningExecd) -> None:
    client = await harnessd.connect(execd.host, execd.port, execd.token, keepalive=0.25)
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # pinged, execd stays for three leases
            await asyncio.to_thread(execd.proc.wait, 3 * LEASE)
        await client.noop()
    finally:
        await client.close()
    assert await asyncio.to_thread(execd.proc.wait, LEASE + SLACK) == 0
    assert "no authenticated connection" in execd.log()
