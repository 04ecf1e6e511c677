"""A harness that dies without a word leaves nothing behind for longer than execd's lease.

``harnessd demo`` runs a scripted session whose second step is slow; while a
background service and that step run, the harness is SIGKILLed (no code of
its runs again) or SIGSTOPped (its TCP connection stays open and silent, as
when the harness machine vanishes). execd must notice within its lease, kill
every process carrying the marker and exit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from execd.marker import find_marked
from tests.support import cli

pytestmark = pytest.mark.timeout(120)

LEASE = 3.0
SLACK = 12.0
"""Seconds past the lease allowed for noticing, cleaning up and exiting on a busy machine."""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_nothing_outlives_a_vanished_harness_past_the_lease(tmp_path: Path, signum: int) -> None:
    script = cli.slow_demo_script(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "harnessd", "demo", "--script", str(script), "--lease", str(LEASE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
        cwd=str(tmp_path),
    )
    try:
        assert proc.stdout is not None
        head = cli.read_until(proc.stdout, "a slow step", time.monotonic() + 60)
        up = re.search(r"execd up at \S+ \(pid (\d+), .*marker ([0-9a-f]+)\)", head)
        assert up is not None, head
        execd_pid, marker = int(up.group(1)), up.group(2)
        deadline = time.monotonic() + 30
        while len(marked := find_marked("EXECD_MARKER", marker)) < 2:
            assert time.monotonic() < deadline, f"the session's processes never ran: {marked}"
            time.sleep(0.05)
        proc.send_signal(signum)
        gone_by = time.monotonic() + LEASE + SLACK
        assert cli.wait_gone([execd_pid, *marked], gone_by - time.monotonic()) == []
        assert find_marked("EXECD_MARKER", marker) == []
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
