"""``python -m bench.cores`` times both floors' targets and the floor server on every placement.

This checks that the tool works, not how fast anything is: it runs the real
tool (a real execd, real writes and spawns) in a subprocess, as a user would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cores import block_interrupts, placements

CORES = sorted(os.sched_getaffinity(0))


def test_placements_put_both_on_each_core_then_each_on_its_own() -> None:
    assert placements([3]) == [(3, 3)]
    assert placements([1, 4, 7]) == [(1, 1), (4, 4), (1, 4), (4, 1)]


def test_a_filesystem_without_a_block_device_has_no_interrupts() -> None:
    assert os.major(os.stat("/proc").st_dev) == 0
    assert block_interrupts("/proc") == []


def test_a_disk_s_interrupts_are_named_from_proc_interrupts(tmp_path: Path) -> None:
    known = Path("/proc/interrupts").read_text(encoding="ascii", errors="replace")
    for irq, name, cores in block_interrupts(str(tmp_path)):
        assert re.search(rf"^\s*{irq}:.*\s{re.escape(name)}$", known, re.MULTILINE)
        assert cores == "?" or re.fullmatch(r"[0-9,-]+", cores)


@pytest.mark.timeout(300)
def test_the_tool_prints_a_row_per_placement(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cores", "-n", "4", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    rows = [line.split() for line in lines if re.match(r"\s*\d+ / \d+ ", line)]
    assert [(int(r[0]), int(r[2])) for r in rows] == placements(CORES)
    for row in rows:
        noop, server_noop, *pairs = row[3:]
        assert float(noop) > 0 and float(server_noop) > 0
        for execd, server, local, over_local, over_server in (pairs[:5], pairs[5:]):
            assert all(float(v) > 0 for v in (execd, server, local))
            assert abs(int(over_local) - (int(execd) - int(local))) <= 1
            assert abs(int(over_server) - (int(execd) - int(server))) <= 1
    assert lines[-1].startswith("block device interrupts: ")
    assert os.listdir(tmp_path) == []  # its own directory is gone, with all three files
