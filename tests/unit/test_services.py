"""The services capability driven through LocalContext, with real processes and files."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from execd import errors
from execd.services import SERVICE_MARKER_VAR, ServicesCapability
from protocol.rpc import services as rpc
from tests.conftest import eventually
from tests.support.capabilities import MARKER_VAR, capability_fixture
from tests.support.local_ctx import LocalContext
from tests.support.procs import alive

pytestmark = pytest.mark.anyio


cap = capability_fixture(ServicesCapability, kill_grace=1.0, drain_grace=0.2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def start(name: str, command: str, **kw: Any) -> rpc.StartParams:
    return rpc.StartParams(name=name, command=command, **kw)


async def status(cap: ServicesCapability, name: str) -> rpc.ServiceInfo:
    return await cap.services_status(rpc.StatusParams(name=name), LocalContext())


async def logs(cap: ServicesCapability, name: str, **kw: Any) -> rpc.LogsResult:
    return await cap.services_logs(rpc.LogsParams(name=name, **kw), LocalContext())


# -- start and readiness ---------------------------------------------------------------


async def test_web_server_ready_on_its_port_and_reachable(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    (tmp_path / "index.txt").write_text("served by the service\n")
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    params = rpc.StartParams(
        name="web", argv=argv, cwd=str(tmp_path), probe=rpc.TcpProbe(port=port, timeout=20)
    )
    info = await cap.services_start(params, LocalContext())
    assert info.state == "running" and info.ready and info.pid is not None
    assert info.log_path == str(tmp_path / "state" / "services" / "web.log")
    url = f"http://127.0.0.1:{port}/index.txt"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    assert body == b"served by the service\n"
    await eventually(lambda: b"GET /index.txt" in Path(info.log_path).read_bytes())
    listing = await cap.services_list(rpc.ListParams(), LocalContext())
    assert [s.name for s in listing.services] == ["web"]
    final = await cap.services_stop(rpc.StopParams(name="web"), LocalContext())
    assert final.state == "stopped" and final.signal == 15 and not alive(info.pid)


async def test_service_that_crashes_at_start_fails_with_log_tail_and_status(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    command = "echo starting up; echo 'fatal: no config' >&2; exit 3"
    params = start("crash", command, probe=rpc.TcpProbe(port=free_port(), timeout=20))
    began = time.monotonic()
    with pytest.raises(errors.ServiceFailed) as caught:
        await cap.services_start(params, LocalContext())
    assert time.monotonic() - began < 10, "the exit must not wait for the probe timeout"
    data = caught.value.data
    assert data["exit_code"] == 3 and data["signal"] is None
    assert "starting up" in data["log_tail"] and "fatal: no config" in data["log_tail"]
    info = await status(cap, "crash")
    assert info.state == "exited" and info.exit_code == 3 and not info.ready
    # A finished service can be started again under the same name.
    again = await cap.services_start(start("crash", "sleep 30"), LocalContext())
    assert again.state == "running"


async def test_killed_by_signal_before_ready_reports_the_signal(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    params = start("sig", "kill -9 $$", probe=rpc.LogProbe(pattern="never", timeout=20))
    with pytest.raises(errors.ServiceFailed) as caught:
        await cap.services_start(params, LocalContext())
    assert caught.value.data["signal"] == 9 and caught.value.data["exit_code"] is None


async def test_log_probe_sees_lines_written_before_it_and_ignores_older_runs(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    command = "echo booting; echo 'listening on 8080'; exec sleep 30"
    probe = rpc.LogProbe(pattern=r"listening on \d+$", timeout=20)
    info = await cap.services_start(start("logged", command, probe=probe), LocalContext())
    assert info.ready
    await cap.services_stop(rpc.StopParams(name="logged"), LocalContext())
    # The log still holds "listening on 8080" from the first run: it must not count.
    quiet = start("logged", "echo still booting; exec sleep 30", probe=probe)
    quiet.probe = rpc.LogProbe(pattern=r"listening on \d+$", timeout=0.7)
    with pytest.raises(errors.NotReady):
        await cap.services_start(quiet, LocalContext())
    # An unterminated last line matches too.
    partial = start("partial", "printf 'ready> '; exec sleep 30")
    partial.probe = rpc.LogProbe(pattern="ready>", timeout=20)
    assert (await cap.services_start(partial, LocalContext())).ready


async def test_command_probe_retries_until_it_succeeds(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    flag = tmp_path / "flag"
    command = f"sleep 0.4; touch {flag}; exec sleep 30"
    probe = rpc.CommandProbe(argv=["test", "-e", str(flag)], interval=0.05, timeout=20)
    began = time.monotonic()
    info = await cap.services_start(start("cmd", command, probe=probe), LocalContext())
    assert info.ready and flag.exists()
    assert time.monotonic() - began >= 0.35


async def test_probe_timeout_reports_not_ready_and_stops_the_service(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    command = f"echo $$ > {pidfile}; echo waiting for nothing; exec sleep 300"
    probe = rpc.CommandProbe(command="exit 1", interval=0.05, timeout=0.6)
    with pytest.raises(errors.NotReady) as caught:
        await cap.services_start(start("never", command, probe=probe), LocalContext())
    assert "waiting for nothing" in caught.value.data["log_tail"]
    info = await status(cap, "never")
    assert info.state == "stopped" and not info.ready
    assert not alive(int(pidfile.read_text()))


async def test_no_probe_means_ready_once_spawned(cap: ServicesCapability, tmp_path: Path) -> None:
    params = start("plain", 'echo "$GREETING from $(pwd)"; exec sleep 30')
    params.cwd = str(tmp_path)
    params.env = {"GREETING": "hello"}
    info = await cap.services_start(params, LocalContext())
    assert info.state == "running" and info.ready
    await eventually(lambda: Path(info.log_path).read_bytes() != b"")
    assert Path(info.log_path).read_text() == f"hello from {tmp_path}\n"
    environ = Path(f"/proc/{info.pid}/environ").read_bytes().split(b"\0")
    assert any(item.startswith(SERVICE_MARKER_VAR.encode() + b"=") for item in environ)
    assert any(item.startswith(MARKER_VAR.encode() + b"=") for item in environ)


# -- logs ---------------------------------------------------------------------------------


async def test_logs_tail_by_lines_bytes_and_offset(cap: ServicesCapability, tmp_path: Path) -> None:
    command = "i=1; while [ $i -le 50 ]; do echo line $i; i=$((i+1)); done"
    info = await cap.services_start(start("lines", command), LocalContext())
    await eventually(lambda: status_sync(cap, "lines") == "exited")
    everything = b"".join(b"line %d\n" % i for i in range(1, 51))
    assert Path(info.log_path).read_bytes() == everything
    tail = await logs(cap, "lines", lines=3)
    assert tail.data == b"line 48\nline 49\nline 50\n"
    assert tail.end == tail.size == len(everything)
    assert tail.start == len(everything) - len(tail.data)
    assert (await logs(cap, "lines", nbytes=9)).data == b"\nline 50\n"
    # The byte bound wins over the line count, even mid-line.
    assert (await logs(cap, "lines", lines=3, nbytes=10)).data == b"9\nline 50\n"
    assert (await logs(cap, "lines", offset=tail.start, nbytes=8)).data == b"line 48\n"
    default = await logs(cap, "lines")
    assert default.data == everything  # fewer lines than the default count
    with pytest.raises(errors.InvalidParams):
        await logs(cap, "lines", lines=1, offset=0)
    with pytest.raises(errors.NoSuchService):
        await logs(cap, "nothing")


def status_sync(cap: ServicesCapability, name: str) -> str:
    """The state straight from the table (for polling without awaiting)."""
    return cap._services[name].state


async def test_follow_streams_live_lines_until_the_service_ends(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    command = (
        f"echo first; while [ ! -e {go} ]; do sleep 0.02; done;"
        " for i in 1 2 3 4 5; do echo tick $i; sleep 0.05; done"
    )
    await cap.services_start(start("ticker", command), LocalContext())
    ctx = LocalContext()
    follow = asyncio.ensure_future(
        cap.services_logs(rpc.LogsParams(name="ticker", offset=0, follow=True), ctx)
    )
    await eventually(lambda: ctx.received(rpc.LOG_STREAM) == b"first\n")
    assert not follow.done()
    go.touch()
    result = await asyncio.wait_for(follow, 20)
    expected = b"first\n" + b"".join(b"tick %d\n" % i for i in range(1, 6))
    assert ctx.received(rpc.LOG_STREAM) == expected
    assert rpc.LOG_STREAM in ctx.ended
    assert (result.start, result.end, result.size) == (0, len(expected), len(expected))


async def test_follow_from_the_end_until_cancelled(cap: ServicesCapability, tmp_path: Path) -> None:
    info = await cap.services_start(
        start("chatty", "echo old; while :; do echo new; sleep 0.05; done"), LocalContext()
    )
    await eventually(lambda: Path(info.log_path).stat().st_size > 0)
    ctx = LocalContext()
    follow = asyncio.ensure_future(
        cap.services_logs(rpc.LogsParams(name="chatty", follow=True), ctx)
    )
    await eventually(lambda: ctx.received(rpc.LOG_STREAM).count(b"new\n") >= 3)
    assert b"old" not in ctx.received(rpc.LOG_STREAM)
    follow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await follow
    assert rpc.LOG_STREAM not in ctx.ended


# -- restarts, stop, close -------------------------------------------------------------------


async def test_restart_on_failure_counts_and_backs_off(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    policy = rpc.RestartPolicy(
        policy="on-failure", max_restarts=3, backoff_initial=0.1, backoff_max=0.2
    )
    began = time.monotonic()
    await cap.services_start(start("flaky", "echo run; exit 4", restart=policy), LocalContext())
    await eventually(lambda: status_sync(cap, "flaky") == "exited")
    elapsed = time.monotonic() - began
    info = await status(cap, "flaky")
    assert info.restarts == 3 and info.exit_code == 4
    assert elapsed >= 0.1 + 0.2 + 0.2 - 0.05  # three backoffs, the later ones capped
    assert Path(info.log_path).read_text() == "run\n" * 4


async def test_clean_exit_and_stopped_service_are_not_restarted(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    policy = rpc.RestartPolicy(policy="on-failure", max_restarts=5, backoff_initial=0.05)
    await cap.services_start(start("clean", "exit 0", restart=policy), LocalContext())
    await eventually(lambda: status_sync(cap, "clean") == "exited")
    await cap.services_start(start("held", "exec sleep 300", restart=policy), LocalContext())
    stopped = await cap.services_stop(rpc.StopParams(name="held"), LocalContext())
    assert stopped.state == "stopped"
    for name in ("clean", "held"):
        supervisor = cap._services[name].supervisor
        assert supervisor is not None
        await asyncio.wait_for(supervisor, 10)  # done: it restarts nothing any more
    for name in ("clean", "held"):
        assert (await status(cap, name)).restarts == 0
    assert (await status(cap, "held")).state == "stopped"


async def test_stop_kills_the_whole_group_and_escaped_descendants(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    command = (
        f"sleep 300 & echo $! > {tmp_path}/grandchild;"
        f" setsid sleep 300 & echo $! > {tmp_path}/escaped;"
        " trap '' TERM; while :; do sleep 0.05; done"
    )
    info = await cap.services_start(start("tree", command), LocalContext())
    await eventually(lambda: (tmp_path / "escaped").exists() and (tmp_path / "grandchild").exists())
    await eventually(lambda: (tmp_path / "escaped").read_text().strip() != "")
    grandchild = int((tmp_path / "grandchild").read_text())
    escaped = int((tmp_path / "escaped").read_text())
    assert alive(grandchild) and alive(escaped)
    began = time.monotonic()
    final = await cap.services_stop(rpc.StopParams(name="tree", grace=0.3), LocalContext())
    assert time.monotonic() - began < 8
    assert final.state == "stopped"
    assert info.pid is not None and not alive(info.pid)
    await eventually(lambda: not alive(grandchild) and not alive(escaped))


async def test_restart_method_starts_a_fresh_instance(
    cap: ServicesCapability, tmp_path: Path
) -> None:
    probe = rpc.LogProbe(pattern="up", timeout=20)
    first = await cap.services_start(
        start("svc", "echo up; exec sleep 30", probe=probe), LocalContext()
    )
    again = await cap.services_restart(rpc.RestartParams(name="svc"), LocalContext())
    assert again.state == "running" and again.ready and again.pid != first.pid
    assert first.pid is not None and not alive(first.pid)
    assert Path(again.log_path).read_text() == "up\nup\n"


async def test_close_kills_every_service(cap: ServicesCapability) -> None:
    pids: list[int] = []
    for name in ("a", "b"):
        info = await cap.services_start(
            start(name, "trap '' TERM; sleep 300 & wait"), LocalContext()
        )
        assert info.pid is not None
        pids.append(info.pid)
    policy = rpc.RestartPolicy(policy="on-failure", backoff_initial=60)
    await cap.services_start(start("waiting", "exit 1", restart=policy), LocalContext())
    await eventually(lambda: status_sync(cap, "waiting") == "backoff")
    await cap.close()
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(errors.ShuttingDown):
        await cap.services_start(start("late", "true"), LocalContext())


@pytest.mark.limits(max_services=2)
async def test_errors_exists_limit_and_invalid(cap: ServicesCapability, tmp_path: Path) -> None:
    await cap.services_start(start("one", "exec sleep 30"), LocalContext())
    with pytest.raises(errors.ServiceExists):
        await cap.services_start(start("one", "exec sleep 30"), LocalContext())
    await cap.services_start(start("two", "exec sleep 30"), LocalContext())
    with pytest.raises(errors.LimitExceeded):
        await cap.services_start(start("three", "exec sleep 30"), LocalContext())
    await cap.services_stop(rpc.StopParams(name="two"), LocalContext())
    # A finished service makes room for a new one.
    await cap.services_start(start("three", "exec sleep 30"), LocalContext())
    with pytest.raises(errors.NoSuchService):
        await status(cap, "two")
    with pytest.raises(errors.InvalidParams):
        await cap.services_start(rpc.StartParams(name="x"), LocalContext())
    with pytest.raises(errors.InvalidParams):
        bad = start("x", "true", env={MARKER_VAR: "other"})
        await cap.services_start(bad, LocalContext())
    with pytest.raises(errors.InvalidParams):
        await cap.services_start(
            start("x", "true", probe=rpc.LogProbe(pattern="(")), LocalContext()
        )
    with pytest.raises(errors.NoSuchService):
        await cap.services_stop(rpc.StopParams(name="ghost"), LocalContext())
