"""Section 9: the harness's own cost of one model turn against a local chat-completions endpoint.

A turn of the agent loop asks the model for its next step:
:meth:`harnessd.models.OpenAIChatModel.complete` encodes the conversation
and the tool schemas as JSON, POSTs it, waits, and decodes the assistant
turn. The endpoint here (:mod:`bench.chat_app`, its own process) answers at
once with a canned two-call turn, so what remains is the harness's share:
JSON, HTTP, connection handling, and the event loop's work.

The conversation is that of a session some way in: the system prompt, the
task, and :data:`HISTORY_TURNS` earlier turns of two tool calls each with
results of a few KiB (about 60 KiB of JSON), with every agent tool offered.

Rows: the floor is the same request, already encoded, written on one
keep-alive connection and its reply read back with nothing decoded -- the
network and the server's part. ``model.turn`` is ``complete()``; its
``overhead_ms`` is the gap to the floor, ``cpu_ms`` the bench process's CPU
time per turn. ``python -m bench --only model`` runs this section alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Final

from bench.env import Env
from bench.report import Row
from bench.servers import start_server
from bench.settings import HOST
from bench.stats import interleaved, summarize
from harnessd.models import ChatMessage, OpenAIChatModel, ToolCall
from harnessd.tools import TOOL_SPECS

HISTORY_TURNS: Final = 12
SECTION: Final = f"9. One model turn's harness-side cost ({HISTORY_TURNS} earlier turns of history)"
FULL_SAMPLES: Final = 400
QUICK_SAMPLES: Final = 20


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
    async def open(cls, port: int, body: bytes) -> FloorExchange:
        """Connect and pre-encode the POST of ``body``."""
        reader, writer = await asyncio.open_connection(HOST, port)
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
    from harnessd.models import wire_messages, wire_tools

    body = {
        "model": "bench-model",
        "messages": wire_messages(messages),
        "tools": wire_tools(TOOL_SPECS),
        "tool_choice": "auto",
    }
    return json.dumps(body).encode()


async def run(env: Env) -> list[Row]:
    """The floor and ``complete()``, interleaved, against one canned endpoint."""
    samples = QUICK_SAMPLES if env.settings.quick else FULL_SAMPLES
    messages = history()
    specs = list(TOOL_SPECS)
    async with start_server("chat") as server:
        port = server.ports["chat"]
        model = OpenAIChatModel("bench-model", f"http://{HOST}:{port}/v1", None, max_retries=0)
        floor = await FloorExchange.open(port, request_body(messages))
        cpu: list[float] = []

        async def turn() -> None:
            started = time.process_time()
            reply = await model.complete(messages, specs)
            cpu.append(time.process_time() - started)
            assert len(reply.tool_calls) == 2

        try:
            timed = await interleaved(
                {"floor": floor, "turn": turn},
                {"floor": samples, "turn": samples},
                rounds=4,
                warmup=10,
            )
        finally:
            await floor.close()
            close = getattr(model, "aclose", None)
            if close is not None:
                await close()
    floor_ms = summarize([us / 1000 for us in timed["floor"]])
    turn_ms = summarize([us / 1000 for us in timed["turn"]])
    body_kib = len(request_body(messages)) / 1024
    cpu_ms = summarize([seconds * 1000 for seconds in cpu[-len(timed["turn"]) :]])
    base = Row(
        key="model.floor",
        section=SECTION,
        short="floor",
        label=f"the same {body_kib:.0f} KiB request pre-encoded, keep-alive, reply not decoded",
        unit="ms",
        p50=floor_ms.p50,
        p99=floor_ms.p99,
        n=floor_ms.n,
    )
    row = Row(
        key="model.turn",
        section=SECTION,
        short="complete()",
        label="OpenAIChatModel.complete: encode, POST, decode the turn",
        unit="ms",
        p50=turn_ms.p50,
        p99=turn_ms.p99,
        n=turn_ms.n,
        baselines=("model.floor",),
        note=f"{turn_ms.p50 - floor_ms.p50:.2f} ms over the floor, {cpu_ms.p50:.2f} ms CPU",
        extra={
            "overhead_ms": turn_ms.p50 - floor_ms.p50,
            "cpu_ms": cpu_ms.p50,
            "request_kib": body_kib,
        },
    )
    return [base, row]
