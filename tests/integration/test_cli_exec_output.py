"""``harnessd exec -- echo`` prints the command's output every time, however slow this side is.

Run after run, and with the client made slow to start reading (by a pause
between starting the command and reading it, or by running it under
``strace -f``), the command is often over before its output is read: each run
must still print exactly what the command wrote.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.support import cli
from tests.support.daemon import RunningExecd, start_execd

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
#: Runs at once: the suite's machine is shared, and each run is a Python process.
AT_ONCE = 4


@pytest.fixture(scope="module")
def execd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningExecd]:
    with start_execd(tmp_path_factory.mktemp("execd")) as daemon:
        yield daemon


def _echo_runs(
    execd: RunningExecd, count: int, wrapper: Sequence[str] = (), module: str = "harnessd"
) -> list[str]:
    """Run ``exec -- echo done<i>`` ``count`` times; what each run that did not print it did."""
    argv, env = cli.harnessd_exec(execd.port, execd.token)
    argv = [*wrapper, sys.executable, "-m", module, *argv[3:]]
    failures: list[str] = []
    for first in range(0, count, AT_ONCE):
        runs = [
            (
                i,
                subprocess.Popen(
                    [*argv, "--", "echo", f"done{i}"],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
            for i in range(first, min(first + AT_ONCE, count))
        ]
        for i, proc in runs:
            out, err = proc.communicate(timeout=120)
            if (proc.returncode, out) != (0, f"done{i}\n"):
                failures.append(f"run {i}: status {proc.returncode}, {out!r}, {err[-300:]!r}")
    return failures


@pytest.mark.slow
def test_exec_prints_the_output_of_every_one_of_500_runs(execd: RunningExecd) -> None:
    assert _echo_runs(execd, 500) == []


def test_exec_prints_the_output_when_it_starts_reading_after_the_command_ended(
    execd: RunningExecd,
) -> None:
    assert _echo_runs(execd, 12, module="tests.support.slow_exec") == []


def _strace_works() -> bool:
    strace = shutil.which("strace")
    if strace is None:
        return False
    probe = subprocess.run(
        [strace, "-f", "-o", "/dev/null", "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


@pytest.mark.slow
def test_exec_prints_the_output_of_every_run_under_strace(execd: RunningExecd) -> None:
    if not _strace_works():
        pytest.skip("strace is missing or cannot trace here")
    assert _echo_runs(execd, 100, wrapper=("strace", "-f", "-o", "/dev/null")) == []
