"""The limits benches run and print a row per approach or phase (no speed is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_ARGS = ("-n", "4", "--batch", "2", "--baseline-ref", "HEAD")


def test_the_limits_spawn_bench_prints_its_rows() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.limits_spawn", *BENCH_ARGS],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
    )
    rows = {line.split("  ")[0] for line in proc.stdout.splitlines()[2:]}
    assert "no limits" in rows
    assert "rlimits (file_size, open_files)" in rows
    in_git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode
    if in_git == 0:
        assert "baseline no limits (HEAD)" in rows


def test_the_limits_noop_bench_prints_its_phases() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.limits_noop", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=ROOT,
    )
    lines = proc.stdout.splitlines()
    assert lines[2].startswith("idle (baseline)")
    assert any(line.startswith("cpu 1 s, busy loop") and "cpu via" in line for line in lines)
