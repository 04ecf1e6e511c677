"""Agent sessions end to end against real execds started by the launcher.

Scripted sessions through every tool, a session driven by an OpenAI-compatible
endpoint (a local HTTP server), interrupted turns killing their commands,
ledger sync across a reconnect and across an execd restart, and 50
concurrent sessions against 50 execds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from execd.marker import find_marked
from harnessd import connect
from harnessd.agent import AgentLimits, AgentResult, AgentSession
from harnessd.api import ExecdClient
from harnessd.launcher import Session, serve
from harnessd.ledger_sync import decode_entry
from harnessd.models import Model
from harnessd.openai_model import OpenAIChatModel
from harnessd.runtime import LocalRuntime
from harnessd.scripted_model import ScriptedModel
from harnessd.toolbox import ToolConfig
from harnessd.tools import TOOL_SPECS
from harnessd.trace import Trace, read_trace
from tests.conftest import eventually, one_loop
from tests.support.chat_endpoint import ChatEndpoint
from tests.support.daemon import RunningExecd, start_execd
from tests.support.hooked_model import Hook
from tests.support.procs import cmdline

pytestmark = [pytest.mark.anyio, one_loop, pytest.mark.timeout(120)]

MARKER_VAR = "EXECD_MARKER"
PY = shlex.quote(sys.executable)


def private(tmp_path: Path, name: str = "w") -> dict[str, Any]:
    """serve() options keeping execd's workdir and state under the test's tmp_path."""
    return {
        "workdir": str(tmp_path / f"execd-{name}"),
        "extra_args": ("--state-dir", str(tmp_path / f"state-{name}")),
    }


def workspace(tmp_path: Path, name: str = "ws") -> str:
    root = tmp_path / name
    root.mkdir(exist_ok=True)
    return str(root)


def agent_in(session: Session, model: Model, root: str, **options: Any) -> AgentSession:
    """An agent on ``session``'s client whose tools work under ``root``."""
    return AgentSession(model, lambda: session.client, tools=ToolConfig(root=root), **options)


def marked_running(marker: str, needle: str) -> list[int]:
    return [pid for pid in find_marked(MARKER_VAR, marker) if needle in cmdline(pid)]


async def wait_until_gone(marker: str, needle: str, timeout: float = 15.0) -> list[int]:
    """Wait until no marked process runs ``needle``; return those still running at the end."""
    with contextlib.suppress(AssertionError):
        await eventually(lambda: not marked_running(marker, needle), timeout, interval=0.05)
    return marked_running(marker, needle)


async def check_ledger(agent: AgentSession, client: ExecdClient) -> None:
    """execd holds exactly the local ledger: nothing lost, nothing duplicated."""
    assert await agent.sync.verify_remote(client) == agent.ledger.seq
    records = await client.ledger_read(agent.session_id, 1)
    assert [r.payload for r in records] == list(agent.ledger.payloads())
    assert (await client.ledger_head(agent.session_id)).seq == agent.ledger.seq


def results_by_name(result: AgentResult) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for turn in result.turns:
        for tool in turn.results:
            found.setdefault(tool.name, []).append(tool.text)
    return found


# -- scripted sessions ----------------------------------------------------------------------


async def test_scripted_session_uses_shell_and_file_tools(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    model = ScriptedModel(
        [
            {
                "content": "write and run",
                "tool_calls": [
                    {
                        "name": "write_file",
                        "arguments": {"path": "src/main.py", "content": "print(6 * 7)\n"},
                    },
                    {"name": "shell", "arguments": {"command": "mkdir -p out && echo made"}},
                ],
            },
            {
                "tool_calls": [
                    {"name": "shell", "arguments": {"command": f"{PY} src/main.py > out/r.txt"}},
                ]
            },
            {
                "tool_calls": [
                    {"name": "read_file", "arguments": {"path": "out/r.txt"}},
                    {"name": "list_files", "arguments": {"path": ".", "recursive": True}},
                    {"name": "shell", "arguments": {"command": "exit 3"}},
                    {"name": "read_file", "arguments": {"path": "missing.txt"}},
                ]
            },
            {
                "tool_calls": [
                    {"name": "shell", "arguments": {"command": "sleep 0.3 && echo ok > flag.txt"}},
                    {
                        "name": "wait_for_path",
                        "arguments": {"path": "flag.txt", "condition": "nonempty"},
                    },
                    {"name": "shell", "arguments": {"command": "seq 1 20000"}},
                    {
                        "name": "write_file",
                        "arguments": {"path": "out/r.txt", "content": "more\n", "append": True},
                    },
                ]
            },
            {"content": "all done"},
        ]
    )
    trace_path = tmp_path / "trace.jsonl"
    async with serve(LocalRuntime(), **private(tmp_path)) as session:
        agent = AgentSession(
            model,
            lambda: session.client,
            reconnect=session.reconnect,
            tools=ToolConfig(root=root, output_cap=2000),
            trace=Trace(trace_path),
        )
        result = await agent.run("compute 6*7")
        agent.trace.close()
        assert result.stop_reason == "finished" and result.final_text == "all done"
        assert len(result.turns) == 5
        texts = results_by_name(result)
        assert texts["write_file"][0].startswith("wrote 13 bytes")
        assert "made" in texts["shell"][0]
        assert texts["read_file"][0].strip() == "42"
        assert "f src/main.py 13" in texts["list_files"][0]
        assert "exit code 3" in texts["shell"][2]
        assert "NotFound" in texts["read_file"][1]
        assert "nonempty after" in texts["wait_for_path"][0]
        # Output past the cap keeps its head and tail with a marker in between.
        long = texts["shell"][4]
        assert len(long) <= 2000 and "characters cut" in long
        assert long.startswith("exit code 0; stdout was 108894 bytes")
        assert "\n1\n2\n" in long and long.rstrip().endswith("20000")
        assert result.tool_errors == 1  # the missing file; a non-zero exit is a result
        assert Path(root, "out", "r.txt").read_text() == "42\nmore\n"
        await check_ledger(agent, session.client)

    records = read_trace(trace_path)
    kinds = [r["event"] for r in records]
    assert kinds[0] == "session_start" and kinds[-1] == "session_end"
    assert kinds.count("model_turn") == 5
    assert kinds.count("tool_call") == 11
    syncs = [r for r in records if r["event"] == "sync"]
    assert len(syncs) == 6  # one per turn and the final one
    assert all(r["batches"] >= 1 and r["ms"] >= 0 for r in syncs)
    calls = [r for r in records if r["event"] == "tool_call"]
    assert all(isinstance(r["ms"], float) and r["ms"] >= 0 for r in calls)
    assert {r["session"] for r in records} == {records[0]["session"]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_scripted_session_uses_service_and_session_tools(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    Path(root, "index.html").write_text("<p>served</p>\n")
    port = free_port()
    fetch = (
        f'{PY} -c "import urllib.request; '
        f"print(urllib.request.urlopen('http://127.0.0.1:{port}/index.html', timeout=10)"
        f'.read().decode())"'
    )
    server = f"exec {PY} -m http.server {port} --bind 127.0.0.1"
    model = ScriptedModel(
        [
            {
                "tool_calls": [
                    {
                        "name": "start_service",
                        "arguments": {
                            "name": "web",
                            "command": server,
                            "probe": {"type": "tcp", "port": port, "timeout": 30},
                        },
                    },
                    {
                        "name": "start_service",
                        "arguments": {
                            "name": "talker",
                            "command": "echo warming up; sleep 0.2; echo READY now; exec sleep 300",
                            "probe": {"type": "log", "pattern": "^READY", "timeout": 30},
                        },
                    },
                    {
                        "name": "start_service",
                        "arguments": {
                            "name": "broken",
                            "command": "echo cannot start >&2; exit 4",
                            "probe": {"type": "tcp", "port": free_port(), "timeout": 10},
                        },
                    },
                    {
                        "name": "start_service",
                        "arguments": {"name": "bad", "command": "true", "probe": {"type": "tcp"}},
                    },
                    {
                        "name": "session_run",
                        "arguments": {
                            "session": "dev",
                            "command": "mkdir -p sub && cd sub && export MARK=kept",
                        },
                    },
                ]
            },
            {
                "tool_calls": [
                    {"name": "shell", "arguments": {"command": fetch}},
                    {
                        "name": "session_run",
                        "arguments": {"session": "dev", "command": 'pwd; echo "MARK=$MARK"; false'},
                    },
                    {
                        "name": "session_run",
                        "arguments": {
                            "session": "other",
                            "command": 'echo "MARK=${MARK:-unset}"; pwd',
                        },
                    },
                ]
            },
            {
                "tool_calls": [
                    {"name": "service_logs", "arguments": {"name": "web"}},
                    {"name": "service_logs", "arguments": {"name": "talker", "lines": 1}},
                    {
                        "name": "session_run",
                        "arguments": {"session": "dev", "command": "sleep 300", "timeout": 0.5},
                    },
                ]
            },
            {
                "tool_calls": [
                    {"name": "stop_service", "arguments": {"name": "talker"}},
                    {"name": "service_logs", "arguments": {"name": "nosuch"}},
                    {
                        "name": "session_run",
                        "arguments": {"session": "dev", "command": "echo still $MARK"},
                    },
                ]
            },
            {"content": "done"},
        ]
    )
    async with serve(LocalRuntime(), **private(tmp_path)) as session:
        agent = agent_in(session, model, root, tool_prefix="a1-")
        result = await agent.run("services and sessions")
        assert result.stop_reason == "finished"
        t1, t2, t3, t4 = (turn.results for turn in result.turns[:4])
        assert t1[0].ok and "service a1-web: running" in t1[0].text and "ready" in t1[0].text
        assert t1[1].ok and "ready" in t1[1].text
        assert not t1[2].ok and "ServiceFailed" in t1[2].text
        assert not t1[3].ok and "needs a port" in t1[3].text
        assert t1[4].ok and t1[4].text.startswith("exit code 0; cwd ")
        assert "<p>served</p>" in t2[0].text
        assert t2[1].text.startswith("exit code 1; cwd ")
        assert str(Path(root, "sub")) in t2[1].text and "MARK=kept" in t2[1].text
        assert "MARK=unset" in t2[2].text and f"cwd {root}" in t2[2].text
        assert "GET /index.html" in t3[0].text
        assert "READY now" in t3[1].text and "warming up" not in t3[1].text
        assert "timed out" in t3[2].text
        assert "service a1-talker: stopped" in t4[0].text
        assert not t4[1].ok and "NoSuchService" in t4[1].text
        assert "still kept" in t4[2].text
        assert await wait_until_gone(session.marker, "sleep 300") == []
        # The run closed what its tools opened.
        services = await session.client.list_services()
        assert all(s.state in ("stopped", "exited") for s in services.services)
        assert (await session.client.list_sessions()).sessions == []
        await check_ledger(agent, session.client)


async def test_independent_calls_of_one_turn_run_concurrently(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    calls = [{"name": "shell", "arguments": {"command": "sleep 1"}} for _ in range(6)]
    model = ScriptedModel([{"tool_calls": calls}, {"content": "done"}])
    async with serve(LocalRuntime(), **private(tmp_path)) as session:
        agent = agent_in(session, model, root)
        result = await agent.run("sleep a lot")
        turn = result.turns[0]
        assert all(r.ok for r in turn.results)
        # Six one-second sleeps in parallel take far less than six seconds.
        assert turn.tools_ms < 4500, turn.tools_ms


# -- an OpenAI-compatible endpoint -------------------------------------------------------------

KEY_VAR = "HARNESSD_E2E_MODEL_KEY"
KEY = "sk-e2e-do-not-leak-7f3a9c"


class ScriptedEndpoint(ChatEndpoint):
    """A chat-completions server that decides its answer from the request's messages."""

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        tool_results = [m for m in body["messages"] if m["role"] == "tool"]
        step = len(tool_results)
        if step == 0:
            calls = [
                ("c1", "shell", {"command": "env"}),
                ("c2", "write_file", {"path": "notes.txt", "content": "from the model\n"}),
            ]
        elif step == 2:
            calls = [("c3", "read_file", {"path": "notes.txt"})]
        else:
            return _chat(f"finished after {step} tool results", [])
        return _chat(None, calls)


def _chat(content: str | None, calls: Sequence[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": cid,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            for cid, name, args in calls
        ]
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


@pytest.fixture
def endpoint() -> Iterator[ScriptedEndpoint]:
    server = ScriptedEndpoint()
    yield server
    server.close()


async def test_openai_compatible_endpoint_drives_a_session_and_the_key_stays_out(
    tmp_path: Path, endpoint: ScriptedEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)
    root = workspace(tmp_path)
    trace_path = tmp_path / "trace.jsonl"
    model = OpenAIChatModel("e2e-model", endpoint.base_url, KEY_VAR, timeout=30.0)
    launch = serve(LocalRuntime(scrub=[KEY_VAR]), **private(tmp_path))
    async with launch as session:
        agent = agent_in(session, model, root, trace=Trace(trace_path))
        result = await agent.run("take notes")
        agent.trace.close()
        assert result.stop_reason == "finished"
        assert result.final_text == "finished after 3 tool results"
        assert result.tool_errors == 0
        env_text = result.turns[0].results[0].text
        assert "EXECD_MARKER=" in env_text  # it really is the workspace's environment
        assert KEY_VAR not in env_text and KEY not in env_text
        assert Path(root, "notes.txt").read_text() == "from the model\n"
        # Nothing sent to execd carries the key: not the ledger, not any file.
        records = await session.client.ledger_read(agent.session_id, 1)
        assert records and all(KEY.encode() not in r.payload for r in records)
        check = await session.client.run(
            command=f"grep -rl {shlex.quote(KEY)} {shlex.quote(str(tmp_path))} || true"
        )
        assert check.stdout == b""
        await check_ledger(agent, session.client)

    assert endpoint.auth == [f"Bearer {KEY}"] * 3
    last = endpoint.requests[-1]
    assert [t["function"]["name"] for t in last["tools"]] == [spec.name for spec in TOOL_SPECS]
    tool_messages = [m for m in last["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == ["c1", "c2", "c3"]
    assert tool_messages[2]["content"] == "from the model\n"
    assistant = [m for m in last["messages"] if m["role"] == "assistant"]
    assert [c["id"] for c in assistant[0]["tool_calls"]] == ["c1", "c2"]
    assert KEY not in trace_path.read_text()


def test_harnessd_run_command_line(
    tmp_path: Path, endpoint: ScriptedEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)
    root = workspace(tmp_path)
    trace_path = tmp_path / "run-trace.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harnessd",
            "run",
            "--model",
            "e2e-model",
            "--base-url",
            endpoint.base_url,
            "--api-key-env",
            KEY_VAR,
            "--task",
            "take notes",
            "--max-turns",
            "5",
            "--workspace",
            root,
            "--trace",
            str(trace_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "finished after 3 tool results" in proc.stdout
    assert "0 processes left" in proc.stdout
    assert Path(root, "notes.txt").read_text() == "from the model\n"
    env_result = next(
        m["content"] for m in endpoint.requests[-1]["messages"] if m.get("tool_call_id") == "c1"
    )
    assert "EXECD_MARKER=" in env_result
    assert KEY_VAR not in env_result and KEY not in env_result
    assert KEY not in proc.stdout + proc.stderr + trace_path.read_text()
    events = [r["event"] for r in read_trace(trace_path)]
    assert events[0] == "session_start" and "cleanup" in events


# -- interruption -----------------------------------------------------------------------------


async def test_turn_timeout_kills_the_commands_of_the_turn(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    model = ScriptedModel(
        [
            {
                "tool_calls": [
                    {"name": "shell", "arguments": {"command": "sleep 300"}},
                    {"name": "shell", "arguments": {"command": "sleep 300 & sleep 300; wait"}},
                    {"name": "shell", "arguments": {"command": "echo quick"}},
                    {"name": "session_run", "arguments": {"session": "s", "command": "sleep 300"}},
                ]
            },
            {
                "tool_calls": [
                    {"name": "shell", "arguments": {"command": "echo after"}},
                    {"name": "session_run", "arguments": {"session": "s", "command": "echo alive"}},
                ]
            },
            {"content": "done"},
        ]
    )
    async with serve(LocalRuntime(), **private(tmp_path)) as session:
        agent = agent_in(session, model, root, limits=AgentLimits(turn_timeout=4.0))
        task = asyncio.create_task(agent.run("sleep"))
        # While the turn runs, its sleeps are there.
        await eventually(
            lambda: len(marked_running(session.marker, "sleep 300")) >= 4, what="the sleeps"
        )
        result = await task
        assert await wait_until_gone(session.marker, "sleep 300") == []
        first = result.turns[0]
        assert first.interrupted
        errors = [r.error for r in first.results]
        assert errors == ["TurnTimeout", "TurnTimeout", None, "TurnTimeout"]
        assert "quick" in first.results[2].text
        # The next turn runs, in the same persistent session too.
        assert [r.ok for r in result.turns[1].results] == [True, True]
        assert "after" in result.turns[1].results[0].text
        assert "alive" in result.turns[1].results[1].text
        assert result.stop_reason == "finished"
        await check_ledger(agent, session.client)


async def test_cancelling_a_session_kills_its_commands(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    model = ScriptedModel(
        [{"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 300"}}]}]
    )
    async with serve(LocalRuntime(), **private(tmp_path)) as session:
        agent = agent_in(session, model, root)
        task = asyncio.create_task(agent.run("sleep"))
        await eventually(lambda: marked_running(session.marker, "sleep 300"), what="the sleep")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await wait_until_gone(session.marker, "sleep 300") == []


async def test_session_timeout_stops_the_session_and_its_commands(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    model = ScriptedModel(
        [{"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 300"}}]}]
    )
    async with serve(LocalRuntime(), **private(tmp_path)) as session:
        agent = agent_in(
            session, model, root, limits=AgentLimits(session_timeout=1.5, turn_timeout=None)
        )
        result = await agent.run("sleep")
        assert result.stop_reason == "session_timeout"
        assert await wait_until_gone(session.marker, "sleep 300") == []
        entries = [decode_entry(p) for p in agent.ledger.payloads()]
        assert entries[-1]["kind"] == "end" and entries[-1]["reason"] == "session_timeout"
        await check_ledger(agent, session.client)


async def test_max_turns_ends_the_session(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    turn = {"tool_calls": [{"name": "shell", "arguments": {"command": "true"}}]}
    model = ScriptedModel([turn] * 5)
    async with serve(LocalRuntime(), **private(tmp_path)) as session:
        agent = agent_in(session, model, root, limits=AgentLimits(max_turns=3))
        result = await agent.run("loop")
        assert result.stop_reason == "max_turns" and len(result.turns) == 3
        assert model.remaining == 2


# -- ledger sync across a reconnect and an execd restart ----------------------------------------


def shell_turns(count: int) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = [
        {
            "content": f"turn {n}",
            "tool_calls": [
                {"name": "shell", "arguments": {"command": f"echo step {n} >> log.txt"}},
                {"name": "write_file", "arguments": {"path": f"f{n}.txt", "content": str(n)}},
            ],
        }
        for n in range(1, count + 1)
    ]
    turns.append({"content": "done"})
    return turns


async def test_ledger_sync_resumes_after_the_connection_is_closed(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    trace_path = tmp_path / "trace.jsonl"
    async with serve(LocalRuntime(), **private(tmp_path)) as session:

        async def drop() -> None:
            await session.client.close()

        model = Hook(ScriptedModel(shell_turns(6)), at=4, action=drop)
        agent = AgentSession(
            model,
            lambda: session.client,
            reconnect=session.reconnect,
            tools=ToolConfig(root=root),
            trace=Trace(trace_path),
        )
        first_client = session.client
        result = await agent.run("steps")
        agent.trace.close()
        assert session.client is not first_client
        assert result.stop_reason == "finished" and result.tool_errors == 0
        resumed = [s for s in result.syncs if s.head_queries]
        assert len(resumed) == 2  # the first sync, and the one after the reconnect
        assert resumed[1].resumed_from == result.syncs[2].head
        await check_ledger(agent, session.client)
        assert Path(root, "log.txt").read_text().splitlines() == [f"step {n}" for n in range(1, 7)]
    assert any(r["event"] == "reconnect" for r in read_trace(trace_path))


@pytest.mark.parametrize("when", ["between_turns", "during_a_turn"])
async def test_ledger_sync_resumes_across_an_execd_restart(tmp_path: Path, when: str) -> None:
    root = workspace(tmp_path)
    with contextlib.ExitStack() as stack:
        current: dict[str, Any] = {"execd": stack.enter_context(start_execd(tmp_path))}
        restarts: list[int] = []

        async def main() -> None:
            execd: RunningExecd = current["execd"]
            current["client"] = await connect(execd.host, execd.port, execd.token)

            async def kill_execd() -> None:
                old: RunningExecd = current["execd"]
                old.proc.terminate()
                old.proc.wait(timeout=15)
                await eventually(lambda: current["client"].closed, timeout=15)

            async def restart() -> None:
                # A new execd on the same state dir (start_execd keeps it under tmp_path).
                old: RunningExecd = current["execd"]
                old.proc.wait(timeout=15)
                fresh: RunningExecd = stack.enter_context(start_execd(tmp_path))
                assert fresh.state_dir == old.state_dir and fresh.pid != old.pid
                current["execd"] = fresh
                current["client"] = await connect(fresh.host, fresh.port, fresh.token)
                restarts.append(fresh.pid)

            turns = shell_turns(5)
            model: Hook | ScriptedModel
            if when == "between_turns":
                model = Hook(ScriptedModel(turns), at=3, action=kill_execd)
            else:
                # A command of turn 3 stops execd: the turn's sync finds the connection gone.
                turns[2]["tool_calls"] = [
                    {"name": "shell", "arguments": {"command": f"kill -TERM {execd.pid}; sleep 30"}}
                ]
                model = ScriptedModel(turns)
            agent = AgentSession(
                model,
                lambda: current["client"],
                reconnect=restart,
                tools=ToolConfig(root=root),
            )
            result = await agent.run("steps across a restart")
            assert result.stop_reason == "finished"
            assert len(restarts) == 1
            assert result.tool_errors == (0 if when == "between_turns" else 1)
            after = [s for s in result.syncs if s.head_queries][-1]
            assert after.resumed_from == result.syncs[1].head
            # It sent exactly what the new execd lacked: nothing twice, nothing skipped.
            assert after.entries == after.head - after.resumed_from > 0
            await check_ledger(agent, current["client"])
            await current["client"].close()

        await main()


# -- many sessions at once -----------------------------------------------------------------------


async def test_fifty_concurrent_sessions_against_fifty_execds(tmp_path: Path) -> None:
    count = 50

    def script(n: int) -> ScriptedModel:
        return ScriptedModel(
            [
                {
                    "tool_calls": [
                        {"name": "shell", "arguments": {"command": f"echo session {n}"}},
                        {"name": "write_file", "arguments": {"path": "n.txt", "content": str(n)}},
                    ]
                },
                {"tool_calls": [{"name": "read_file", "arguments": {"path": "n.txt"}}]},
                {"tool_calls": [{"name": "shell", "arguments": {"command": "cat n.txt; echo"}}]},
                {"content": f"session {n} done"},
            ]
        )

    async def one(n: int, session: Session) -> tuple[int, str | None]:
        root = workspace(tmp_path, f"ws{n}")
        agent = AgentSession(script(n), lambda: session.client, tools=ToolConfig(root=root))
        result = await agent.run(f"session {n}")
        assert result.stop_reason == "finished" and result.tool_errors == 0
        assert result.turns[1].results[0].text == str(n)
        await check_ledger(agent, session.client)
        return n, result.final_text

    async def main() -> None:
        launches = [
            serve(LocalRuntime(), start_timeout=60.0, **private(tmp_path, str(n)))
            for n in range(count)
        ]
        sessions = await asyncio.gather(*(launch for launch in launches))
        try:
            outcomes = await asyncio.gather(*(one(n, s) for n, s in enumerate(sessions)))
        finally:
            closed = await asyncio.gather(*(s.close() for s in sessions))
        assert sorted(outcomes) == [(n, f"session {n} done") for n in range(count)]
        assert all(c.leftover == 0 for c in closed)
        assert len({s.port for s in sessions}) == count

    await main()


async def test_workspace_env_has_no_model_credentials_with_a_scrubbed_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)
    async with serve(LocalRuntime(scrub=[KEY_VAR]), **private(tmp_path)) as session:
        env = (await session.client.run(["env"])).stdout.decode()
        assert "EXECD_MARKER=" in env
        assert KEY_VAR not in env and KEY not in env
        assert os.environ[KEY_VAR] == KEY
