"""Services and persistent shell sessions over real sockets against a real execd."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from execd.marker import find_marked
from harnessd import ExecdClient, errors
from protocol.errors import ErrorCode
from protocol.rpc.services import CommandProbe, RestartPolicy, TcpProbe
from tests.conftest import eventually, one_loop
from tests.support.daemon import RunningExecd
from tests.support.procs import alive, children

pytestmark = [pytest.mark.anyio, one_loop]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_services_over_the_wire(
    execd: RunningExecd, client: ExecdClient, tmp_path: Path
) -> None:
    info = await client.server_info()
    for method in ("services.start", "services.logs", "sessions.open", "sessions.run"):
        assert method in info.methods

    (tmp_path / "hello.txt").write_text("hello over http\n")
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    web = await client.start_service(
        "web", argv, cwd=str(tmp_path), probe=TcpProbe(port=port, timeout=20)
    )
    assert web.state == "running" and web.ready
    assert web.log_path == str(execd.state_dir / "services" / "web.log")
    url = f"http://127.0.0.1:{port}/hello.txt"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    assert body == b"hello over http\n"

    with pytest.raises(errors.ServiceError) as caught:
        await client.start_service(
            "broken",
            command="echo cannot bind >&2; exit 2",
            probe=CommandProbe(command="exit 1", timeout=20),
        )
    assert caught.value.code == ErrorCode.SERVICE_FAILED
    assert caught.value.data["exit_code"] == 2
    assert "cannot bind" in caught.value.data["log_tail"]

    go = tmp_path / "go"
    ticker = f"echo first; while [ ! -e {go} ]; do sleep 0.02; done; for i in 1 2 3; do echo tick $i; sleep 0.05; done; exit 1"
    policy = RestartPolicy(policy="on-failure", max_restarts=1, backoff_initial=0.05)
    await client.start_service("ticker", command=ticker, restart=policy)
    received = b""
    async with contextlib.aclosing(client.follow_service_logs("ticker", offset=0)) as chunks:
        async for chunk in chunks:
            received += chunk
            if received == b"first\n":
                go.touch()
    one_run = b"first\n" + b"tick 1\ntick 2\ntick 3\n"
    assert received == one_run * 2  # the run and its one restart, then the end
    status = await client.service_status("ticker")
    assert status.state == "exited" and status.restarts == 1 and status.exit_code == 1
    tail = await client.service_logs("ticker", lines=2)
    assert tail.data == b"tick 2\ntick 3\n"

    names = [s.name for s in (await client.list_services()).services]
    assert names == ["web", "broken", "ticker"]
    stopped = await client.stop_service("web", grace=5)
    assert stopped.state == "stopped"
    with pytest.raises(errors.NoSuchService):
        await client.service_status("nothing")


async def test_sessions_over_the_wire(client: ExecdClient, tmp_path: Path) -> None:
    opened = await client.open_session("dev", cwd=str(tmp_path), env={"MODE": "test"})
    assert opened.state == "idle" and opened.cwd == str(tmp_path)
    await client.session_run("dev", "mkdir -p build && cd build && export OUT=$PWD")
    result = await client.session_run(
        "dev", 'printf \'%s 0\\n\' "$__execd_id"; echo "$OUT $MODE"; exit_now=1; false'
    )
    assert result.exit_code == 1
    assert result.stdout.endswith(f"{tmp_path}/build test\n".encode())
    assert result.cwd == str(tmp_path / "build")
    fed = await client.session_run("dev", "tr a-z A-Z", stdin=b"shout\n")
    assert fed.stdout == b"SHOUT\n"

    running = asyncio.ensure_future(client.session_run("dev", "sleep 100"))
    await eventually(lambda: children(opened.pid, "sleep"), what="the command running")
    with pytest.raises(errors.SessionBusy):
        await client.session_run("dev", "true")
    assert (await client.interrupt_session("dev")).sent
    interrupted = await asyncio.wait_for(running, 10)
    assert interrupted.exit_code == 130 and interrupted.interrupted
    assert (await client.session_run("dev", "pwd")).stdout == f"{tmp_path}/build\n".encode()

    timed = await client.session_run("dev", "sleep 100", timeout=0.3)
    assert timed.timed_out and timed.exit_code == 130

    background = await client.session_run("dev", "sleep 300 & echo $!")
    job = int(background.stdout)
    ended = await client.session_run("dev", "exit 3")
    assert ended.session_ended and ended.exit_code == 3
    with pytest.raises(errors.RemoteError) as dead:
        await client.session_run("dev", "true")
    assert dead.value.code == ErrorCode.SESSION_DEAD
    listed = await client.list_sessions()
    assert [(s.name, s.state) for s in listed.sessions] == [("dev", "dead")]
    closed = await client.close_session_shell("dev")
    assert closed.remaining == []
    assert not alive(job)
    with pytest.raises(errors.NoSuchSession):
        await client.close_session_shell("dev")


async def test_session_close_kills_services_and_shells(
    execd: RunningExecd, client: ExecdClient
) -> None:
    await client.start_service("svc", command="sleep 300 & setsid sleep 300 & wait")
    await client.open_session("sh")
    await client.session_run("sh", "sleep 300 & setsid sleep 300 &")
    await eventually(lambda: len(find_marked("EXECD_MARKER", execd.marker)) >= 6)
    report = await client.cleanup()
    assert report.remaining == []
    assert find_marked("EXECD_MARKER", execd.marker) == []
    assert (await client.list_services()).services == []
    assert (await client.list_sessions()).sessions == []
