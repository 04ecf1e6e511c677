"""The MCP server's session ledger: every tool call and its result, kept in execd.

It opens with a ``session_start`` entry (synced before the server serves,
so the ledger exists from the start). Each call adds two entries (``tool_call`` with the arguments, ``tool_result``
with the outcome and the text returned, cut to :data:`RESULT_CHARS`) to a
:class:`~harnessd.ledger_sync.LocalLedger`; a background task syncs new
entries to execd's ledger store (:class:`~harnessd.ledger_sync.LedgerSync`)
after each call, so a tool result never waits for the ledger's disk sync.
Syncs are serialized and coalesced: calls that finish while one is running
are sent together by the next. A failed sync (connection lost, execd
restarting) is retried after the next call, and once more at :meth:`Journal.close`.

The ledger lives in memory too until the server ends, so it is bounded:
after :data:`MAX_ENTRIES` entries one ``journal_full`` entry is written and
later calls are not recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import Any

from harnessd.api import ExecdClient
from harnessd.errors import HarnessError
from harnessd.ledger_sync import LedgerSync, LocalLedger

log = logging.getLogger("harnessd.mcp")

RESULT_CHARS = 4096
"""Characters of a tool result kept in the ledger."""

ARGUMENT_CHARS = 16 * 1024
"""Characters of a call's JSON arguments kept in the ledger."""

MAX_ENTRIES = 20_000
"""Entries recorded before the journal stops growing."""

CLOSE_SYNC_TIMEOUT = 10.0
"""Seconds the last sync at close may take."""


def new_journal_name() -> str:
    """A fresh ledger session name for one MCP server."""
    return f"mcp-{secrets.token_hex(8)}"


class Journal:
    """Records tool calls into a ledger and keeps execd's copy up to date."""

    def __init__(self, client: Callable[[], ExecdClient], name: str | None = None) -> None:
        self.name = name or new_journal_name()
        self._client = client
        self._ledger = LocalLedger()
        self._sync = LedgerSync(self.name, self._ledger)
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._syncing = asyncio.Lock()
        self._full = False

    @property
    def seq(self) -> int:
        """Entries recorded so far."""
        return self._ledger.seq

    def record(self, entry: dict[str, Any]) -> None:
        """Add one entry and ask for a sync (never blocks)."""
        if self._full:
            return
        if self._ledger.seq >= MAX_ENTRIES - 1:
            self._full = True
            entry = {"kind": "journal_full", "entries": MAX_ENTRIES}
        self._ledger.append(entry)
        self._wanted.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def call(self, call_id: str, name: str, arguments: str) -> None:
        """Record a tool call."""
        self.record(
            {
                "kind": "tool_call",
                "id": call_id,
                "name": name,
                "arguments": arguments[:ARGUMENT_CHARS],
            }
        )

    def result(self, call_id: str, name: str, *, ok: bool, error: str | None, text: str) -> None:
        """Record a tool call's outcome."""
        self.record(
            {
                "kind": "tool_result",
                "id": call_id,
                "name": name,
                "ok": ok,
                "error": error,
                "content": text[:RESULT_CHARS],
                "content_chars": len(text),
            }
        )

    async def _run(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            await self._sync_once()

    async def flush(self) -> bool:
        """Sync now; True when execd holds every entry recorded so far."""
        return await self._sync_once()

    async def _sync_once(self) -> bool:
        try:
            async with self._syncing:
                await self._sync.sync(self._client())
        except (HarnessError, OSError) as exc:
            self._sync.forget_ack()
            log.warning("ledger %s: sync failed (%s); retried after the next call", self.name, exc)
            return False
        return True

    async def close(self) -> bool:
        """Stop the background task and sync what is left; True when execd has it all."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self._sync.forget_ack()  # a sync cut short may have lost an answer
        if self._ledger.seq == 0:
            return True
        try:
            async with asyncio.timeout(CLOSE_SYNC_TIMEOUT):
                return await self._sync_once()
        except TimeoutError:
            return False
