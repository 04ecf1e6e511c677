"""Process checks shared by the tests."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.agents import processes_mentioning


def allow_open_files(count: int) -> None:
    """Raise this process's soft descriptor limit to ``count`` plus headroom, or skip the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = count + 256
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def state(pid: int) -> str | None:
    """The state letter of ``pid`` (``R``, ``S``, ``T``, ``Z``, ...), None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The state follows the parenthesised command name, which may contain spaces.
    return raw[raw.rfind(b")") + 2 :].split()[0].decode()


def cmdline(pid: int) -> str:
    """The command line of ``pid``, arguments joined by spaces ("" when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def live_children(parent: int) -> list[tuple[int, str]]:
    """Pid and program name of every live (not zombie) child of ``parent``."""
    found: list[tuple[int, str]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_bytes()
        except OSError:
            continue
        comm = raw[raw.find(b"(") + 1 : raw.rfind(b")")]
        fields = raw[raw.rfind(b")") + 2 :].split()
        if int(fields[1]) == parent and fields[0] not in (b"Z", b"X"):
            found.append((int(entry.name), comm.decode(errors="replace")))
    return found


def children(parent: int, name: str) -> list[int]:
    """Live children of ``parent`` that run the program ``name``."""
    return [pid for pid, comm in live_children(parent) if comm == name]


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (or dead)."""
    return state(pid) not in (None, "Z", "X")


def tcp_sockets_on(port: int) -> int:
    """TCP sockets bound to local ``port`` that still belong to an open file."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # fields[1] is "ADDRESS:PORT" in hex; fields[9] the inode, 0 once
            # no descriptor refers to the socket (closed, or never accepted).
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] != "0":
                count += 1
    return count


def descriptors(pid: int, port: int) -> int:
    """How many descriptors ``pid``, serving TCP on ``port``, holds, as far as we may see.

    Every one of them (``/proc/PID/fd``) where this user may list them: root,
    or the owner of a dumpable process. execd makes itself non-dumpable, which
    hands ``/proc/PID/fd`` to root, so for its own unprivileged user the count
    is of the sockets on ``port`` still held open (``/proc/net/tcp``, readable
    by all): the listener and every connection not closed yet, which is what
    a flood of connections could leak. One test uses one kind of count
    throughout, so comparisons against a baseline stay meaningful.
    """
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except PermissionError:
        return tcp_sockets_on(port)


def searchable_path(path: str | None = None) -> str:
    """``path`` (default ``$PATH``) without the directories this user may not search.

    A command looked up through a directory the user cannot enter fails with
    EACCES rather than ENOENT (glibc's execvp and dash agree), so a test that
    expects "not found" must not inherit, say, root's ``/root/...`` entries
    when ``su`` keeps root's PATH for an unprivileged user.
    """
    entries = (path if path is not None else os.environ.get("PATH", os.defpath)).split(os.pathsep)
    return os.pathsep.join(d for d in entries if d and os.access(d, os.X_OK))


def run_python(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the tests' interpreter with ``args``; its output captured as text, any status."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """Poll until ``pid`` is gone (or a zombie); False if it is still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


def wait_until_none_mention(tag: str, timeout: float) -> list[str]:
    """Poll until no process carries ``tag`` in its environment or argv; what is left then."""
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def terminate(proc: subprocess.Popen[Any], timeout: float = 15.0) -> None:
    """SIGTERM ``proc`` if it still runs and reap it; SIGKILL it after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
