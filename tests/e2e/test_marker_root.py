"""Marker cleanup across users: a cleaner only ever kills its own uid's processes.

Runs as root and uses the existing unprivileged ``nobody`` account (uid and
gid 65534) through ``setpriv`` from util-linux, so no user is created. The
cleaner runs as nobody with an interpreter and a copy of execd's packages that
nobody can read (:mod:`tests.support.worker_env`): the tests' own interpreter
may live in a home directory only root can enter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from execd.marker import child_environment, cleanup, find_marked
from protocol.values import new_marker
from tests.support.worker_env import WorkerPython, worker_python_or_skip

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc"),
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0,
        reason="needs root to run processes as another user",
    ),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is missing"),
]

NOBODY = 65534
VAR = "EXECD_MARKER_TEST"
SLEEP = shutil.which("sleep") or "/bin/sleep"
SETPRIV = shutil.which("setpriv") or "setpriv"
AS_NOBODY = [
    SETPRIV,
    f"--reuid={NOBODY}",
    f"--regid={NOBODY}",
    "--clear-groups",
]

CLEANER = r"""
import json, sys
from execd.marker import cleanup, find_marked
var, marker = sys.argv[1:3]
seen = find_marked(var, marker)
report = cleanup(var, marker, timeout=20)
print(json.dumps({"seen": seen, "killed": report.killed, "remaining": report.remaining}))
"""


def _plain_env() -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _uids(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("Uid:"):
                real, effective = line.split()[1:3]
                return int(real), int(effective)
    raise AssertionError("no Uid line")


class Procs:
    def __init__(self) -> None:
        self.marker = new_marker()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            argv,
            env=child_environment(_plain_env(), VAR, self.marker),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
        )
        self.procs.append(proc)
        return proc

    def wait_uids(self, proc: subprocess.Popen[bytes], want: tuple[int, int]) -> None:
        """Wait until ``proc`` (started through setpriv) runs ``sleep`` with ``want`` uids."""
        deadline = time.monotonic() + 20
        while True:
            try:
                with open(f"/proc/{proc.pid}/comm") as fh:
                    comm = fh.read().strip()
                if comm == "sleep" and _uids(proc.pid) == want:
                    return
            except OSError:
                pass
            assert proc.poll() is None, "the process exited early"
            assert time.monotonic() < deadline, "the process never dropped privileges"
            time.sleep(0.02)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def nobody_python() -> Iterator[WorkerPython]:
    yield from worker_python_or_skip(AS_NOBODY)


@pytest.fixture
def procs() -> Iterator[Procs]:
    state = Procs()
    try:
        yield state
    finally:
        state.close()


def test_cleanup_as_nobody_spares_other_uids(procs: Procs, nobody_python: WorkerPython) -> None:
    root_owned = procs.start([SLEEP, "300"])
    nobody_owned = procs.start([*AS_NOBODY, SLEEP, "300"])
    mixed = procs.start([SETPRIV, f"--ruid={NOBODY}", SLEEP, "300"])
    procs.wait_uids(nobody_owned, (NOBODY, NOBODY))
    procs.wait_uids(mixed, (NOBODY, 0))

    out = subprocess.run(
        [*AS_NOBODY, nobody_python.python, "-c", CLEANER, VAR, procs.marker],
        env=_plain_env() | nobody_python.environment(),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"seen": [nobody_owned.pid], "killed": 1, "remaining": []}
    assert nobody_owned.wait(timeout=20) == -signal.SIGKILL
    assert root_owned.poll() is None, "a root-owned marked process survives"
    assert mixed.poll() is None, "a process whose effective uid is root survives"


def test_root_cleanup_of_another_uid_only(procs: Procs) -> None:
    root_owned = procs.start([SLEEP, "300"])
    nobody_owned = procs.start([*AS_NOBODY, SLEEP, "300"])
    real_only = procs.start([SETPRIV, f"--ruid={NOBODY}", SLEEP, "300"])
    effective_only = procs.start([SETPRIV, f"--euid={NOBODY}", SLEEP, "300"])
    procs.wait_uids(nobody_owned, (NOBODY, NOBODY))
    procs.wait_uids(real_only, (NOBODY, 0))
    procs.wait_uids(effective_only, (0, NOBODY))

    # Root can read every environment here, so only the uid rule decides.
    assert find_marked(VAR, procs.marker, uid=NOBODY) == [nobody_owned.pid]
    report = cleanup(VAR, procs.marker, timeout=20, uid=NOBODY)
    assert report.killed == 1 and report.remaining == []
    assert nobody_owned.wait(timeout=20) == -signal.SIGKILL
    for survivor in (root_owned, real_only, effective_only):
        assert survivor.poll() is None
    assert find_marked(VAR, procs.marker) == [root_owned.pid]
