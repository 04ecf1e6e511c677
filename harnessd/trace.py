"""The JSONL trace of one agent session: one JSON object per line, flushed as written.

Every record has ``event`` (its kind), ``session`` and ``t`` (seconds since
the trace was opened), then the event's fields. Kinds written by the agent
loop: ``session_start``, ``model_start`` (a model call begins),
``model_retry`` (attempt, attempts, status or error, wait, retry_after,
capped), ``model_adapted`` (a field the endpoint refused was changed),
``model_turn``, ``model_error``, ``tool_start`` (id, name, arguments),
``tool_call`` (name, arguments, ``ms``, ``ok``, truncated result; written as
each call ends), ``turn_end``, ``sync`` / ``sync_error`` (the ledger sync
figures), ``session_end`` (always the session's last: reason ``finished``,
``max_turns``, ``session_timeout``, ``model_error``, ``interrupted`` or
``error``); the command line adds ``signal`` and ``cleanup``.

Listeners (a transcript printer, a progress display) get every record as it
is written, whether or not a file is attached, and also the notifications
sent with :meth:`Trace.notify` (``tool_output``: live command output), which
are never written to the file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

Listener = Callable[[dict[str, Any]], None]


def _default(value: object) -> object:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return str(value)


class Trace:
    """One session's trace: an optional JSONL file plus listeners.

    ``path``: the file to write (truncated when opened; None: no file).
    Records are written with one ``write`` and flushed, so a crash loses at
    most the record being written. Not shared between sessions.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        session: str = "",
        listeners: list[Listener] | None = None,
    ) -> None:
        self.session = session
        self.path = Path(path) if path is not None else None
        self._file: IO[str] | None = None
        if self.path is not None:
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._listeners: list[Listener] = list(listeners or ())
        self._start = time.monotonic()
        self.records = 0

    def add_listener(self, listener: Listener) -> None:
        """Also deliver every later record to ``listener``."""
        self._listeners.append(listener)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one record and return it."""
        record = self._record(event, fields)
        if self._file is not None:
            self._file.write(json.dumps(record, default=_default, ensure_ascii=False) + "\n")
            self._file.flush()
        self.records += 1
        for listener in self._listeners:
            listener(record)
        return record

    def notify(self, event: str, **fields: Any) -> None:
        """Deliver a record to the listeners only (not written, not counted)."""
        if not self._listeners:
            return
        record = self._record(event, fields)
        for listener in self._listeners:
            listener(record)

    def _record(self, event: str, fields: dict[str, Any]) -> dict[str, Any]:
        record: dict[str, Any] = {
            "event": event,
            "session": self.session,
            "t": round(time.monotonic() - self._start, 6),
        }
        record.update(fields)
        return record

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a trace file."""
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                records.append(json.loads(line))
    return records
