"""A bench run stopped by SIGINT, SIGTERM or SIGHUP runs every ``finally`` block on its way out.

Real processes: a small program on :func:`bench.runner.run`, and the real
``python -m bench.scale --quick`` with its real execds, signalled mid-run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.agents import processes_mentioning
from tests.support.procs import wait_until_none_mention

PROGRAM = textwrap.dedent(
    """
    import asyncio, sys
    from bench import runner

    async def main() -> str:
        try:
            print("ready", flush=True)
            await asyncio.sleep(float(sys.argv[2]))
            return "finished"
        finally:
            with open(sys.argv[1], "w") as handle:
                handle.write("cleaned up")

    print(runner.run(main(), "test"))
    """
)


def start(tmp_path: Path, sleep: float) -> tuple[subprocess.Popen[str], Path]:
    done = tmp_path / "finally"
    proc = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, str(done), str(sleep)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    return proc, done


def test_a_run_that_ends_returns_its_value(tmp_path: Path) -> None:
    proc, done = start(tmp_path, 0.01)
    out, _ = proc.communicate(timeout=30)
    assert (proc.returncode, out, done.read_text()) == (0, "finished\n", "cleaned up")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_sigint_sigterm_and_sighup_cancel_the_run_and_every_finally_runs(
    tmp_path: Path, signum: int
) -> None:
    proc, done = start(tmp_path, 60)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=30)
    assert (proc.returncode, out, done.read_text()) == (128 + signum, "", "cleaned up")


def _execds_of(directory: Path) -> list[str]:
    """The execds whose environment or arguments name ``directory``."""
    return [p for p in processes_mentioning(str(directory)) if " -m execd " in p]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_scale_stopped_by_sigterm_stops_its_execds_and_leaves_no_directory(
    tmp_path: Path,
) -> None:
    private, work = tmp_path / "tmp", tmp_path / "work"
    private.mkdir()
    work.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.scale", "--quick", "--tmp", str(work)],
        env={**os.environ, "TMPDIR": str(private)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The quick run's four execds are up (their directories are in TMPDIR).
        deadline = time.monotonic() + 60
        while len(_execds_of(private)) < 4 and proc.poll() is None:
            assert time.monotonic() < deadline, "the quick run's execds did not start"
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert wait_until_none_mention(str(private), timeout=5) == []
    assert [p.name for p in private.iterdir() if p.name.startswith("execd-bench-")] == []
