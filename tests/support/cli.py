"""Running the command lines as a user does, and what a mistake must look like."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from tests.support.procs import alive


def run(
    module: str,
    *args: str,
    env: dict[str, str] | None = None,
    stdin: bytes = b"",
    timeout: float = 60,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` to completion, output as text."""
    child_env = dict(os.environ)
    child_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        input=stdin.decode(),
        capture_output=True,
        text=True,
        env=child_env,
        timeout=timeout,
        check=False,
        cwd=str(cwd) if cwd is not None else None,
    )


PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
"""Proxy settings a test's child must not inherit when it talks to loopback servers."""


def spawn(
    tmp_path: Path, module: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``python -m MODULE ARGS`` started in ``tmp_path`` (also its TMPDIR), pipes as text.

    The child gets no proxy settings, so loopback servers are reached directly.
    """
    child_env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    child_env["TMPDIR"] = str(tmp_path)
    child_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env,
        cwd=str(tmp_path),
    )


def token_file_mistakes(directory: Path) -> list[tuple[Path, str]]:
    """Token files execd and ``harnessd exec`` refuse, each with what the error must say.

    A missing file, a directory, and an empty file made in ``directory``.
    """
    empty = directory / "empty-token"
    empty.write_text(" \n")
    return [
        (directory / "missing-token", "No such file"),
        (directory, "Is a directory"),
        (empty, "empty"),
    ]


def one_line(stderr: str, command: str) -> str:
    """The single stderr line of a mistake: no traceback, starts with the command's name."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith(f"{command}: "), lines[0]
    return lines[0]


def harnessd_exec(port: int, token: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``harnessd exec ARGS`` against execd at ``port``.

    The token goes in the environment (``EXECD_TOKEN``), never on the command line.
    """
    argv = [sys.executable, "-m", "harnessd", "exec", "--port", str(port), *args]
    return argv, dict(os.environ, EXECD_TOKEN=token)


def assert_no_log_kept(stdout: str) -> None:
    """After a run whose execd closed cleanly: execd's directory is gone and no log was kept.

    However the model's part ended (finished, failed, interrupted), the run
    printed where execd's log was (``execd's log: PATH (...)``), and that
    directory is gone with it.
    """
    assert "execd's log kept" not in stdout, stdout
    log = re.search(r"^execd's log: (\S+) \(kept only if execd fails\)$", stdout, re.MULTILINE)
    assert log is not None, stdout
    assert not os.path.exists(os.path.dirname(log.group(1)))


def read_until(stream: IO[str], pattern: str, deadline: float) -> str:
    """Lines from ``stream`` up to and including the first matching ``pattern`` (a regex).

    Reads the descriptor a byte at a time, so nothing past that line is taken
    into the stream's buffer: ``Popen.communicate()`` reads the descriptor
    itself afterwards and would never see bytes a buffered ``readline`` had
    read ahead.
    """
    fd = stream.fileno()
    seen: list[str] = []
    line = bytearray()
    while time.monotonic() < deadline:
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
        if byte != b"\n":
            continue
        text = line.decode(errors="replace")
        line.clear()
        seen.append(text)
        if re.search(pattern, text):
            return "".join(seen)
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)}{line.decode()}")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@contextlib.contextmanager
def foreign_server(answer: bytes | None) -> Iterator[int]:
    """A TCP server on loopback that is not execd; yields its port.

    It reads what a client sends first, then writes ``answer`` and closes
    (``None``: it holds the connection open and says nothing, as a server
    waiting for more of a request does). Real sockets, served by a thread.
    """
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(65536)
            if answer is None:
                held.append(conn)
                continue
            with contextlib.suppress(OSError):
                conn.sendall(answer)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
        for conn in held:
            conn.close()


HTTP_400 = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 37\r\n"
    b'Connection: close\r\n\r\n{"error": {"message": "bad request"}}'
)
"""What many HTTP servers answer to bytes they cannot parse (and a model endpoint to a bad call)."""


SLOW_DEMO_SCRIPT = {
    "task": "start a service, then run a long step",
    "turns": [
        {
            "content": "a background service",
            "tool_calls": [
                {"name": "start_service", "arguments": {"name": "idle", "command": "sleep 300"}}
            ],
        },
        {
            "content": "a slow step",
            "tool_calls": [{"name": "shell", "arguments": {"command": "sleep 300"}}],
        },
        {"content": "done"},
    ],
}
"""A ``harnessd demo --script``: two marked processes run while the second turn waits."""


def slow_demo_script(directory: Path) -> Path:
    """Write :data:`SLOW_DEMO_SCRIPT` into ``directory``; its path."""
    path = directory / "slow.json"
    path.write_text(json.dumps(SLOW_DEMO_SCRIPT))
    return path
