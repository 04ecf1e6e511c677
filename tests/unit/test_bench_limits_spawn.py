"""``python -m bench.limits_spawn`` runs and prints a row per approach (no speed is asserted)."""

from __future__ import annotations

import subprocess
import sys


def test_the_limits_spawn_bench_prints_its_rows() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.limits_spawn", "-n", "4", "--batch", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = {line.split("  ")[0] for line in proc.stdout.splitlines()[2:]}
    assert "no limits" in rows
    assert "rlimits (cpu, open_files)" in rows
    assert any(row.startswith("baseline no limits") for row in rows)
