"""``harnessd mcp --transport http``: streamable HTTP behind a bearer token, on loopback.

The SDK's client talks to the real server process over real HTTP; the token
travels in the environment and the Authorization header only. Also here:
serving an execd that was already running (``--port``), which the end of the
session cleans up without stopping.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

pytest.importorskip("mcp")

import httpx2

from bench.agents import processes_mentioning
from harnessd.api import connect
from tests.conftest import eventually, one_loop
from tests.support.daemon import RunningExecd
from tests.support.mcp_peer import http_server, server_args, server_env, stdio_server, text_of
from tests.support.procs import alive, wait_until_none_mention

pytestmark = [pytest.mark.anyio, one_loop, pytest.mark.slow]

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "probe", "version": "0"},
    },
}


async def test_http_needs_the_bearer_token_and_serves_with_it(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    with http_server(tmp_path, token=token) as server:
        assert server.url.startswith("http://127.0.0.1:")
        headers = {"Accept": "application/json, text/event-stream"}
        async with httpx2.AsyncClient(timeout=30) as http:
            for sent in [None, "Bearer wrong", f"Basic {token}", f"Bearer {token}x"]:
                extra = {"Authorization": sent} if sent else {}
                answer = await http.post(server.url, json=INITIALIZE, headers=headers | extra)
                assert answer.status_code == 401, sent
                assert answer.headers["www-authenticate"].startswith("Bearer")
        async with server.client() as client:
            assert len((await client.list_tools()).tools) == 15
            result = await client.call_tool("shell", {"command": "echo over http"})
            assert "over http" in text_of(result)
            # The workspace never sees the bearer token (nor its variable).
            env = await client.call_tool("shell", {"command": "env; cat /proc/$PPID/environ"})
            assert token not in text_of(env) and "HARNESSD_MCP_TOKEN" not in text_of(env)
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert token.encode() not in cmdline
    assert token not in server.log.text()


async def test_http_streams_output_and_cancels_the_group(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    go, pids = workspace / "go", workspace / "pids"
    seen: list[str] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(message or "")
        if "first" in "".join(seen):
            go.touch()

    with http_server(tmp_path, token="t" * 32) as server:
        async with server.client() as client:
            command = "echo first; while [ ! -e go ]; do sleep 0.02; done; echo second"
            result = await client.call_tool(
                "shell", {"command": command, "timeout": 30}, progress_callback=progress
            )
            assert "second" in text_of(result) and "".join(seen) == "first\nsecond\n"

            long = "echo $$ > pids; sleep 300 & echo $! >> pids; wait"
            async with anyio.create_task_group() as group:
                group.start_soon(client.call_tool, "shell", {"command": long})

                def started() -> list[int]:
                    found = [int(w) for w in pids.read_text().split()] if pids.exists() else []
                    return found if len(found) == 2 else []

                running = await eventually(started, what="the command's pids")
                group.cancel_scope.cancel()
            await eventually(lambda: not any(map(alive, running)), what="the group gone")
            assert "again" in text_of(await client.call_tool("shell", {"command": "echo again"}))


async def test_sigterm_stops_the_http_server_and_cleans_up(tmp_path: Path) -> None:
    with http_server(tmp_path, token="t" * 32) as server:
        marker = server.log.marker
        async with server.client() as client:
            await client.call_tool("start_service", {"name": "idle", "command": "sleep 300"})
        assert len(processes_mentioning(marker)) >= 3
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert wait_until_none_mention(marker, timeout=20) == []
    assert "execd stopped" in server.log.text()


def test_http_without_a_token_is_a_usage_error(tmp_path: Path) -> None:
    env = server_env(tmp_path)
    env.pop("HARNESSD_MCP_TOKEN", None)
    done = subprocess.run(
        [sys.executable, *server_args(tmp_path, "--transport", "http", "--http-port", "0")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "needs a bearer token" in done.stderr and "HARNESSD_MCP_TOKEN" in done.stderr
    assert done.stdout == ""


@pytest.mark.execd_args("--lease", "60")
async def test_a_running_execd_is_served_and_only_cleaned_up(
    tmp_path: Path, execd: RunningExecd
) -> None:
    token_file = tmp_path / "execd-token"
    token_file.write_text(execd.token)
    args = ["--port", str(execd.port), "--token-file", str(token_file)]
    async with stdio_server(tmp_path, *args) as (client, log):
        started = await client.call_tool(
            "shell", {"command": "sleep 300 > /dev/null 2>&1 & echo $!"}
        )
        sleeper = int(text_of(started).split()[-1])
        assert alive(sleeper)
    await eventually(lambda: not alive(sleeper), what="the marked sleep killed")
    assert "0 left" in log.text() and "execd stopped" not in log.text()
    async with connect(execd.host, execd.port, execd.token) as still:
        assert (await still.server_info()).marker == execd.marker
    assert json.dumps(execd.token) not in log.text()
