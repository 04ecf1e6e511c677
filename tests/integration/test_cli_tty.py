"""``harnessd exec -it`` driven from a real pseudo-terminal on the harness side."""

from __future__ import annotations

import contextlib
import os
import pty
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from execd.marker import find_marked
from tests.conftest import eventually_blocking
from tests.support.daemon import RunningExecd, start_execd


@pytest.fixture
def execd(tmp_path: Path) -> Iterator[RunningExecd]:
    with start_execd(tmp_path) as daemon:
        yield daemon


@dataclass
class _Exec:
    """A running ``harnessd exec -it`` on a fresh pseudo-terminal, in raw mode."""

    proc: subprocess.Popen[bytes]
    master: int
    slave: int
    #: The terminal's attributes before exec changed them.
    before: list[Any]


@contextlib.contextmanager
def _exec_it(execd: RunningExecd, *argv: str) -> Iterator[_Exec]:
    """Start ``harnessd exec -it -- argv`` on a new pty and wait for raw mode; kill and close after."""
    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)
    env = dict(os.environ, EXECD_TOKEN=execd.token, TERM="xterm")
    proc = subprocess.Popen(
        [sys.executable, "-m", "harnessd", "exec", "-it", "--port", str(execd.port), "--", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    try:
        # Raw mode here: the local line discipline no longer echoes or cooks.
        # It takes a Python start and a connection: more than the usual 10 s on a loaded machine.
        eventually_blocking(
            lambda: not termios.tcgetattr(slave)[3] & termios.ICANON, timeout=30.0, what="raw"
        )
        yield _Exec(proc, master, slave, before)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)


def _read_until(master: int, wanted: bytes, timeout: float = 20.0) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    os.set_blocking(master, False)
    while wanted not in seen:
        assert time.monotonic() < deadline, f"{wanted!r} not seen in {seen!r}"
        try:
            seen += os.read(master, 4096)
        except BlockingIOError:
            time.sleep(0.01)
    return seen


def test_exec_it_restores_the_local_terminal_and_returns_the_status(execd: RunningExecd) -> None:
    with _exec_it(execd, "sh") as run:
        os.write(run.master, b"tty; stty size; exit 7\r")
        output = _read_until(run.master, b"exit 7")
        assert run.proc.wait(timeout=30) == 7
        output += _drain(run.master)
        assert b"/dev/pts/" in output
        assert termios.tcgetattr(run.slave) == run.before


def test_exec_it_ctrl_c_reaches_the_remote_program(execd: RunningExecd) -> None:
    with _exec_it(execd, "sh", "-c", "sleep 30; echo after-$?") as run:
        # Ctrl-C reaches the remote sleep once it runs (before, it would be typed-ahead input).
        eventually_blocking(lambda: _remote_sleep_running(execd), what="remote sleep running")
        os.write(run.master, b"\x03")
        status = run.proc.wait(timeout=30)
        assert status in (130, 0), status
        assert termios.tcgetattr(run.slave) == run.before


def _remote_sleep_running(execd: RunningExecd) -> bool:
    """Whether this execd's ``sleep 30`` runs (not another test's: only its marked processes)."""
    for pid in find_marked("EXECD_MARKER", execd.marker):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x0030\x00":
                return True
        except OSError:
            continue
    return False


def _drain(master: int) -> bytes:
    data = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except (BlockingIOError, OSError):
            return data
        if not chunk:
            return data
        data += chunk


@pytest.mark.parametrize("way_out", ["sigterm", "lost connection"])
def test_exec_it_restores_the_terminal_on_every_way_out(execd: RunningExecd, way_out: str) -> None:
    with _exec_it(execd, "sh") as run:
        os.write(run.master, b"echo ready-$((6*7))\r")
        _read_until(run.master, b"ready-42")
        if way_out == "sigterm":
            run.proc.send_signal(signal.SIGTERM)
            assert run.proc.wait(timeout=30) == 128 + signal.SIGTERM
        else:
            execd.proc.kill()
            execd.proc.wait()
            assert run.proc.wait(timeout=30) == 255
        assert termios.tcgetattr(run.slave) == run.before
