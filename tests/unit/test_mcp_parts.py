"""The parts of ``harnessd.mcp`` that need no server: lines, output batches, URIs, the gate."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest

pytest.importorskip("mcp")

from harnessd.mcp.catalog import offers, within
from harnessd.mcp.http import BearerGate
from harnessd.mcp.relay import BATCH_CHARS, OutputRelay
from harnessd.mcp.resources import FileRef, LedgerRef, ResourceError, file_uri, parse
from harnessd.mcp.stdio import LineSplitter
from harnessd.tools import TOOLS

pytestmark = pytest.mark.anyio


def test_lines_are_split_across_chunks_and_overlong_ones_skipped_whole() -> None:
    splitter = LineSplitter(limit=8)
    assert splitter.feed(b'{"a"') == []
    assert splitter.feed(b":1}\n{}\n") == [b'{"a":1}', b"{}"]
    # Longer than the limit: reported once, dropped up to its newline, never buffered.
    assert splitter.feed(b"0123456789") == [None]
    assert splitter.feed(b"more of it") == []
    assert splitter.feed(b"end\nok\n") == [b"ok"]
    assert splitter.feed(b"012345678\n") == [None]
    assert splitter.feed(b"12345678\n") == [b"12345678"]


async def _drain(relay: OutputRelay) -> list[tuple[str, str]]:
    return [batch async for batch in relay.batches()]


async def test_output_keeps_order_and_whole_characters() -> None:
    relay = OutputRelay()
    snowman = "☃".encode()
    relay.add("stdout", b"a" + snowman[:1])
    relay.add("stdout", snowman[1:] + b"b\n")
    relay.add("stderr", b"oops\n")
    relay.add("stdout", b"c\n")
    relay.close()
    assert await _drain(relay) == [("stdout", "a☃b\n"), ("stderr", "oops\n"), ("stdout", "c\n")]
    assert relay.total_bytes == len(b"a" + snowman + b"b\noops\nc\n")


async def test_output_batches_are_bounded_and_a_slow_reader_costs_a_marker_not_memory() -> None:
    relay = OutputRelay(cap=3 * BATCH_CHARS)
    relay.add("stdout", b"x" * (2 * BATCH_CHARS + 10))
    relay.add("stdout", b"y" * (2 * BATCH_CHARS))  # does not fit: dropped, counted
    relay.add("stdout", b"z")
    relay.close()
    batches = await _drain(relay)
    assert all(len(text) <= BATCH_CHARS for _, text in batches)
    text = "".join(text for _, text in batches)
    assert text.startswith("x" * (2 * BATCH_CHARS + 10))
    assert f"[... {2 * BATCH_CHARS} characters of output not streamed ...]" in text
    assert text.endswith("z") and "y" not in text


def test_uris_name_workspace_paths_and_ledgers() -> None:
    assert file_uri("/work/a b.txt") == "workspace:///work/a%20b.txt"
    assert parse("workspace:///work/a%20b.txt") == FileRef("/work/a b.txt")
    assert parse("workspace:///work/../etc/x") == FileRef("/etc/x")
    assert parse("ledger:///mcp-1") == LedgerRef("mcp-1")
    assert parse("ledger:///mcp-1?from=40") == LedgerRef("mcp-1", 40)
    for bad in ["file:///etc/passwd", "workspace://host/x", "ledger:///", "ledger:///x?from=0",
                "workspace:///x%00y", "workspace:relative"]:  # fmt: skip
        with pytest.raises(ResourceError):
            parse(bad)


def test_within_is_the_root_or_below_it() -> None:
    assert within("/ws", "/ws") and within("/ws/a/b", "/ws") and within("/ws/a", "/ws/")
    assert not within("/wsx", "/ws") and not within("/", "/ws") and not within("/etc", "/ws")


def test_the_agent_tools_are_offered_unchanged_and_first() -> None:
    offered = offers()
    assert [offer.name for offer in offered[: len(TOOLS)]] == list(TOOLS)
    for offer in offered[: len(TOOLS)]:
        assert offer.schema == TOOLS[offer.name].spec.parameters
    extra = {offer.name: offer for offer in offered[len(TOOLS) :]}
    assert set(extra) == {"stat_path", "service_status"}
    assert extra["stat_path"].schema["required"] == ["path"]
    assert extra["stat_path"].schema["additionalProperties"] is False


async def test_the_gate_answers_401_without_the_right_bearer_token() -> None:
    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["type"])

    gate = BearerGate(app, b"s3cret")

    async def request(headers: list[tuple[bytes, bytes]], kind: str = "http") -> int | None:
        sent: list[MutableMapping[str, Any]] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request"}

        await gate({"type": kind, "headers": headers}, receive, send)
        return sent[0]["status"] if sent else None

    assert await request([]) == 401
    assert await request([(b"authorization", b"Bearer wrong")]) == 401
    assert await request([(b"authorization", b"s3cret")]) == 401
    assert reached == []
    assert await request([(b"authorization", b"Bearer s3cret")]) is None
    assert await request([], kind="lifespan") is None
    assert reached == ["http", "lifespan"]
    with pytest.raises(ValueError):
        BearerGate(app, b"")
