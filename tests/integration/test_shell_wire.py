"""The shell capability over real sockets: streaming, limits, lifetimes, and `harnessd exec`."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import harnessd
from execd.marker import find_marked
from harnessd import ExecdClient
from tests.conftest import eventually, one_loop
from tests.support import cli
from tests.support.daemon import RunningExecd
from tests.support.procs import alive

pytestmark = [pytest.mark.anyio, one_loop]


async def gone(pid: int) -> None:
    await eventually(lambda: not alive(pid), what=f"the end of {pid}")


async def test_one_gib_of_output_streams_with_bounded_memory(
    execd: RunningExecd, client: ExecdClient
) -> None:
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


async def test_hundred_concurrent_commands(client: ExecdClient) -> None:
    results = await asyncio.gather(
        *(client.run(command=f"echo {i}; sleep 0.2") for i in range(100))
    )
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(100)]
    assert all(r.exit_code == 0 for r in results)


async def test_timeout_kills_grandchildren(tmp_path: Path, client: ExecdClient) -> None:
    pidfile = tmp_path / "grandchild.pid"
    result = await client.run(command=f"sh -c 'sleep 300 & echo $! > {pidfile}; wait'", timeout=1.0)
    assert result.timed_out
    await gone(int(pidfile.read_text()))


async def test_dropped_connection_kills_its_commands_but_not_detached_ones(
    execd: RunningExecd, client: ExecdClient, tmp_path: Path
) -> None:
    attached_pid = tmp_path / "attached.pid"
    dropped = await harnessd.connect(execd.host, execd.port, execd.token)
    # Calls without request ids: those with one outlive the connection for a grace
    # period instead (tests/integration/test_requests.py).
    dropped.request_ids = False
    detached = await dropped.run_detached(command="echo begin; sleep 2; echo end")
    assert detached.command_id is not None
    dropped.start("shell.run", {"command": f"echo $$ > {attached_pid}; exec sleep 300"})

    def written_pid() -> str:
        return attached_pid.read_text().strip() if attached_pid.exists() else ""

    pid = await eventually(written_pid)
    await dropped.close()
    await gone(int(pid))

    listed = await client.list_commands()
    assert detached.command_id in [c.command_id for c in listed.commands]
    replay = client.attach(detached.command_id)
    out = b"".join([data async for _, data in replay.output()])
    attached = await replay.result()
    assert out == b"begin\nend\n"
    assert attached.info.command_id == detached.command_id and attached.info.exit_code == 0


async def test_close_session_kills_double_forked_setsid_and_nohup(
    execd: RunningExecd, client: ExecdClient
) -> None:
    await client.run(command="setsid sh -c 'sleep 300 &' ; nohup sleep 301 >/dev/null 2>&1 &")
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
    report = await client.shutdown()
    assert report.remaining == []
    assert find_marked("EXECD_MARKER", execd.marker) == []


def _exec(
    execd: RunningExecd, *args: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    argv, env = cli.harnessd_exec(execd.port, execd.token, *args)
    return subprocess.run(
        argv,
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
