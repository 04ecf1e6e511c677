"""The coverage-guided mode: each decoder target runs under atheris (when it installs here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from protocol.fuzz.coverage import TARGETS

atheris = pytest.importorskip("atheris", reason="the atheris extra is not installed")


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_target_runs_under_atheris(target: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "protocol.fuzz.coverage", target, "-runs=1500"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Done 1500 runs" in done.stderr
    assert "cov:" in done.stderr


def test_an_unknown_target_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "protocol.fuzz.coverage", "nothing"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "usage" in done.stdout
