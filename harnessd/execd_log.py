"""What execd's log says: its announcements, how it exited, and a tail fit to show.

execd and the launcher's supervisor write one log in the workspace; execd
prints JSON lines (``{"event": "listening", ...}``, ``{"event": "exited",
...}``) among its log lines, and the supervisor adds its own ``exited``
line. The launcher reads the log back through the runtime and asks this
module what it says; a tail of it, with the token redacted, goes into
:class:`~harnessd.errors.LaunchFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from harnessd.runtime import Runtime

LOG_TAIL_LINES = 40
"""How many trailing log lines a LaunchFailed carries."""

MAX_LOG_READ = 8 * 1024 * 1024
"""Largest log the launcher reads back."""

POLL_FIRST = 0.02
"""First pause between two reads of the log; it grows to :data:`POLL_MAX`."""
POLL_MAX = 0.25
"""Longest pause between two reads of the log."""
_MAX_LINE = 1000
_REDACTED = "[token redacted]"


def parse_event(line: bytes) -> dict[str, Any] | None:
    """The JSON event on one log line (``{"event": ...}``), or None for any other line."""
    text = line.strip()
    if not text.startswith(b"{"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, dict) and isinstance(value.get("event"), str):
        return value
    return None


def scan(data: bytes) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The first ``exited`` and the first ``listening`` event in a log."""
    exited: dict[str, Any] | None = None
    listening: dict[str, Any] | None = None
    for line in data.splitlines():
        event = parse_event(line)
        if event is None:
            continue
        if event["event"] == "exited" and exited is None:
            exited = event
        elif event["event"] == "listening" and listening is None:
            listening = event
    return exited, listening


def describe_exit(event: dict[str, Any]) -> str:
    """How an ``exited`` event reads in a sentence: "exited with status N: why"."""
    code = event.get("code")
    error = event.get("error")
    if event.get("source") == "supervisor" and isinstance(code, int) and code > 128:
        what = f"was ended by signal {code - 128}"
    else:
        what = f"exited with status {code}"
    if isinstance(error, str) and error:
        what += f": {error[:_MAX_LINE]}"
    return what


def log_tail(data: bytes, token: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log, each cut to 1000 characters, ``token`` redacted."""
    text = data.decode("utf-8", "replace")
    if token:
        text = text.replace(token, _REDACTED)
    kept = text.splitlines()[-lines:]
    shown = [line if len(line) <= _MAX_LINE else line[:_MAX_LINE] + "..." for line in kept]
    return "\n".join(shown) if shown else "(the log is empty)"


async def await_exit(runtime: Runtime, log_path: str, limit: float) -> int | None:
    """Poll the log until an ``exited`` line appears; its code, or None after ``limit`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    delay = POLL_FIRST
    while True:
        with contextlib.suppress(Exception):
            exited, _ = scan(await runtime.read_file(log_path, max_bytes=MAX_LOG_READ))
            if exited is not None:
                code = exited.get("code")
                return code if isinstance(code, int) else -1
        left = deadline - loop.time()
        if left <= 0:
            return None
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 1.5, POLL_MAX)
