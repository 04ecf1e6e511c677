"""Section 11: the harness's own cost of one model turn against a local chat-completions endpoint.

A turn of the agent loop asks the model for its next step:
:meth:`harnessd.openai_model.OpenAIChatModel.complete` encodes the conversation
and the tool schemas as JSON, POSTs it, waits, and decodes the assistant
turn. The endpoint here (:mod:`bench.chat_app`, its own process) answers at
once with a canned two-call turn, so what remains is the harness's share:
JSON, HTTP, connection handling, and the event loop's work.

The conversation is that of a session some way in: the system prompt, the
task, and :data:`HISTORY_TURNS` earlier turns of two tool calls each with
results of a few KiB (about 60 KiB of JSON), with every agent tool offered.

Rows, over plain HTTP, over HTTPS (a throwaway certificate; real
endpoints are HTTPS), and over HTTPS through the delay proxy of section 8
(12.5 ms each way, where every new connection costs round trips): the floor is the same request, already encoded,
written on one keep-alive connection and its reply read back with nothing
decoded -- the network's and the server's part. ``model.httpx`` (HTTP only)
is a bare keep-alive ``httpx`` POST of those bytes: the HTTP library's
share. ``model.turn`` / ``model.turn_tls`` / ``model.turn_lan`` is ``complete()``; the row's note
gives its gap to the floor and the bench process's CPU time per turn.

``python -m bench --only model`` runs this section alone. It uses only
``complete()``, ``wire_messages``/``wire_tools`` and ``aclose()`` when there
is one, so the same file measures earlier clients too.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import msgspec

from bench.env import Env
from bench.report import Row
from bench.servers import start_server
from bench.settings import HOST, LAN_DELAY
from bench.stats import interleaved, summarize
from bench.tls import self_signed
from harnessd.models import ChatMessage, ToolCall
from harnessd.openai_model import OpenAIChatModel, wire_messages, wire_tools
from harnessd.tools import TOOL_SPECS

HISTORY_TURNS: Final = 12
SECTION: Final = (
    f"11. One model turn's harness-side cost ({HISTORY_TURNS} earlier turns of history, "
    "canned endpoint on loopback)"
)
FULL_SAMPLES: Final = 400
QUICK_SAMPLES: Final = 20
LAN_SAMPLES: Final = (40, 3)
"""Samples through the delay proxy (full run, quick run): each costs at least a round trip."""


def history() -> list[ChatMessage]:
    """A conversation some way into a session: prompts, then earlier turns with results."""
    messages = [
        ChatMessage(role="system", content="You are an autonomous software agent. " * 8),
        ChatMessage(role="user", content="Fix the failing parser tests in this repository."),
    ]
    for turn in range(HISTORY_TURNS):
        calls = [
            ToolCall(
                id=f"call_{turn}_0",
                name="shell",
                arguments=json.dumps({"command": f"python -m pytest -q tests -k case_{turn}"}),
            ),
            ToolCall(
                id=f"call_{turn}_1",
                name="read_file",
                arguments=json.dumps({"path": f"src/module_{turn}.py"}),
            ),
        ]
        messages.append(
            ChatMessage(role="assistant", content=f"Step {turn}: checking.", tool_calls=calls)
        )
        output = "".join(f"tests/test_{turn}.py::case_{n} PASSED\n" for n in range(60))
        source = "".join(f"def handler_{n}(value):\n    return value * {n}\n\n" for n in range(80))
        messages.append(
            ChatMessage(
                role="tool", content=f"exit code 0\nstdout:\n{output}", tool_call_id=calls[0].id
            )
        )
        messages.append(ChatMessage(role="tool", content=source, tool_call_id=calls[1].id))
    return messages


class FloorExchange:
    """One keep-alive connection replaying pre-encoded request bytes (the floor)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.request = b""

    @classmethod
    async def open(cls, port: int, body: bytes, tls: ssl.SSLContext | None) -> FloorExchange:
        """Connect (TLS when ``tls``) and pre-encode the POST of ``body``."""
        reader, writer = await asyncio.open_connection(HOST, port, ssl=tls)
        exchange = cls(reader, writer)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        exchange.request = head.encode() + body
        return exchange

    async def __call__(self) -> None:
        """Write the request; read the reply's head and its Content-Length bytes."""
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)

    async def close(self) -> None:
        """Close the connection."""
        self.writer.close()
        await self.writer.wait_closed()


def request_body(messages: list[ChatMessage]) -> bytes:
    """The request ``complete()`` sends for ``messages``, encoded once (for the floor)."""
    body = {
        "model": "bench-model",
        "messages": wire_messages(messages),
        "tools": wire_tools(TOOL_SPECS),
        "tool_choice": "auto",
    }
    return msgspec.json.encode(body)


class _Turns:
    """``complete()`` on one model, timing the CPU it takes."""

    def __init__(self, url: str, tls: ssl.SSLContext | None) -> None:
        self.model = OpenAIChatModel("bench-model", url, None, max_retries=0, ssl_context=tls)
        self.messages = history()
        self.specs = list(TOOL_SPECS)
        self.cpu: list[float] = []

    async def __call__(self) -> None:
        started = time.process_time()
        reply = await self.model.complete(self.messages, self.specs)
        self.cpu.append(time.process_time() - started)
        assert len(reply.tool_calls) == 2

    async def close(self) -> None:
        close: Callable[[], Awaitable[object]] | None = getattr(self.model, "aclose", None)
        if close is not None:
            await close()


async def _measure(
    port: int, tls: ssl.SSLContext | None, samples: int, with_httpx: bool
) -> dict[str, Any]:
    """Floor, ``complete()`` and (``with_httpx``) bare httpx, interleaved, on ``port``."""
    scheme = "https" if tls is not None else "http"
    body = request_body(history())
    floor = await FloorExchange.open(port, body, tls)
    turns = _Turns(f"{scheme}://{HOST}:{port}/v1", tls)
    approaches: dict[str, Callable[[], Awaitable[object]]] = {"floor": floor, "turn": turns}
    bare: Any = None
    if with_httpx:
        import httpx

        bare = httpx.AsyncClient(timeout=30.0)
        url = f"{scheme}://{HOST}:{port}/v1/chat/completions"
        headers = {"Content-Type": "application/json"}

        async def post() -> None:
            response = await bare.post(url, content=body, headers=headers)
            assert response.status_code == 200 and response.content

        approaches["httpx"] = post
    try:
        timed = await interleaved(
            approaches, dict.fromkeys(approaches, samples), rounds=min(4, samples), warmup=3
        )
    finally:
        await floor.close()
        await turns.close()
        if bare is not None:
            await bare.aclose()
    ms = {name: summarize([us / 1000 for us in values]) for name, values in timed.items()}
    cpu = summarize([seconds * 1000 for seconds in turns.cpu[-samples:]])
    return {"ms": ms, "cpu": cpu, "kib": len(body) / 1024}


async def run(env: Env) -> list[Row]:
    """The floor, bare httpx and ``complete()``, interleaved, over HTTP then HTTPS."""
    samples = QUICK_SAMPLES if env.settings.quick else FULL_SAMPLES
    rows: list[Row] = []
    lan_samples = LAN_SAMPLES[1] if env.settings.quick else LAN_SAMPLES[0]
    with tempfile.TemporaryDirectory(prefix="bench-tls-", dir=env.settings.tmp_dir) as scratch:
        cert, _ = self_signed(Path(scratch))
        trust = ssl.create_default_context(cafile=str(cert))
        async with start_server("chat") as server:
            rows += _rows(await _measure(server.ports["chat"], None, samples, True), "")
        async with start_server("chat", "--tls-dir", scratch) as server:
            port = server.ports["chat"]
            rows += _rows(await _measure(port, trust, samples, False), "_tls")
            target = f"{HOST}:{port}"
            async with start_server("proxy", "--target", target, "--delay", repr(LAN_DELAY)) as lan:
                found = await _measure(lan.ports["proxy"], trust, lan_samples, False)
            rows += _rows(found, "_lan")
    return rows


_HOW: Final = {
    "": "HTTP",
    "_tls": "HTTPS",
    "_lan": f"HTTPS, {LAN_DELAY * 1000:g} ms each way",
}


def _rows(found: dict[str, Any], suffix: str) -> list[Row]:
    ms, cpu, kib = found["ms"], found["cpu"], found["kib"]
    how = _HOW[suffix]
    floor_key = f"model.floor{suffix}"
    rows = [
        Row(
            key=floor_key,
            section=SECTION,
            short=f"floor {how}",
            label=f"{how}: the same {kib:.0f} KiB request pre-encoded, keep-alive, reply not decoded",
            unit="ms",
            **ms["floor"].figures(),
        )
    ]
    if "httpx" in ms:
        rows.append(
            Row(
                key="model.httpx",
                section=SECTION,
                short="bare httpx",
                label=f"{how}: bare httpx keep-alive POST of those bytes, reply read",
                unit="ms",
                **ms["httpx"].figures(),
                baselines=(floor_key,),
            )
        )
    turn = ms["turn"]
    rows.append(
        Row(
            key=f"model.turn{suffix}",
            section=SECTION,
            short=f"complete() {how}",
            label=f"{how}: OpenAIChatModel.complete: encode, POST, decode the turn",
            unit="ms",
            **turn.figures(),
            baselines=(floor_key, *(("model.httpx",) if "httpx" in ms else ())),
            note=f"{turn.p50 - ms['floor'].p50:.2f} ms over the floor, {cpu.p50:.2f} ms CPU",
            extra={
                "overhead_ms": turn.p50 - ms["floor"].p50,
                "cpu_ms": cpu.p50,
                "request_kib": kib,
            },
        )
    )
    return rows
