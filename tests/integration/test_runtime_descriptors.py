"""Commands harnessd starts get standard input, output and error, and no other descriptor.

On both loops (uvloop is what the command line runs on): while the harness
holds a TCP connection, a pipe and a descriptor it inherited from whatever
started it, a command run through :func:`harnessd.runtime.run_process` -- and
execd started in the background through a command prefix -- must hold none of
them, nor any descriptor of the runtime's own plumbing. A descriptor left in
execd keeps the other end of whatever it is open for execd's whole life: the
launcher waiting for a background start's output to end would wait that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harnessd.launcher import serve
from harnessd.runtime import CommandPrefixRuntime, WorkspaceError, run_process

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

# Prints "FD TARGET" for each of its own open descriptors.
LIST_FDS = """
import os
for fd in sorted(os.listdir("/proc/self/fd"), key=int):
    try:
        print(fd, os.readlink(f"/proc/self/fd/{fd}"))
    except FileNotFoundError:
        pass  # the listing's own descriptor, closed by now
"""


def _target(fd: int, pid: int | str = "self") -> str:
    return os.readlink(f"/proc/{pid}/fd/{fd}")


@pytest.fixture
async def held() -> AsyncIterator[set[str]]:
    """The harness holds a loopback TCP connection, a pipe, and an inheritable descriptor.

    The last stands for what a harness inherits from whatever started it. What
    comes back is their targets as /proc shows them (``socket:[N]``, ...).
    """
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    read_end, write_end = os.pipe()
    inherited = os.dup(write_end)
    os.set_inheritable(inherited, True)
    connection: socket.socket = writer.get_extra_info("socket")
    fds = (connection.fileno(), read_end, write_end, inherited)
    try:
        yield {_target(fd) for fd in fds}
    finally:
        for fd in (read_end, write_end, inherited):
            os.close(fd)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        server.close()
        await server.wait_closed()


def _parse(listing: bytes) -> dict[int, str]:
    pairs = (line.split(" ", 1) for line in listing.decode().splitlines())
    return {int(fd): target for fd, target in pairs}


async def test_a_command_gets_only_its_standard_descriptors(held: set[str]) -> None:
    result = await run_process([sys.executable, "-c", LIST_FDS])
    assert result.exit_code == 0, result.stderr
    descriptors = _parse(result.stdout)
    assert sorted(descriptors) == [0, 1, 2], descriptors
    assert not held & set(descriptors.values())


async def test_a_command_fed_on_stdin_gets_only_its_standard_descriptors(held: set[str]) -> None:
    script = f"import sys; sys.stdin.read(); exec({LIST_FDS!r})"
    result = await run_process([sys.executable, "-c", script], stdin=b"input\n")
    assert result.exit_code == 0, result.stderr
    assert sorted(_parse(result.stdout)) == [0, 1, 2], result.stdout


async def test_execd_started_through_a_prefix_holds_nothing_of_the_harness(
    held: set[str], tmp_path: Path
) -> None:
    """The background start returns while execd runs on; execd has none of the harness's descriptors.

    A leaked descriptor of the start's own output would hold the start (and so
    the launch) until execd exits: here after its lease, failing the launch.
    """
    runtime = CommandPrefixRuntime(["env"])
    state = ("--state-dir", str(tmp_path / "state"))
    async with serve(runtime, lease=10.0, extra_args=state) as session:
        execd_fds = {
            int(fd): _target(int(fd), session.pid) for fd in os.listdir(f"/proc/{session.pid}/fd")
        }
        assert not held & set(execd_fds.values()), execd_fds
        ran = await session.client.run(["true"])
        assert ran.exit_code == 0


async def test_the_exit_is_awaited_where_there_is_no_pidfd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kernels before 5.3 have no pidfd_open: a thread waits for the command instead."""

    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    result = await run_process([sys.executable, "-c", "import sys; sys.exit(7)"])
    assert result.exit_code == 7
    with pytest.raises(WorkspaceError, match="timed out"):
        await run_process(["sleep", "30"], timeout=0.5)
