"""Live progress of an agent session for the person watching it: what runs, what it prints, what waits.

:class:`Progress` is a trace listener (see :mod:`harnessd.trace`) writing to
a text stream -- stderr on the command line, so stdout stays the
transcript. It shows each tool call as it starts and ends, the output of
shell commands as it arrives (at most ``live_lines`` lines per call; the
result the model gets is not affected), each wait for the model with its
retries (attempt, status or error, wait and why), and how long things take.

Theory of operation: records arrive synchronously from the agent loop; the
display keeps what is in flight (the model call, the running tool calls).
On a terminal one status line at the bottom says what is in flight and for
how long; a timer rewrites it every ``tick`` seconds, and it is erased
before any record is handled, so lines printed by this or any other
listener (the transcript on stdout, often the same terminal) start on a
clean line. Elsewhere there is no status line: plain lines only, plus a
"still waiting" line for whatever has been in flight for another
``plain_every`` seconds.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

LIVE_LINES = 20
"""Output lines shown per tool call."""

LINE_CHARS = 200
"""Longest output line shown; longer ones are cut."""

_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?")


def elapsed(seconds: float) -> str:
    """``6.0 s``, ``2 min 21 s``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def printable(text: str) -> str:
    """``text`` safe to print: escape sequences removed, a carriage return keeps what follows it,
    other control characters shown as ``?``."""
    text = _ESCAPES.sub("", text)
    if "\r" in text:
        text = text.rsplit("\r", 1)[1]
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == "\t" else "?" for ch in text)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def summary(name: str, arguments: str, limit: int = 100) -> str:
    """A one-line view of a call's arguments: the command for commands, else compact JSON."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        for key in ("command", "path", "name"):
            value = parsed.get(key)
            if isinstance(value, str) and (key == "command" or len(parsed) == 1):
                return _cut(printable(" ".join(value.split())), limit)
        text = json.dumps(parsed, ensure_ascii=False, separators=(",", ":"))
    else:
        text = arguments
    return _cut(printable(text), limit)


@dataclass(slots=True)
class _Call:
    name: str
    started: float
    shown: int = 0
    cut: bool = False
    pending: dict[str, str] = field(default_factory=dict)
    decoders: dict[str, codecs.IncrementalDecoder] = field(default_factory=dict)


@dataclass(slots=True)
class _ModelWait:
    turn: int
    started: float
    attempt: int = 1


class Progress:
    """Writes live progress of a session to ``out`` (see the module docstring).

    ``tty``: whether ``out`` is a terminal (default: ask it). ``tick``:
    seconds between status line updates on a terminal. ``plain_every``:
    seconds between "still waiting" lines elsewhere. ``live_lines`` and
    ``line_chars`` bound the output shown per call.
    """

    def __init__(
        self,
        out: TextIO,
        *,
        tty: bool | None = None,
        tick: float = 1.0,
        plain_every: float = 15.0,
        live_lines: int = LIVE_LINES,
        line_chars: int = LINE_CHARS,
    ) -> None:
        self.out = out
        if tty is None:
            try:
                tty = out.isatty()
            except (OSError, ValueError):
                tty = False
        self.tty = tty
        self.tick = tick
        self.plain_every = plain_every
        self.live_lines = live_lines
        self.line_chars = line_chars
        self._model: _ModelWait | None = None
        self._calls: dict[str, _Call] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._status = False
        self._last_plain = 0.0

    # -- the listener --------------------------------------------------------------------------

    def __call__(self, record: dict[str, Any]) -> None:
        self._erase()
        handler = getattr(self, f"_on_{record['event']}", None)
        if handler is not None:
            handler(record)
        self._flush()
        self._schedule()

    def close(self) -> None:
        """Stop the timer and erase the status line (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._model = None
        self._calls.clear()
        self._erase()
        self._flush()

    def _on_model_start(self, record: dict[str, Any]) -> None:
        self._model = _ModelWait(record["turn"], time.monotonic())
        self._line(f"model: asking for turn {record['turn']}")

    def _on_model_retry(self, record: dict[str, Any]) -> None:
        what = f"HTTP {record['status']}" if record.get("status") else str(record.get("error"))
        wait = elapsed(float(record["wait"]))
        asked = record.get("retry_after")
        if asked is None:
            why = ""
        elif record.get("capped"):
            why = f" (Retry-After asked {elapsed(float(asked))}; capped)"
        else:
            why = " (as Retry-After asked)"
        self._line(
            f"model: attempt {record['attempt']} of {record['attempts']} failed: {what}; "
            f"retrying in {wait}{why}"
        )
        if self._model is not None:
            self._model.attempt = int(record["attempt"]) + 1

    def _on_model_adapted(self, record: dict[str, Any]) -> None:
        self._line(f"model: the endpoint refused {record['param']}; {record['change']}")

    def _on_model_turn(self, record: dict[str, Any]) -> None:
        calls = len(record.get("tool_calls") or ())
        what = f"{calls} tool call{'s' if calls != 1 else ''}" if calls else "no tool call"
        self._line(f"model: answered in {elapsed(record['ms'] / 1000.0)}, {what}")
        self._model = None

    def _on_model_error(self, record: dict[str, Any]) -> None:
        self._line(f"model: failed: {record['error']}")
        self._model = None

    def _on_tool_start(self, record: dict[str, Any]) -> None:
        call_id = record["id"]
        self._calls[call_id] = _Call(record["name"], time.monotonic())
        self._line(
            f"[{call_id}] {record['name']} started: {summary(record['name'], record['arguments'])}"
        )

    def _on_tool_output(self, record: dict[str, Any]) -> None:
        call = self._calls.get(record["id"])
        if call is None or call.cut:
            return
        stream = record["stream"]
        decoder = call.decoders.get(stream)
        if decoder is None:
            decoder = call.decoders[stream] = codecs.getincrementaldecoder("utf-8")("replace")
        text = call.pending.get(stream, "") + decoder.decode(record["data"])
        *lines, rest = text.split("\n")
        if len(rest) > self.line_chars:
            lines.append(rest)
            rest = ""
        call.pending[stream] = rest
        for line in lines:
            self._output_line(record["id"], call, stream, line)
            if call.cut:
                break

    def _output_line(self, call_id: str, call: _Call, stream: str, line: str) -> None:
        if call.shown >= self.live_lines:
            call.cut = True
            call.pending.clear()
            self._line(f"[{call_id}] ... more output not shown here (the result has it)")
            return
        call.shown += 1
        mark = "|" if stream == "stdout" else "!"
        self._line(f"[{call_id}] {mark} {_cut(printable(line), self.line_chars)}")

    def _on_tool_call(self, record: dict[str, Any]) -> None:
        call_id = record["id"]
        call = self._calls.pop(call_id, None)
        if call is not None and not call.cut:
            for stream, rest in list(call.pending.items()):
                if rest:
                    self._output_line(call_id, call, stream, rest)
        took = elapsed(record["ms"] / 1000.0)
        outcome = f"done in {took}" if record["ok"] else f"failed in {took} ({record['error']})"
        self._line(f"[{call_id}] {record['name']} {outcome}")

    def _on_session_end(self, record: dict[str, Any]) -> None:
        self._model = None
        self._calls.clear()

    # -- output --------------------------------------------------------------------------------

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.out.write(text)

    def _flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.out.flush()

    def _line(self, text: str) -> None:
        self._write(text + "\n")
        self._last_plain = time.monotonic()

    def _erase(self) -> None:
        if self._status:
            self._write("\r\x1b[K")
            self._status = False

    def _waiting(self) -> bool:
        return self._model is not None or bool(self._calls)

    def _schedule(self) -> None:
        if not self._waiting():
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._timer = loop.call_later(self.tick if self.tty else 1.0, self._on_tick)

    def _on_tick(self) -> None:
        self._timer = None
        if not self._waiting():
            return
        now = time.monotonic()
        if self.tty:
            self._erase()
            self._write(self._status_text(now))
            self._status = True
        elif now - self._last_plain >= self.plain_every:
            self._last_plain = now
            for line in self._still_lines(now):
                self._line(line)
        self._flush()
        self._schedule()

    def _model_wait(self, now: float) -> str:
        """``(turn N[, attempt K]), ELAPSED`` of the model call in flight."""
        wait = self._model
        assert wait is not None
        attempt = f", attempt {wait.attempt}" if wait.attempt > 1 else ""
        return f"(turn {wait.turn}{attempt}), {elapsed(now - wait.started)}"

    def _status_text(self, now: float) -> str:
        width = max(20, shutil.get_terminal_size((100, 24)).columns - 1)
        parts: list[str] = []
        if self._model is not None:
            parts.append(f"waiting for the model {self._model_wait(now)}")
        if self._calls:
            running = ", ".join(
                f"{call.name} [{call_id}] {elapsed(now - call.started)}"
                for call_id, call in self._calls.items()
            )
            parts.append(f"running {len(self._calls)}: {running}")
        return _cut("... " + "; ".join(parts), width)

    def _still_lines(self, now: float) -> list[str]:
        lines: list[str] = []
        if self._model is not None:
            lines.append(f"model: still waiting {self._model_wait(now)}")
        for call_id, call in self._calls.items():
            lines.append(f"[{call_id}] {call.name} still running, {elapsed(now - call.started)}")
        return lines
