"""An agent turn whose connection is cut while its tool calls run finishes as if nothing happened.

The session's client goes through a :class:`~tests.support.cut_proxy.CutProxy`;
the cut falls while eight tool calls of one turn are running in execd. The
session reconnects by itself and reattaches them (request ids, PROTOCOL.md
8.1): every call ran once, every result arrives once, and the ledger holds
each entry once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from harnessd.agent import AgentSession
from harnessd.ledger_sync import decode_entry
from harnessd.scripted_model import ScriptedModel
from harnessd.toolbox import ToolConfig
from harnessd.trace import Trace
from tests.conftest import eventually, one_loop
from tests.support.cut_proxy import CutProxy
from tests.support.hooked_model import Hook
from tests.support.proxied import proxied_session

pytestmark = [pytest.mark.anyio, one_loop, pytest.mark.timeout(120)]

CALLS = 8


async def cut_when_all_started(proxy: CutProxy, started: Path) -> None:
    """Cut the connection once every tool call of the turn has written its line to ``started``."""

    def all_started() -> bool:
        return started.exists() and len(started.read_text().splitlines()) == CALLS

    await eventually(all_started, timeout=30, what="every tool call started")
    assert proxy.cut() == 1


@pytest.mark.parametrize("live_output", [False, True], ids=["collected", "streamed"])
async def test_a_turn_of_eight_calls_cut_in_the_middle_completes_with_every_result_once(
    tmp_path: Path, live_output: bool
) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    started = root / "started.log"
    turns: list[dict[str, Any]] = [
        {
            "content": "eight at once",
            "tool_calls": [
                {
                    "name": "shell",
                    "arguments": {"command": f"echo {i} >> started.log; sleep 1.5; echo done-{i}"},
                }
                for i in range(CALLS)
            ],
        },
        {"content": "done"},
    ]
    async with proxied_session(tmp_path) as (session, proxy):
        cutters: list[asyncio.Task[None]] = []

        async def arm_the_cut() -> None:
            cutters.append(asyncio.ensure_future(cut_when_all_started(proxy, started)))

        model = Hook(ScriptedModel(turns), at=1, action=arm_the_cut)
        agent = AgentSession(
            model,
            lambda: session.client,
            reconnect=session.reconnect,
            tools=ToolConfig(root=str(root)),
            trace=Trace(tmp_path / "trace.jsonl"),
            live_output=live_output,
        )
        before = session.client
        result = await agent.run("eight calls")
        agent.trace.close()
        await cutters.pop()
        assert proxy.cuts == 1 and session.client is not before
        assert result.stop_reason == "finished" and result.tool_errors == 0
        texts = [tool.text for tool in result.turns[0].results]
        assert len(texts) == CALLS
        assert texts == [f"exit code 0\nstdout:\ndone-{i}\n" for i in range(CALLS)]
        # Each command ran once.
        assert sorted(started.read_text().split()) == sorted(str(i) for i in range(CALLS))
        # The ledger: every entry once, execd's copy equal to ours.
        client = session.client
        assert await agent.sync.verify_remote(client) == agent.ledger.seq
        records = await client.ledger_read(agent.session_id, 1)
        assert [r.payload for r in records] == list(agent.ledger.payloads())
        entries = [decode_entry(p) for p in agent.ledger.payloads()]
        ids = [e["tool_call_id"] for e in entries if e["kind"] == "tool_result"]
        assert len(ids) == len(set(ids)) == CALLS
