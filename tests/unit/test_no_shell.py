"""execd where there is no shell: limits and terminals start without a ``/bin/sh`` prelude.

The shell is taken away by pointing execd's spawner at a path that does not
exist (what a bare image is like to execd); the commands themselves are real
processes, and what they report about themselves is what is checked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from execd.shell import ShellCapability
from execd.terminal import TerminalCapability
from protocol.rpc import shell as shell_rpc
from protocol.rpc import terminal as terminal_rpc
from protocol.rpc.resources import Limits
from tests.support.capabilities import capability_fixture
from tests.support.local_ctx import LocalContext

pytestmark = pytest.mark.anyio

shell = capability_fixture(ShellCapability, kill_grace=1.0, drain_grace=0.2)
terminals = capability_fixture(TerminalCapability, kill_grace=1.0, drain_grace=0.2)

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
def no_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("execd.spawn.SHELL", "/nonexistent/splitexec-test/sh")


def _own_memory_cgroup() -> list[str]:
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    return [line for line in lines if ":memory:" in line or line.startswith("0::")]


async def test_limits_apply_without_a_shell(
    no_shell: None, shell: ShellCapability, tmp_path: Path
) -> None:
    params = shell_rpc.RunParams(
        argv=[sys.executable, "-c", REPORT],
        cwd=str(tmp_path),
        limits=Limits(open_files=64, memory=512 << 20),
    )
    result = await shell.shell_run(params, LocalContext())
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["nofile"] == 64
    assert report["cwd"] == str(tmp_path)
    mechanism = (result.limits or {}).get("memory")
    if mechanism in ("cgroup-v1", "cgroup-v2"):
        # The child wrote itself into the command's cgroup before exec.
        assert report["memory"] != _own_memory_cgroup()


async def test_a_terminal_gets_its_cwd_limits_and_controlling_tty_without_a_shell(
    no_shell: None, terminals: TerminalCapability, tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    opened = await terminals.terminal_open(
        terminal_rpc.OpenParams(
            argv=[sys.executable, "-c", REPORT, str(out)],
            cwd=str(elsewhere),
            limits=Limits(open_files=48),
        ),
        LocalContext(),
    )
    ended = await terminals.terminal_wait(
        terminal_rpc.WaitParams(terminal_id=opened.terminal_id, timeout=30), LocalContext()
    )
    assert ended.exit_code == 0
    report = json.loads(out.read_text())
    assert report == {**report, "nofile": 48, "cwd": str(elsewhere), "ctty": True}
