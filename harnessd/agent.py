"""The agent loop: model turns, tool calls run in the workspace, the ledger synced every turn.

Theory of operation
-------------------
:meth:`AgentSession.run` drives one session::

    start ── history = [system, user(task)] ──► TURN ─────────────────────────┐
                                                  │ model.complete(history)   │
                                                  │ no tool calls ──► finished│
                                                  │ tool calls: run them all  │
                                                  │ concurrently, bounded by  │
                                                  │ turn_timeout; append the  │
                                                  │ results; sync the ledger ─┘
    stop reasons: finished, max_turns, session_timeout, model_error

Every message and tool result is appended to the session's
:class:`~harnessd.ledger_sync.LocalLedger` as it happens; after each turn
the new entries are synced to execd (:class:`~harnessd.ledger_sync.LedgerSync`).
A lost connection during a sync is repaired with ``reconnect`` (when given)
and the sync resumes from execd's head. When a turn's time runs out, or the
whole run is cancelled or times out, the tool calls still running are
cancelled: each cancels its execd call, and execd kills the command's
process group. Interrupted calls get an error result, so the model can see
what happened; the loop goes on with the next turn.

Nothing here is global: every session has its own history, ledger, toolbox
and trace, so one process can run hundreds of sessions at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from harnessd.api import ExecdClient
from harnessd.errors import ConnectionLost
from harnessd.ledger_sync import LedgerSync, LocalLedger, SyncReport
from harnessd.models import AssistantTurn, ChatMessage, Model, ModelError, ToolCall
from harnessd.tools import Toolbox, ToolConfig, ToolResult
from harnessd.trace import Trace

DEFAULT_SYSTEM_PROMPT = (
    "You are an autonomous software agent working in a Linux workspace through tools. "
    "Use the tools to inspect and change the workspace, run commands and check your work. "
    "When the task is complete, answer with a short summary and no tool call."
)

TRACE_RESULT_CHARS = 2000
"""Characters of each tool result kept in the trace."""

StopReason = Literal["finished", "max_turns", "session_timeout", "model_error"]


@dataclass(frozen=True, slots=True)
class AgentLimits:
    """Bounds of one session.

    ``max_turns``: model turns at most. ``turn_timeout``: seconds one turn's
    tool calls may take together (None: unbounded); the model call has its
    own timeout in the model client. ``session_timeout``: seconds for the
    whole run (None: unbounded). ``final_sync_timeout``: seconds allowed for
    the last ledger sync after the session stopped.
    """

    max_turns: int = 50
    turn_timeout: float | None = 600.0
    session_timeout: float | None = 3600.0
    final_sync_timeout: float = 30.0


@dataclass(slots=True)
class TurnReport:
    """One turn: its tool results, whether its time ran out, its sync figures."""

    index: int
    content: str | None
    results: list[ToolResult]
    interrupted: bool
    model_ms: float
    tools_ms: float
    sync: SyncReport | None = None


@dataclass(slots=True)
class AgentResult:
    """How a session ended, with its full history and per-turn figures."""

    session: str
    stop_reason: StopReason
    final_text: str | None
    turns: list[TurnReport]
    messages: list[ChatMessage]
    ledger_seq: int
    synced_seq: int | None
    error: str | None = None
    syncs: list[SyncReport] = field(default_factory=list)

    @property
    def tool_calls(self) -> int:
        """Tool calls made over the session."""
        return sum(len(turn.results) for turn in self.turns)

    @property
    def tool_errors(self) -> int:
        """Tool calls that ended with an error result."""
        return sum(1 for turn in self.turns for result in turn.results if not result.ok)


def new_session_id() -> str:
    """A fresh session id, valid as a ledger name."""
    return f"agent-{secrets.token_hex(8)}"


ClientSource = ExecdClient | Callable[[], ExecdClient]


class AgentSession:
    """One agent session against one execd.

    ``client``: the execd client, or a callable returning the current one (for
    example ``lambda: session.client`` with a launcher session, whose client
    changes on reconnect). ``reconnect``: called when the connection is found
    closed before a turn's tools, or lost during a ledger sync (at most
    ``sync_attempts - 1`` times per sync); once it returns, ``client`` must
    give the new client (e.g. ``session.reconnect``). ``batch_bytes``: the
    ledger batch budget (default: half the peer's frame cap). ``tool_prefix``:
    prepended to the names of services and shell sessions the tools create,
    for sessions sharing one execd. One instance runs one session, once.
    """

    def __init__(
        self,
        model: Model,
        client: ClientSource,
        *,
        session_id: str | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        limits: AgentLimits | None = None,
        tools: ToolConfig | None = None,
        trace: Trace | None = None,
        reconnect: Callable[[], Awaitable[object]] | None = None,
        batch_bytes: int | None = None,
        sync_attempts: int = 3,
        tool_prefix: str = "",
    ) -> None:
        self.model = model
        self.session_id = session_id or new_session_id()
        self._client_source = client
        self.system_prompt = system_prompt
        self.limits = limits or AgentLimits()
        self.trace = trace if trace is not None else Trace(session=self.session_id)
        if not self.trace.session:
            self.trace.session = self.session_id
        self._reconnect = reconnect
        self.sync_attempts = max(1, sync_attempts)
        self.ledger = LocalLedger()
        self.sync = LedgerSync(self.session_id, self.ledger, batch_bytes=batch_bytes)
        self.toolbox = Toolbox(self.client, tools, session_prefix=tool_prefix)
        self.messages: list[ChatMessage] = []
        self.reports: list[TurnReport] = []
        self.syncs: list[SyncReport] = []

    def client(self) -> ExecdClient:
        """The current execd client."""
        source = self._client_source
        return source if isinstance(source, ExecdClient) else source()

    # -- the loop ------------------------------------------------------------------

    async def run(self, task: str, *, close_tools: bool = True) -> AgentResult:
        """Run the session on ``task`` until it finishes or hits a limit.

        Raises LedgerDiverged when execd's ledger disagrees with ours, and a
        connection error when a sync cannot be completed even after
        ``reconnect``. Model failures end the session with
        ``stop_reason = "model_error"``. With ``close_tools`` the shell
        sessions and services opened by the tools are closed at the end.
        """
        if self.ledger.seq:
            raise RuntimeError("an AgentSession runs once; make a new one for another task")
        limits = self.limits
        self.trace.emit(
            "session_start",
            model=self.model.name,
            task=task,
            max_turns=limits.max_turns,
            turn_timeout=limits.turn_timeout,
            session_timeout=limits.session_timeout,
        )
        self.ledger.append(
            {
                "kind": "session",
                "session": self.session_id,
                "model": self.model.name,
                "started": time.time(),
                "tools": [spec.name for spec in self.toolbox.specs],
            }
        )
        self._add_message(ChatMessage(role="system", content=self.system_prompt), 0)
        self._add_message(ChatMessage(role="user", content=task), 0)
        stop: StopReason = "max_turns"
        final_text: str | None = None
        error: str | None = None
        started = time.perf_counter()
        deadline = asyncio.timeout(limits.session_timeout)
        try:
            try:
                async with deadline:
                    stop, final_text, error = await self._loop()
            except TimeoutError:
                if not deadline.expired():
                    raise
                stop, error = "session_timeout", f"the session ran past {limits.session_timeout} s"
        finally:
            if close_tools:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(10.0):
                        await self.toolbox.close()
        self.ledger.append(
            {"kind": "end", "reason": stop, "turns": len(self.reports), "error": error}
        )
        async with asyncio.timeout(limits.final_sync_timeout):
            final_sync = await self._sync()
        self.trace.emit("sync", turn=None, **final_sync.as_dict())
        result = AgentResult(
            session=self.session_id,
            stop_reason=stop,
            final_text=final_text,
            turns=list(self.reports),
            messages=list(self.messages),
            ledger_seq=self.ledger.seq,
            synced_seq=self.sync.acked,
            error=error,
            syncs=list(self.syncs),
        )
        self.trace.emit(
            "session_end",
            reason=stop,
            turns=len(self.reports),
            tool_calls=result.tool_calls,
            tool_errors=result.tool_errors,
            ledger_seq=self.ledger.seq,
            synced_seq=self.sync.acked,
            error=error,
            final_text=final_text,
            ms=round((time.perf_counter() - started) * 1000.0, 3),
        )
        return result

    async def _loop(self) -> tuple[StopReason, str | None, str | None]:
        specs = self.toolbox.specs
        for index in range(1, self.limits.max_turns + 1):
            model_started = time.perf_counter()
            try:
                reply = await self.model.complete(list(self.messages), specs)
            except ModelError as exc:
                error = f"{type(exc).__name__}: {exc}"
                self.trace.emit("model_error", turn=index, error=error)
                return "model_error", None, error
            model_ms = (time.perf_counter() - model_started) * 1000.0
            self._record_reply(index, reply, model_ms)
            if not reply.tool_calls:
                report = TurnReport(index, reply.content, [], False, model_ms, 0.0)
                self.reports.append(report)
                report.sync = await self._sync_turn(index)
                return "finished", reply.content, None
            await self._ensure_connected()
            tools_started = time.perf_counter()
            results, interrupted = await self._run_tools(index, reply.tool_calls)
            tools_ms = (time.perf_counter() - tools_started) * 1000.0
            for result in results:
                self._add_tool_result(index, result)
            report = TurnReport(index, reply.content, results, interrupted, model_ms, tools_ms)
            self.reports.append(report)
            self.trace.emit(
                "turn_end", turn=index, interrupted=interrupted, tools_ms=round(tools_ms, 3)
            )
            report.sync = await self._sync_turn(index)
        return "max_turns", None, None

    async def _run_tools(self, index: int, calls: list[ToolCall]) -> tuple[list[ToolResult], bool]:
        """Run a turn's calls concurrently; cancel what is still running at the turn's end."""
        tasks = [asyncio.create_task(self.toolbox.call(call)) for call in calls]
        timeout = self.limits.turn_timeout
        started = time.perf_counter()
        try:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
            # Each cancelled call waits (boundedly) for execd to confirm its command stopped.
            await asyncio.wait(tasks)
        results: list[ToolResult] = []
        interrupted = bool(pending)
        for call, task in zip(calls, tasks, strict=True):
            if task in pending or task.cancelled():
                ms = (time.perf_counter() - started) * 1000.0
                text = (
                    f"error: interrupted: the turn's time limit of {timeout} s ran out "
                    "and the call was stopped"
                )
                result = ToolResult(call.id, call.name, text, False, ms, "TurnTimeout", len(text))
            else:
                result = task.result()
            results.append(result)
            self.trace.emit(
                "tool_call",
                turn=index,
                id=call.id,
                name=call.name,
                arguments=call.arguments,
                ms=round(result.ms, 3),
                ok=result.ok,
                error=result.error,
                result=result.text[:TRACE_RESULT_CHARS],
                result_chars=result.full_chars,
            )
        return results, interrupted

    # -- history and ledger ----------------------------------------------------------

    def _add_message(self, message: ChatMessage, turn: int) -> None:
        self.messages.append(message)
        entry: dict[str, Any] = {
            "kind": "message",
            "turn": turn,
            "role": message.role,
            "content": message.content,
        }
        if message.tool_calls:
            entry["tool_calls"] = [
                {"id": call.id, "name": call.name, "arguments": call.arguments}
                for call in message.tool_calls
            ]
        self.ledger.append(entry)

    def _record_reply(self, index: int, reply: AssistantTurn, model_ms: float) -> None:
        self._add_message(reply.as_message(), index)
        self.trace.emit(
            "model_turn",
            turn=index,
            content=reply.content,
            tool_calls=[
                {"id": call.id, "name": call.name, "arguments": call.arguments}
                for call in reply.tool_calls
            ],
            finish_reason=reply.finish_reason,
            usage=reply.usage,
            ms=round(model_ms, 3),
        )

    def _add_tool_result(self, index: int, result: ToolResult) -> None:
        self.messages.append(
            ChatMessage(role="tool", content=result.text, tool_call_id=result.call_id)
        )
        self.ledger.append(
            {
                "kind": "tool_result",
                "turn": index,
                "tool_call_id": result.call_id,
                "name": result.name,
                "ok": result.ok,
                "error": result.error,
                "ms": round(result.ms, 3),
                "content": result.text,
            }
        )

    async def _ensure_connected(self) -> None:
        """Reconnect before a turn's tools when the connection is known to be gone."""
        if self._reconnect is not None and self.client().closed:
            self.trace.emit("reconnect", reason="connection closed before the turn's tools")
            await self._reconnect()
            self.sync.forget_ack()

    async def _sync_turn(self, index: int) -> SyncReport:
        report = await self._sync()
        self.trace.emit("sync", turn=index, **report.as_dict())
        return report

    async def _sync(self) -> SyncReport:
        """Sync the ledger, reconnecting on a lost connection when allowed."""
        attempt = 0
        while True:
            attempt += 1
            try:
                report = await self.sync.sync(self.client())
            except ConnectionLost as exc:
                if self._reconnect is None or attempt >= self.sync_attempts:
                    raise
                self.trace.emit("reconnect", reason=str(exc), attempt=attempt)
                await self._reconnect()
                continue
            self.syncs.append(report)
            return report
