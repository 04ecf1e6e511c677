"""execd where no shell can run: limits, working directories and terminals without ``/bin/sh``.

execd runs in a mount namespace of its own in which every shell of this
machine (``/bin/sh`` and all ``/etc/shells`` lists) has an empty, non-executable
file mounted over it (:mod:`tests.support.no_shell`): what a bare image is
like. The commands are real processes and report their own state -- open-files
limit, working directory, controlling terminal, cgroup -- from ``/proc`` and
the kernel, so these tests fail if starting them needs a shell prelude again.
Needs root for the mount namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import harnessd
from harnessd.api import ExecdClient
from harnessd.errors import SpawnFailed
from tests.conftest import one_loop
from tests.support.daemon import RunningExecd, start_execd

pytestmark = [
    pytest.mark.anyio,
    one_loop,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare (util-linux) is missing"),
    pytest.mark.timeout(60),
]

NO_SHELL = Path(__file__).resolve().parents[1] / "support" / "no_shell.py"

# Prints, as JSON: the soft open-files limit, the working directory, whether
# stdin is a terminal that is the controlling terminal of the process's own
# session, and the memory cgroup; into the file named by argv[1], or stdout.
REPORT = """
import json, os, resource, sys
try:
    os.close(os.open("/dev/tty", os.O_RDWR))
    ctty = os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp() == os.getsid(0)
except OSError:
    ctty = False
cgroups = open("/proc/self/cgroup").read().splitlines()
report = json.dumps({
    "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
    "cwd": os.getcwd(),
    "ctty": ctty,
    "memory": [line for line in cgroups if ":memory:" in line or line.startswith("0::")],
})
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(report)
else:
    print(report)
"""


@pytest.fixture
def shell_less_execd(tmp_path: Path) -> Iterator[RunningExecd]:
    """A real execd for which no shell of this machine can run."""
    blank = tmp_path / "blank"
    blank.write_bytes(b"")
    blank.chmod(0o644)
    prefix = ["unshare", "--mount", "--propagation", "private", "--"]
    prefix += [sys.executable, str(NO_SHELL), str(blank), "--"]
    with start_execd(tmp_path, "--port", "0", prefix=prefix) as daemon:
        yield daemon


@pytest.fixture
async def client(shell_less_execd: RunningExecd) -> AsyncIterator[ExecdClient]:
    daemon = shell_less_execd
    async with await harnessd.connect(daemon.host, daemon.port, daemon.token) as connected:
        yield connected


def _own_memory_cgroup() -> list[str]:
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    return [line for line in lines if ":memory:" in line or line.startswith("0::")]


async def test_there_is_no_shell_to_start(client: ExecdClient) -> None:
    with pytest.raises(SpawnFailed):
        await client.run(command="true")
    with pytest.raises(SpawnFailed):
        await client.run(["sh", "-c", "true"])
    with pytest.raises(SpawnFailed):
        await client.run(["/bin/sh", "-c", "true"], limits={"open_files": 64})


async def test_limits_and_a_cwd_apply_without_a_shell(client: ExecdClient, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = await client.run(
        [sys.executable, "-c", REPORT],
        cwd=str(elsewhere),
        limits={"open_files": 64, "memory": 512 << 20},
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["nofile"] == 64
    assert report["cwd"] == str(elsewhere)
    mechanism = (result.limits or {}).get("memory")
    if mechanism in ("cgroup-v1", "cgroup-v2"):
        # The child wrote itself into the command's cgroup before exec.
        assert report["memory"] != _own_memory_cgroup()


async def test_a_terminal_gets_its_cwd_limits_and_controlling_tty_without_a_shell(
    client: ExecdClient, tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    terminal = await client.open_terminal(
        [sys.executable, "-c", REPORT, str(out)],
        cwd=str(elsewhere),
        limits={"open_files": 48},
    )
    ended = await terminal.wait(timeout=30)
    assert ended.exit_code == 0
    report = json.loads(out.read_text())
    assert report == {**report, "nofile": 48, "cwd": str(elsewhere), "ctty": True}
