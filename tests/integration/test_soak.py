"""A 20-second soak of one execd: mixed calls from several clients, zero errors, flat memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.soak import SoakConfig, print_report, run_soak

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc"),
]


def test_twenty_second_soak_has_no_errors_and_bounded_rss() -> None:
    config = SoakConfig(clients=6, duration=20.0, sample_interval=0.5)
    report = run_soak(config)
    print_report(report)
    assert report.errors == 0, report.error_samples
    # Every kind of operation ran, many times, on every client's share of the mix.
    assert set(report.operations) == {"shell", "files", "watch", "service", "ledger"}
    assert min(report.operations.values()) >= config.clients, report.operations
    assert report.calls > 0 and report.calls_per_second > 0
    assert report.duration >= config.duration
    # RSS was sampled throughout the run, and did not keep growing after the warm-up.
    assert len(report.rss_samples) >= config.duration / config.sample_interval / 2
    assert report.rss_growth_kib <= config.max_rss_growth_kib, report.rss_samples
    assert report.rss_max - report.rss_first <= 4 * config.max_rss_growth_kib
    assert report.leftover == []
    assert report.ok


def test_command_line_reports_and_fails_on_a_tiny_rss_bound() -> None:
    """The CLI exits 0 on a clean run and 1 when the stated RSS bound is exceeded."""
    ok = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--clients", "2", "--duration", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "errors: 0" in ok.stdout and "result: ok" in ok.stdout
    strict = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--clients",
            "2",
            "--duration",
            "2",
            "--warmup",
            "0",
            "--max-rss-growth-mib",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "result: FAILED" in strict.stdout
