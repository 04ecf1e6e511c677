"""The shell capability over real sockets: streaming, limits, lifetimes, and `harnessd exec`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import harnessd
from execd.marker import find_marked
from tests.support.daemon import RunningExecd, start_execd
from tests.support.procs import wait_gone


@pytest.fixture
def execd(tmp_path: Path) -> Iterator[RunningExecd]:
    with start_execd(tmp_path) as daemon:
        yield daemon


def test_one_gib_of_output_streams_with_bounded_memory(execd: RunningExecd) -> None:
    async def main() -> None:
        async with await harnessd.connect(execd.host, execd.port, execd.token) as client:
            command = client.run_streaming(["head", "-c", str(1024**3), "/dev/zero"])
            total = 0
            peak = 0
            async for name, data in command.output():
                assert name == "stdout"
                total += len(data)
                peak = max(peak, execd.rss_kib())
            result = await command.result()
            assert result.exit_code == 0
            assert total == 1024**3
            assert peak < 150 * 1024, f"execd RSS peaked at {peak} KiB"

    asyncio.run(main())


def test_hundred_concurrent_commands(execd: RunningExecd) -> None:
    async def main() -> None:
        async with await harnessd.connect(execd.host, execd.port, execd.token) as client:
            results = await asyncio.gather(
                *(client.run(command=f"echo {i}; sleep 0.2") for i in range(100))
            )
            assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(100)]
            assert all(r.exit_code == 0 for r in results)

    asyncio.run(main())


def test_timeout_kills_grandchildren(execd: RunningExecd, tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"

    async def main() -> None:
        async with await harnessd.connect(execd.host, execd.port, execd.token) as client:
            result = await client.run(
                command=f"sh -c 'sleep 300 & echo $! > {pidfile}; wait'", timeout=1.0
            )
            assert result.timed_out

    asyncio.run(main())
    assert wait_gone(int(pidfile.read_text()))


def test_dropped_connection_kills_its_commands_but_not_detached_ones(
    execd: RunningExecd, tmp_path: Path
) -> None:
    attached_pid = tmp_path / "attached.pid"

    async def first() -> str:
        client = await harnessd.connect(execd.host, execd.port, execd.token)
        detached = await client.run_detached(command="echo begin; sleep 2; echo end")
        assert detached.command_id is not None
        client.start("shell.run", {"command": f"echo $$ > {attached_pid}; exec sleep 300"})
        deadline = time.monotonic() + 10
        while not attached_pid.exists() or not attached_pid.read_text().strip():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await client.close()
        return detached.command_id

    command_id = asyncio.run(first())
    assert wait_gone(int(attached_pid.read_text()))

    async def second() -> None:
        async with await harnessd.connect(execd.host, execd.port, execd.token) as client:
            listed = await client.list_commands()
            assert command_id in [c.command_id for c in listed.commands]
            replay = client.attach(command_id)
            out = b"".join([data async for _, data in replay.output()])
            await replay.handle.result()
            assert out == b"begin\nend\n"

    asyncio.run(second())


def test_close_session_kills_double_forked_setsid_and_nohup(execd: RunningExecd) -> None:
    async def main() -> None:
        async with await harnessd.connect(execd.host, execd.port, execd.token) as client:
            await client.run(
                command="setsid sh -c 'sleep 300 &' ; nohup sleep 301 >/dev/null 2>&1 &"
            )
            await client.run(
                [
                    sys.executable,
                    "-c",
                    "import os,time\n"
                    "if os.fork()==0:\n"
                    "    os.setsid()\n"
                    "    if os.fork()==0:\n"
                    "        time.sleep(300)\n"
                    "    os._exit(0)\n",
                ]
            )
            assert len(find_marked("EXECD_MARKER", execd.marker)) >= 3
            report = await client.close_session()
            assert report.remaining == []

    asyncio.run(main())
    assert find_marked("EXECD_MARKER", execd.marker) == []


def _exec(
    execd: RunningExecd, *args: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, EXECD_TOKEN=execd.token)
    return subprocess.run(
        [sys.executable, "-m", "harnessd", "exec", "--port", str(execd.port), *args],
        input=stdin,
        capture_output=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_harnessd_exec_streams_forwards_stdin_and_exits_like_the_command(
    execd: RunningExecd,
) -> None:
    done = _exec(execd, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (done.returncode, done.stdout, done.stderr) == (7, b"out\n", b"err\n")
    piped = _exec(execd, "-i", "--", "tr", "a-z", "A-Z", stdin=b"hello\n")
    assert (piped.returncode, piped.stdout) == (0, b"HELLO\n")
    killed = _exec(execd, "--", "sh", "-c", "kill -TERM $$")
    assert killed.returncode == 128 + signal.SIGTERM
    timed = _exec(execd, "--timeout", "0.5", "--", "sleep", "30")
    assert timed.returncode == 128 + signal.SIGTERM
    assert b"timed out" in timed.stderr
