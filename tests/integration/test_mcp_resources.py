"""``harnessd mcp``'s resources: workspace files and session ledgers, read and subscribed to.

The SDK's client reads them over stdio, subscribes on the 2025-11-25
protocol (``resources/subscribe``) and on 2026-07-28 (``subscriptions/listen``),
and sees ``notifications/resources/updated`` when execd's watch sees the change.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

import mcp_types as types
from mcp.shared.exceptions import MCPError

from tests.conftest import eventually, one_loop
from tests.support.mcp_peer import stdio_server, text_of

pytestmark = [pytest.mark.anyio, one_loop, pytest.mark.slow]


def _uri(path: Path) -> str:
    return f"workspace://{path}"


async def test_files_and_ledgers_are_listed_and_read(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    (workspace / "src").mkdir(parents=True)
    (workspace / "src" / "main.py").write_text("print('hi')\n")
    (workspace / "blob.bin").write_bytes(b"\xff\x00\xfe")
    async with stdio_server(tmp_path, "--confine") as (client, _):
        await client.call_tool("shell", {"command": "echo recorded"})
        listed = {resource.uri: resource for resource in (await client.list_resources()).resources}
        main = _uri(workspace / "src" / "main.py")
        assert main in listed and listed[main].size == 12
        ledgers = [uri for uri in listed if uri.startswith("ledger:///mcp-")]
        assert len(ledgers) == 1
        templates = (await client.list_resource_templates()).resource_templates
        assert {t.uri_template for t in templates} == {"workspace://{+path}", "ledger:///{session}"}

        text = (await client.read_resource(main)).contents[0]
        assert isinstance(text, types.TextResourceContents) and text.text == "print('hi')\n"
        blob = (await client.read_resource(_uri(workspace / "blob.bin"))).contents[0]
        assert isinstance(blob, types.BlobResourceContents)
        assert base64.b64decode(blob.blob) == b"\xff\x00\xfe"
        listing = (await client.read_resource(_uri(workspace / "src"))).contents[0]
        assert isinstance(listing, types.TextResourceContents) and "main.py" in listing.text

        async def journal() -> list[Any]:
            # The ledger is synced after the call's result went out.
            ledger = (await client.read_resource(ledgers[0])).contents[0]
            assert isinstance(ledger, types.TextResourceContents)
            lines = [json.loads(line) for line in ledger.text.splitlines()]
            return lines if len(lines) >= 3 else []

        entries = await eventually(journal, what="the call in the ledger")
        assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
        assert entries[0]["entry"]["kind"] == "session_start"
        assert entries[0]["entry"]["root"] == str(workspace)
        assert entries[1]["entry"]["kind"] == "tool_call"
        assert json.loads(entries[1]["entry"]["arguments"]) == {"command": "echo recorded"}
        assert entries[2]["entry"]["kind"] == "tool_result"
        assert "recorded" in entries[2]["entry"]["content"]

        for uri, code in [
            ("workspace:///etc/passwd", -32602),  # outside the workspace
            (_uri(workspace / "missing.txt"), -32002),
            ("https://example.invalid/x", -32602),
            ("ledger:///x?from=zero", -32602),
        ]:
            with pytest.raises(MCPError) as failure:
                await client.read_resource(uri)
            assert failure.value.error.code == code, (uri, failure.value.error)
        assert "still" in text_of(await client.call_tool("shell", {"command": "echo still"}))


def _updates(seen: list[str]) -> Any:
    async def handle(message: Any) -> None:
        params = getattr(message, "params", None)
        if getattr(message, "method", None) == "notifications/resources/updated" and params:
            seen.append(params.uri)

    return handle


@pytest.mark.filterwarnings("ignore:resources/subscribe is removed")
@pytest.mark.filterwarnings("ignore:resources/unsubscribe is removed")
async def test_subscriptions_report_changes_to_files_and_the_ledger(tmp_path: Path) -> None:
    target = tmp_path / "ws" / "watched.txt"
    target.parent.mkdir()
    target.write_text("v1")
    seen: list[str] = []
    async with stdio_server(tmp_path, message_handler=_updates(seen)) as (client, _):
        ledger = next(
            r.uri
            for r in (await client.list_resources()).resources
            if r.uri.startswith("ledger:///mcp-")
        )
        await client.subscribe_resource(_uri(target))
        await client.subscribe_resource(ledger)
        await client.call_tool("write_file", {"path": "watched.txt", "content": "v2"})
        with anyio.fail_after(20):
            while not {_uri(target), ledger} <= set(seen):
                await anyio.sleep(0.02)
        await client.unsubscribe_resource(_uri(target))
        with pytest.raises(MCPError, match="not a resource"):
            await client.subscribe_resource("file:///etc/passwd")


async def test_listen_streams_resource_updates_on_the_modern_protocol(tmp_path: Path) -> None:
    target = tmp_path / "ws" / "watched.txt"
    target.parent.mkdir()
    target.write_text("v1")
    async with stdio_server(tmp_path, mode="auto") as (client, _):
        assert client.protocol_version == "2026-07-28"
        async with client.listen(resource_subscriptions=[_uri(target)]) as subscription:
            await client.call_tool("write_file", {"path": "watched.txt", "content": "v2"})
            with anyio.fail_after(20):
                async for event in subscription:
                    assert getattr(event, "uri", None) == _uri(target)
                    break
