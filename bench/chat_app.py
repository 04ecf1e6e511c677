"""The chat-completions endpoint of the model-turn section (served by :mod:`bench.servers`).

A raw ASGI app: it reads the whole request body (a server must, before it
can answer) and sends the same canned completion every time -- an
assistant turn with two tool calls and usage figures, about the size of a
real one. No JSON work on the server side, so what the section measures is
the client's.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def canned_reply() -> bytes:
    """The completion every request gets."""
    calls = [
        {
            "id": f"call_{index}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)},
        }
        for index, (name, arguments) in enumerate(
            [
                ("shell", {"command": "python -m pytest -q tests/test_parser.py", "timeout": 120}),
                ("read_file", {"path": "src/parser.py", "max_bytes": 65536}),
            ]
        )
    ]
    reply = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench-model",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "The parser fails on nested quotes; let me run its tests and "
                    "read it.",
                    "tool_calls": calls,
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 12000, "completion_tokens": 80, "total_tokens": 12080},
    }
    return json.dumps(reply).encode()


REPLY: Final = canned_reply()
_HEADERS: Final = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(REPLY)).encode()),
]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answer every HTTP request with :data:`REPLY`."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = bool(message.get("more_body"))
        if message["type"] == "http.disconnect":
            return
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": REPLY})
