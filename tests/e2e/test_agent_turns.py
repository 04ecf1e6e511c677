"""How one turn's tool calls run, live output, and a cancelled run, against real execds.

The in-order switch (``tool_order="in_order"``) against the concurrent
default, the turn timeout in order, shell output streamed to the trace's
listeners (and the result the model gets unchanged by it), and a run
cancelled mid-call still closing its ledger and trace.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from execd.marker import find_marked
from harnessd.agent import AgentLimits, AgentResult, AgentSession
from harnessd.launcher import serve
from harnessd.ledger_sync import decode_entry
from harnessd.runtime import LocalRuntime
from harnessd.scripted_model import ScriptedModel
from harnessd.toolbox import ToolConfig
from harnessd.trace import Trace

pytestmark = pytest.mark.timeout(120)

PY = shlex.quote(sys.executable)


def arun(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(main())


def private(tmp_path: Path) -> dict[str, Any]:
    return {
        "workdir": str(tmp_path / "execd"),
        "extra_args": ("--state-dir", str(tmp_path / "state")),
    }


def workspace(tmp_path: Path) -> str:
    root = tmp_path / "ws"
    root.mkdir(exist_ok=True)
    return str(root)


class Records:
    """A trace listener keeping every record and notification."""

    def __init__(self) -> None:
        self.all: list[dict[str, Any]] = []

    def __call__(self, record: dict[str, Any]) -> None:
        self.all.append(record)

    def kinds(self) -> list[str]:
        return [r["event"] for r in self.all]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.all if r["event"] == kind]


def write_then_read(pairs: int) -> list[dict[str, Any]]:
    """One turn: write a file, then read it back with a command, ``pairs`` times."""
    calls: list[dict[str, Any]] = []
    for number in range(pairs):
        text = f"version {number} " + "x" * 20000
        calls.append({"name": "write_file", "arguments": {"path": "f.txt", "content": text}})
        calls.append({"name": "shell", "arguments": {"command": "head -c 10 f.txt"}})
    return calls


def run_session(
    tmp_path: Path, turns: list[dict[str, Any]], **options: Any
) -> tuple[AgentResult, Records]:
    records = Records()
    limits = options.pop("limits", AgentLimits(turn_timeout=60.0))

    async def main() -> AgentResult:
        async with serve(LocalRuntime(), **private(tmp_path)) as session:
            agent = AgentSession(
                ScriptedModel(turns),
                lambda: session.client,
                tools=ToolConfig(root=workspace(tmp_path)),
                trace=Trace(listeners=[records]),
                limits=limits,
                **options,
            )
            return await agent.run("write and read")

    return arun(main), records


def test_in_order_runs_each_call_after_the_one_before(tmp_path: Path) -> None:
    pairs = 6
    result, records = run_session(
        tmp_path, [{"tool_calls": write_then_read(pairs)}, {"content": "ok"}], tool_order="in_order"
    )
    assert result.stop_reason == "finished" and result.tool_errors == 0
    reads = [r.text for r in result.turns[0].results if r.name == "shell"]
    assert reads == [f"exit code 0\nstdout:\nversion {n} " for n in range(pairs)]
    # Each call starts only once the one before it has ended.
    turn = [r for r in records.all if r["event"] in ("tool_start", "tool_call")]
    assert [r["event"] for r in turn] == ["tool_start", "tool_call"] * (2 * pairs)
    assert [r["id"] for r in turn[::2]] == [f"call_1_{n}" for n in range(1, 2 * pairs + 1)]
    assert "one after another, in the order given" in result.messages[0].content  # type: ignore[operator]


def test_concurrent_calls_all_start_before_any_ends(tmp_path: Path) -> None:
    result, records = run_session(tmp_path, [{"tool_calls": write_then_read(3)}, {"content": "ok"}])
    assert result.stop_reason == "finished"
    kinds = [k for k in records.kinds() if k in ("tool_start", "tool_call")]
    assert kinds == ["tool_start"] * 6 + ["tool_call"] * 6
    assert "run at the same time" in result.messages[0].content  # type: ignore[operator]
    # Results reach the model in the order of the calls, whatever order they ended in.
    assert [r.call_id for r in result.turns[0].results] == [f"call_1_{n}" for n in range(1, 7)]


def test_in_order_turn_timeout_stops_the_running_call_and_skips_the_rest(tmp_path: Path) -> None:
    calls = [
        {"name": "shell", "arguments": {"command": "echo quick"}},
        {"name": "shell", "arguments": {"command": "sleep 60"}},
        {"name": "shell", "arguments": {"command": "echo never > never.txt"}},
    ]
    started = time.monotonic()
    result, records = run_session(
        tmp_path,
        [{"tool_calls": calls}, {"content": "ok"}],
        tool_order="in_order",
        limits=AgentLimits(turn_timeout=1.0),
    )
    assert time.monotonic() - started < 50  # not the 60 s sleep
    first, second, third = result.turns[0].results
    assert first.ok and "quick" in first.text
    assert second.error == "TurnTimeout" and "interrupted" in second.text
    assert third.error == "TurnTimeout" and third.text.startswith("error: not run")
    assert result.turns[0].interrupted
    assert not Path(workspace(tmp_path), "never.txt").exists()
    assert [r["id"] for r in records.of("tool_start")] == ["call_1_1", "call_1_2"]
    assert [r["id"] for r in records.of("tool_call")] == ["call_1_1", "call_1_2", "call_1_3"]


def test_live_output_streams_and_leaves_the_result_unchanged(tmp_path: Path) -> None:
    small = "for i in 1 2 3; do echo out $i; echo err $i >&2; done"
    big = f"{PY} -c \"import sys; sys.stdout.write(''.join(f'{{i}}\\n' for i in range(60000)))\""
    calls = [
        {"name": "shell", "arguments": {"command": small}},
        {"name": "shell", "arguments": {"command": big}},
        {"name": "shell", "arguments": {"command": "exit 4"}},
    ]
    turns: list[dict[str, Any]] = [{"tool_calls": calls}, {"content": "ok"}]
    live, records = run_session(tmp_path / "live", turns, live_output=True)
    collected, quiet = run_session(tmp_path / "collected", turns)
    assert [r.text for r in live.turns[0].results] == [r.text for r in collected.turns[0].results]
    # Past execd's keep (4 x output_cap) the middle is dropped, in both modes alike.
    assert "stdout was 348890 bytes" in live.turns[0].results[1].text
    assert "exit code 4" in live.turns[0].results[2].text
    assert quiet.of("tool_output") == []
    streamed: dict[tuple[str, str], bytes] = {}
    for note in records.of("tool_output"):
        key = (note["id"], note["stream"])
        streamed[key] = streamed.get(key, b"") + note["data"]
    assert streamed[("call_1_1", "stdout")] == b"out 1\nout 2\nout 3\n"
    assert streamed[("call_1_1", "stderr")] == b"err 1\nerr 2\nerr 3\n"
    assert len(streamed[("call_1_2", "stdout")]) == sum(len(f"{i}\n") for i in range(60000))


def test_a_cancelled_run_records_its_end_in_the_ledger_and_the_trace(tmp_path: Path) -> None:
    records = Records()
    model = ScriptedModel(
        [{"tool_calls": [{"name": "shell", "arguments": {"command": "sleep 60"}}]}]
    )

    async def main() -> None:
        async with serve(LocalRuntime(), **private(tmp_path)) as session:
            agent = AgentSession(
                model,
                lambda: session.client,
                tools=ToolConfig(root=workspace(tmp_path)),
                trace=Trace(listeners=[records]),
            )
            task = asyncio.create_task(agent.run("sleep"))
            while not records.of("tool_start"):
                await asyncio.sleep(0.02)
            # tool_start is recorded before the command reaches execd: wait for its process.
            deadline = time.monotonic() + 15
            while not (marked := find_marked("EXECD_MARKER", session.marker)):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            end = records.all[-1]
            assert end["event"] == "session_end" and end["reason"] == "interrupted"
            assert end["synced_seq"] == agent.ledger.seq
            entries = await session.client.ledger_read(agent.session_id, 1)
            last = decode_entry(entries[-1].payload)
            assert last["kind"] == "end" and last["reason"] == "interrupted"
            assert marked  # the sleep ran, and is gone once the call was cancelled
            deadline = time.monotonic() + 15
            while [p for p in marked if p in find_marked("EXECD_MARKER", session.marker)]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)

    arun(main)
