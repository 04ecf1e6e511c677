"""``harnessd mcp`` over stdio, with the MCP SDK's own client at the other end.

The server is a real subprocess started as an agent CLI starts one; it
launches a real execd. Every tool runs, errors come back as tool errors,
cancellation kills the command's process group, output streams while the
command runs, and the end of the session (stdin closed, SIGTERM, the client
SIGKILLed) leaves no marked process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

import jsonschema
import mcp_types as types
from mcp.shared.exceptions import MCPError

from bench.agents import processes_mentioning
from harnessd.tools import TOOLS
from tests.conftest import eventually, eventually_blocking, one_loop
from tests.support.mcp_peer import ServerLog, server_args, server_env, stdio_server, text_of
from tests.support.procs import alive, terminate, wait_until_none_mention

pytestmark = [pytest.mark.anyio, one_loop, pytest.mark.slow]

EXTRA_TOOLS = {"stat_path", "service_status"}
INFO = {"name": "test", "version": "0"}


def _pids(path: Path) -> list[int]:
    return [int(word) for word in path.read_text().split()] if path.exists() else []


async def test_tools_are_listed_with_the_agent_schemas_and_valid_json_schema(
    tmp_path: Path,
) -> None:
    async with stdio_server(tmp_path) as (client, _):
        listed = (await client.list_tools()).tools
    names = [tool.name for tool in listed]
    assert names == [*TOOLS, *sorted(EXTRA_TOOLS, key=names.index)]
    for tool in listed:
        jsonschema.Draft202012Validator.check_schema(tool.input_schema)
        assert tool.input_schema["type"] == "object", tool.name
        assert tool.description and len(tool.description) > 20, tool.name
        if tool.name in TOOLS:
            # The agent loop's Struct gives the schema and description, unchanged.
            assert tool.input_schema == TOOLS[tool.name].spec.parameters
            assert tool.description == TOOLS[tool.name].spec.description
    read_only = {
        tool.name for tool in listed if tool.annotations and tool.annotations.read_only_hint
    }
    assert {"read_file", "list_files", "stat_path"} <= read_only
    assert "shell" not in read_only and "write_file" not in read_only


async def test_every_tool_runs_in_the_workspace(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    async with stdio_server(tmp_path) as (client, _):

        async def ok(tool: str, **arguments: Any) -> str:
            result = await client.call_tool(tool, arguments)
            assert not result.is_error, (tool, text_of(result))
            return text_of(result)

        assert "exit code 0" in await ok("shell", command="echo out; echo err >&2")
        assert "wrote 6 bytes" in await ok("write_file", path="dir/notes.txt", content="hello\n")
        assert (workspace / "dir" / "notes.txt").read_text() == "hello\n"
        assert await ok("read_file", path="dir/notes.txt") == "hello\n"
        assert "dir/notes.txt" in await ok("list_files", path=".", recursive=True)
        assert "file, 6 bytes" in await ok("stat_path", path="dir/notes.txt")
        assert "exists after" in await ok("wait_for_path", path="dir/notes.txt", timeout=5)

        await ok("session_run", session="dev", command="cd dir && export GREETING=hi")
        ran = await ok("session_run", session="dev", command='echo "$GREETING from $(pwd)"')
        assert f"hi from {workspace / 'dir'}" in ran

        command = f"{sys.executable} -m http.server 0 --bind 127.0.0.1"
        started = await ok(
            "start_service",
            name="web",
            command=command,
            probe={"type": "log", "pattern": "Serving HTTP", "timeout": 20},
        )
        assert "running" in started and "ready" in started
        assert "running" in await ok("service_status", name="web")
        assert "Serving HTTP" in await ok("service_logs", name="web")
        assert "service web" in await ok("stop_service", name="web")

        opened = await ok("terminal_start", command="cat", wait=0.5)
        name = opened.split()[1]
        echoed = await ok("terminal_send", terminal=name, text="ping", keys=["enter"], wait=2)
        assert "ping" in echoed
        await ok("terminal_read", terminal=name, wait=0.1)
        assert "stopped" in await ok("terminal_stop", terminal=name)


async def test_hostile_arguments_are_tool_errors_and_the_server_keeps_serving(
    tmp_path: Path,
) -> None:
    async with stdio_server(tmp_path, "--confine") as (client, _):
        hostile: list[tuple[str, dict[str, Any], str]] = [
            ("shell", {"command": "x" * (2 * 1024 * 1024)}, "invalid arguments"),
            ("shell", {"command": 42}, "Expected `str`"),
            ("shell", {"command": "true", "surprise": 1}, "unknown field"),
            ("shell", {}, "missing required field"),
            ("shell", {"command": "true", "timeout": -5}, ">= 0"),
            ("read_file", {"path": "/etc/passwd"}, "outside the workspace"),
            ("read_file", {"path": "../../../../etc/passwd"}, "outside the workspace"),
            ("write_file", {"path": "/tmp/escape.txt", "content": "x"}, "outside the workspace"),
            ("shell", {"command": "pwd", "cwd": "/"}, "outside the workspace"),
            ("list_files", {"path": ".."}, "outside the workspace"),
            ("stat_path", {"path": "/etc"}, "outside the workspace"),
            ("stat_path", {"path": "missing"}, "NotFound"),
            ("terminal_send", {"terminal": "nope", "text": "x"}, "no open terminal"),
            ("service_status", {"name": "never-started"}, "error:"),
            ("read_file", {"path": "\x00"}, "error:"),
        ]
        for name, arguments, expected in hostile:
            result = await client.call_tool(name, arguments)
            assert result.is_error, (name, arguments)
            assert expected in text_of(result), (name, text_of(result))
        with pytest.raises(MCPError, match="unknown tool"):
            await client.call_tool("format_disk", {})
        still = await client.call_tool("shell", {"command": "echo still here"})
        assert not still.is_error and "still here" in text_of(still)
    assert not (Path("/tmp") / "escape.txt").exists()


async def test_calls_in_flight_are_bounded_and_the_excess_refused(tmp_path: Path) -> None:
    from harnessd.mcp.server import MAX_CALLS_IN_FLIGHT

    results: list[Any] = []

    async def wait() -> None:
        results.append(await client.call_tool("wait_for_path", {"path": "flag", "timeout": 60}))

    async with stdio_server(tmp_path) as (client, _), anyio.create_task_group() as group:
        for _ in range(MAX_CALLS_IN_FLIGHT):
            group.start_soon(wait)
        ledger = next(
            r.uri for r in (await client.list_resources()).resources if r.name.startswith("mcp-")
        )

        async def all_running() -> bool:
            # Every call is in the server's ledger once it runs (reading it is not a call).
            text = str(getattr((await client.read_resource(ledger)).contents[0], "text", ""))
            return text.count('"kind":"tool_call"') == MAX_CALLS_IN_FLIGHT

        await eventually(all_running, what="every call running")
        extra = await client.call_tool("stat_path", {"path": "."})
        assert extra.is_error and "tool calls are running" in text_of(extra)
        (tmp_path / "ws" / "flag").touch()
    assert len(results) == MAX_CALLS_IN_FLIGHT
    assert not any(result.is_error for result in results)


async def test_limits_from_the_flags_hold_whatever_the_call_asks(tmp_path: Path) -> None:
    async with stdio_server(
        tmp_path, "--max-timeout", "1", "--output-cap", "500", "--limit-processes", "4"
    ) as (client, _):
        slow = await client.call_tool("shell", {"command": "sleep 30", "timeout": 600})
        assert "timed out after 1" in text_of(slow)
        loud = await client.call_tool("shell", {"command": "head -c 100000 /dev/zero | tr '\\0' x"})
        assert len(text_of(loud)) <= 500 and "characters cut" in text_of(loud)
        fork = "for i in 1 2 3 4 5 6 7 8; do sleep 1 & done; wait; echo done"
        forks = await client.call_tool("shell", {"command": fork})
        assert "stopped by its processes limit" in text_of(forks)
        # Services are held to the same limits.
        await client.call_tool("start_service", {"name": "forks", "command": fork})

        async def refused() -> bool:
            logs = await client.call_tool("service_logs", {"name": "forks"})
            return "Cannot fork" in text_of(logs)

        await eventually(refused, what="the service's fork refused")


async def test_cancelling_a_call_kills_the_command_group(tmp_path: Path) -> None:
    pids = tmp_path / "ws" / "pids"
    async with stdio_server(tmp_path) as (client, _):
        command = "echo $$ > pids; sleep 300 & echo $! >> pids; sleep 300 & echo $! >> pids; wait"
        async with anyio.create_task_group() as group:
            group.start_soon(client.call_tool, "shell", {"command": command})
            running = await eventually(
                lambda: _pids(pids) if len(_pids(pids)) == 3 else [], what="pids"
            )
            assert all(alive(pid) for pid in running)
            group.cancel_scope.cancel()  # the SDK sends notifications/cancelled
        await eventually(lambda: not any(map(alive, running)), what="the group gone")
        after = await client.call_tool("shell", {"command": "echo next"})
        assert "next" in text_of(after)


async def test_output_streams_as_notifications_while_the_command_runs(tmp_path: Path) -> None:
    go = tmp_path / "ws" / "go"
    seen: list[str] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(message or "")
        if "first" in "".join(seen):
            go.touch()  # the command waits for this: only a live notification lets it finish

    # It prints "first", then waits for the file the test makes on reading "first".
    command = "echo first; while [ ! -e go ]; do sleep 0.02; done; echo second"
    async with stdio_server(tmp_path) as (client, _):
        result = await client.call_tool(
            "shell", {"command": command, "timeout": 30}, progress_callback=progress
        )
    assert not result.is_error, text_of(result)
    assert "first" in text_of(result) and "second" in text_of(result)
    assert "".join(seen) == "first\nsecond\n"


@pytest.mark.filterwarnings("ignore:The logging capability is deprecated")
async def test_log_messages_carry_output_once_the_client_sets_a_level(tmp_path: Path) -> None:
    messages: list[types.LoggingMessageNotificationParams] = []

    async def logged(params: types.LoggingMessageNotificationParams) -> None:
        messages.append(params)

    async with stdio_server(tmp_path, logging_callback=logged) as (client, _):
        await client.call_tool("shell", {"command": "echo quiet"})
        assert messages == []
        await client.set_logging_level("info")
        await client.call_tool("shell", {"command": "echo loud; echo oops >&2"})
    text = {params.logger: params.data for params in messages}
    assert text == {"shell.stdout": "loud\n", "shell.stderr": "oops\n"}


async def test_the_modern_protocol_works_too(tmp_path: Path) -> None:
    seen: list[str] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(message or "")

    async with stdio_server(tmp_path, mode="auto") as (client, _):
        assert client.protocol_version == "2026-07-28"
        result = await client.call_tool(
            "shell", {"command": "echo modern"}, progress_callback=progress
        )
        failed = await client.call_tool("read_file", {"path": "missing"})
    assert "modern" in text_of(result) and seen == ["modern\n"]
    assert failed.is_error and "NotFound" in text_of(failed)


async def test_execd_launched_through_a_command_prefix(tmp_path: Path) -> None:
    # ``env`` stands for ssh or docker exec: every workspace command goes through it.
    async with stdio_server(tmp_path, "--via", "env", "--lease", "60") as (client, log):
        result = await client.call_tool("shell", {"command": "pwd"})
        assert text_of(result).endswith(f"{tmp_path / 'ws'}\n"), text_of(result)
        marker = log.marker
    assert wait_until_none_mention(marker, timeout=20) == []
    assert "execd stopped" in log.text()


async def test_closing_stdin_kills_marked_processes_and_stops_execd(tmp_path: Path) -> None:
    async with stdio_server(tmp_path) as (client, log):
        marker = log.marker
        await client.call_tool("start_service", {"name": "sleeper", "command": "sleep 300"})
        await client.call_tool("session_run", {"session": "s", "command": "sleep 300 &"})
        assert len(processes_mentioning(marker)) >= 3  # execd, its supervisor, the sleeps
    left = wait_until_none_mention(marker, timeout=20)
    assert left == [], left
    assert "cleanup: " in log.text() and "execd stopped" in log.text()


async def test_sigterm_ends_the_session_and_cleans_up(tmp_path: Path) -> None:
    async with stdio_server(tmp_path) as (client, log):
        marker = log.marker
        await client.call_tool("shell", {"command": "sleep 300 > /dev/null 2>&1 &"})
        assert processes_mentioning(marker)
        os.kill(log.pid, signal.SIGTERM)
        await eventually(lambda: not alive(log.pid), timeout=30, what="the server exits")
    assert wait_until_none_mention(marker, timeout=20) == []
    assert "SIGTERM received" in log.text()


CLIENT = """
import anyio, sys
from mcp import StdioServerParameters, stdio_client
from mcp.client import Client

async def main():
    params = StdioServerParameters(command=sys.executable, args=sys.argv[2:], env={env!r})
    with open(sys.argv[1], "a") as errlog:
        async with Client(stdio_client(params, errlog=errlog), mode="legacy") as client:
            await client.call_tool("shell", {{"command": "sleep 300 > /dev/null 2>&1 &"}})
            print("started", flush=True)
            await anyio.sleep_forever()

anyio.run(main)
"""


@pytest.mark.parametrize("kill_server_too", [False, True], ids=["client", "client-and-server"])
def test_a_sigkilled_client_leaves_no_marked_process_past_the_lease(
    tmp_path: Path, kill_server_too: bool
) -> None:
    log_path = tmp_path / "server.log"
    args = server_args(tmp_path, "--lease", "3")
    code = CLIENT.format(env=server_env(tmp_path))
    client = subprocess.Popen(
        [sys.executable, "-c", code, str(log_path), *args],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "started", log_path.read_text()
        log = ServerLog(log_path)
        marker = log.marker
        assert processes_mentioning(marker)
        if kill_server_too:
            os.kill(log.pid, signal.SIGKILL)  # no cleanup from the server: the lease's turn
        client.kill()
        client.wait(timeout=10)
        # Stdin's end tells the server at once; without the server, execd's lease does.
        left = wait_until_none_mention(marker, timeout=3 + 15)
        assert left == [], (left, log.text())
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        if client.stdout is not None:
            client.stdout.close()


def _rpc(proc: subprocess.Popen[str], message: dict[str, Any]) -> dict[str, Any] | None:
    """Send one JSON-RPC message; for a request, read lines until its answer."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(message) + "\n")
    proc.stdin.flush()
    while "id" in message:
        answer: dict[str, Any] = json.loads(proc.stdout.readline())
        if answer.get("id") == message["id"]:
            return answer
    return None


def test_sigterm_right_after_stdin_closes_still_cleans_up(tmp_path: Path) -> None:
    """What agent CLIs do at exit: close stdin, then SIGTERM soon after (then SIGKILL)."""
    log = ServerLog(tmp_path / "server.log")
    with log.path.open("a") as errlog:
        proc = subprocess.Popen(
            [sys.executable, *server_args(tmp_path, "--lease", "300")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errlog,
            text=True,
            env=server_env(tmp_path),
        )
    try:
        hello = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": INFO}
        assert "result" in (
            _rpc(proc, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello}) or {}
        )
        _rpc(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = {"name": "start_service", "arguments": {"name": "idle", "command": "sleep 300"}}
        answer = _rpc(proc, {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
        assert answer is not None and not answer["result"]["isError"], answer
        marker = log.marker
        assert len(processes_mentioning(marker)) >= 3
        assert proc.stdin is not None
        proc.stdin.close()
        # The signal lands while the server is cleaning up.
        eventually_blocking(lambda: "cleaning up" in log.text(), what="the cleanup begun")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, 128 + signal.SIGTERM)
        # Long before the lease: the server's own cleanup did it.
        assert wait_until_none_mention(marker, timeout=10) == [], log.text()
        assert "execd stopped" in log.text()
    finally:
        terminate(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def test_garbage_and_oversized_lines_on_stdin_do_not_end_the_session(tmp_path: Path) -> None:
    log = ServerLog(tmp_path / "server.log")
    with log.path.open("a") as errlog:
        proc = subprocess.Popen(
            [sys.executable, *server_args(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errlog,
            text=True,
            env=server_env(tmp_path),
        )
    try:
        assert proc.stdin is not None
        proc.stdin.write('this is not json\n{"jsonrpc": "2.0", "id": \n')
        # Past the 64 MiB bound: skipped up to its newline, never held whole.
        chunk = "x" * (1 << 20)
        for _ in range(65):
            proc.stdin.write(chunk)
        proc.stdin.write("\n")
        hello = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": INFO}
        answer = _rpc(proc, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello})
        assert answer is not None and "result" in answer, answer
        _rpc(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = {"name": "shell", "arguments": {"command": "echo alive"}}
        answer = _rpc(proc, {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
        assert answer is not None and "alive" in answer["result"]["content"][0]["text"]
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert "execd stopped" in log.text()
