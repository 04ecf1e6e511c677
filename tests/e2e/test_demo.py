"""``harnessd demo`` as a user runs it: a subprocess that must succeed and leave nothing behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from execd.marker import find_marked
from harnessd.trace import read_trace

pytestmark = pytest.mark.timeout(180)


def run_demo(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    trace = tmp_path / "demo-trace.jsonl"
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "harnessd", "demo", "--trace", str(trace), *args],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=str(tmp_path),
    )
    return proc, trace


@pytest.mark.parametrize("encrypt", [False, True])
def test_demo_succeeds_and_leaves_no_process(tmp_path: Path, encrypt: bool) -> None:
    proc, trace_path = run_demo(tmp_path, *(["--encrypt"] if encrypt else []))
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert "0 processes left" in out
    assert "demo succeeded" in out
    assert "verified against the local ledger" in out
    # Every tool call is shown with its round-trip time.
    timings = re.findall(r"<- (\w+) \[[\w-]+\] ([0-9.]+) ms, ok", out)
    tools = {name for name, _ in timings}
    assert {
        "shell",
        "read_file",
        "write_file",
        "list_files",
        "wait_for_path",
        "start_service",
        "service_logs",
        "session_run",
    } <= tools
    assert "failed" not in out.split("session ended")[0]
    assert "GREETING=persisted" in out
    assert "hello, demo" in out or "hello, {name}" in out
    if encrypt:
        assert "cipher aes-256-gcm" in out or "cipher chacha20-poly1305" in out
    else:
        assert "cipher none" in out

    records = read_trace(trace_path)
    kinds = [r["event"] for r in records]
    assert kinds[0] == "session_start"
    assert kinds.count("sync") == kinds.count("model_turn") + 1
    cleanup = [r for r in records if r["event"] == "cleanup"]
    assert cleanup and cleanup[0]["left"] == 0
    # Nothing carrying the session's marker survived (checked here, not only by execd).
    marker = re.search(r"marker ([0-9a-f]+)\)", out)
    assert marker is not None
    assert find_marked("EXECD_MARKER", marker.group(1)) == []
    # The workspace is gone.
    workspace = re.search(r"workspace: (\S+)", out)
    assert workspace is not None and not Path(workspace.group(1)).exists()
