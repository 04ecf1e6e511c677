"""``python -m bench --quick`` runs every section and writes every row with numbers.

This checks that the bench works, not how fast anything is: no target is
asserted (a quick run gives no verdicts). It runs the real bench (real
execd, real baseline servers on loopback, the machine's sshd when it has
one) in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench import ssh_peer, swerex_peer
from bench.agents import processes_mentioning
from bench.suite import ROW_KEYS
from tests.support.procs import state

#: The OpenSSH section runs wherever sshd is installed (./check installs it as root).
SSH_HERE = ssh_peer.unavailable_reason(None) is None
#: Every row a run writes but SWE-ReX's (absent when its client cannot be imported, or an
#: operation it failed, which the report says) and, without sshd, OpenSSH's.
PEER = [key for key in ROW_KEYS if key.startswith("swerex.") or (not SSH_HERE and "ssh." in key)]
REQUIRED = [key for key in ROW_KEYS if key not in PEER]


def _expected(data: dict[str, Any]) -> list[str]:
    rows = {row["key"] for row in data["rows"]}
    present = [key for key in PEER if key in rows]
    # Per operation, both peers' rows or neither.
    assert {key.rsplit(".", 1)[0] for key in present} == {
        key.rsplit(".", 1)[0] for key in present if key.endswith(".execd")
    } and len(present) % 2 == 0
    # What is missing, the report says.
    skipped = {skip["section"] for skip in data["skipped"]}
    if len(present) < len([key for key in PEER if key.startswith("swerex.")]):
        assert swerex_peer.SECTION in skipped
    if not SSH_HERE:
        assert ssh_peer.SECTION in skipped
    return [key for key in ROW_KEYS if key in REQUIRED or key in present]


pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@dataclass(frozen=True)
class QuickRun:
    out: Path
    data: dict[str, Any]
    stderr: str


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    out = tmp_path_factory.mktemp("bench-out")
    scratch = tmp_path_factory.mktemp("bench-tmp")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out), "--tmp", str(scratch)],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data: dict[str, Any] = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    return QuickRun(out, data, proc.stderr)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def test_every_row_is_present_with_numbers(quick_run: QuickRun) -> None:
    data = quick_run.data
    assert data["quick"] is True
    rows = {row["key"]: row for row in data["rows"]}
    assert list(rows) == _expected(data)
    for key, row in rows.items():
        assert _number(row["p50"]) and row["p50"] > 0, (key, row["p50"])
        assert _number(row["p99"]) and row["p99"] > 0, (key, row["p99"])
        assert row["n"] >= 1, key
        assert row["unit"], key
        for base, ratio in row["ratios"].items():
            assert base in rows, (key, base)
            assert _number(ratio) and ratio > 0, (key, base, ratio)
        assert set(row["ratios"]) == set(row["baselines"]), key


def test_targets_are_given_without_verdicts(quick_run: QuickRun) -> None:
    data = quick_run.data
    targets = {row["key"]: row["target"] for row in data["rows"] if row["target"]}
    required = {
        "noop.execd",
        "noop.execd_aes",
        "pipe.execd",
        "spawn.execd",
        "spawn.execd_cwd",
        "files.small.execd_read",
        "files.small.execd_write",
        "files.small.execd_write_atomic",
        "files.medium.execd_read",
        "files.large.execd_read",
        "files.large.execd_write",
        "watch.execd",
        "start.execd",
        "ledger.large",
        "memory.idle",
        "memory.stream",
        "memory.retention",
        "turn.concurrent",
        "loop.call",
        "scale.connect",
        "scale.rss",
        "scale.cpu_many",
        "scale.keepalive",
    }
    # The open-loop latency target applies only at rates that kept our processes below
    # half of the machine's cores, which a loaded machine decides.
    optional = {"scale.open_low", "scale.open_mid", "scale.open_high"}
    assert required <= set(targets) <= required | optional
    for key, target in targets.items():
        # A quick run's samples are too small to judge by.
        assert target["met"] is None, key
        assert _number(target["value"]) and _number(target["limit"]), key


def test_markdown_headline_table_and_plot(quick_run: QuickRun) -> None:
    out, data = quick_run.out, quick_run.data
    text = (out / "bench.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert lines[0].startswith("One tool call (quick run): ")
    machine = next(line for line in lines if line.startswith("Machine: "))
    assert f"{data['facts']['cores']} cores" in machine
    assert f"Python {data['facts']['python']}" in machine
    assert f"uvloop {data['facts']['uvloop']}" in machine
    assert ("OpenSSH_" in machine) == SSH_HERE
    start = lines.index("| figure | p50 | p99 | ratio (p50) |")
    assert "| met |" not in text and "**missed**" not in text
    table_rows = [
        line for line in lines[start:] if line.startswith("| ") and not line.startswith("| **")
    ]
    # Header, separator, one line per row (section headings are bold and skipped).
    assert len(table_rows) == 2 + len(_expected(data))
    png = out / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "bench-targets.png").exists()


def test_the_headline_has_every_call_beside_the_floor_and_the_baselines(
    quick_run: QuickRun,
) -> None:
    out, data = quick_run.out, quick_run.data
    rows = {row["key"]: row for row in data["rows"]}
    figures = {item["call"]: item["figures"] for item in data["headline"]}
    assert list(figures) == ["no-op", "`true`", "4 KiB read"]
    assert set(figures["no-op"]) >= {"execd", "floor", "FastAPI (HTTP)", "gRPC"}
    assert set(figures["`true`"]) >= {"execd", "floor"}
    assert set(figures["4 KiB read"]) >= {"execd", "floor"}
    peers = [("SWE-ReX", "swerex", "swerex"), *([("OpenSSH", "ssh", "ssh")] if SSH_HERE else [])]
    for column, prefix, peer in peers:
        for call, op in (("`true`", "true"), ("4 KiB read", "read")):
            row = rows.get(f"{prefix}.{op}.{peer}")
            if row is None:
                # Only SWE-ReX may leave an operation out (and the report says so).
                assert prefix == "swerex"
                continue
            figure = figures[call][column]
            assert figure["p50_ms"] == pytest.approx(row["p50"])
            ratio = row["p50"] / rows[f"{prefix}.{op}.execd"]["p50"]
            assert figure["times_execd"] == pytest.approx(ratio)
    for cells in figures.values():
        for figure in cells.values():
            assert _number(figure["p50_ms"]) and figure["p50_ms"] > 0
    table = (out / "bench.md").read_text(encoding="utf-8").split("\n\n")[1].splitlines()
    assert [line.split(" | ")[0] for line in table[2:]] == [f"| {call}" for call in figures]


@pytest.mark.skipif(not SSH_HERE, reason=f"no OpenSSH here: {ssh_peer.unavailable_reason(None)}")
def test_the_openssh_section_ran_and_left_no_sshd_and_no_directory(quick_run: QuickRun) -> None:
    data = quick_run.data
    assert set(ssh_peer.ROW_KEYS) <= {row["key"] for row in data["rows"]}
    assert data["facts"]["openssh"].startswith("OpenSSH_")
    started = [
        found for line in quick_run.stderr.splitlines() if (found := ssh_peer.announced(line))
    ]
    assert len(started) == 1, quick_run.stderr[-4000:]
    pid, directory = started[0]
    assert state(pid) is None
    assert not os.path.exists(directory)
    assert processes_mentioning(directory) == []
