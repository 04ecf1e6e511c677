"""The agent loop: model turns, tool calls run in the workspace, the ledger synced every turn.

Theory of operation
-------------------
:meth:`AgentSession.run` drives one session::

    start ── history = [system, user(task)] ──► TURN ─────────────────────────┐
                                                  │ model.complete(history)   │
                                                  │ no tool calls ──► finished│
                                                  │ tool calls: run them      │
                                                  │ (concurrently, or in      │
                                                  │ order), bounded by        │
                                                  │ turn_timeout; append the  │
                                                  │ results; sync the ledger ─┘
    stop reasons: finished, max_turns, session_timeout, model_error, interrupted

Tool calls of one turn run concurrently by default: an 8-call turn costs
about one round trip to execd instead of eight. They are then not ordered:
a ``write_file`` and a ``cat`` of the same file in one turn race. The
model is told so -- the default system prompt says it and the request says
``parallel_tool_calls: true`` -- and ``tool_order="in_order"`` runs one
turn's calls one after another in the order given (the request then says
``parallel_tool_calls: false``, asking for one call per turn).

Every message and tool result is appended to the session's
:class:`~harnessd.ledger_sync.LocalLedger` as it happens; after each turn
the new entries are synced to execd (:class:`~harnessd.ledger_sync.LedgerSync`).
A lost connection during a sync is repaired with ``reconnect`` (when given)
and the sync resumes from execd's head. When a turn's time runs out, or the
whole run is cancelled or times out, the tool calls still running are
cancelled: each cancels its execd call, and execd kills the command's
process group. Interrupted calls get an error result, so the model can see
what happened; the loop goes on with the next turn. A cancelled run (the
command line cancels it on SIGINT, SIGTERM and SIGHUP) still closes its
tools, records the end in the ledger, tries a last bounded sync and writes
``session_end`` with reason ``interrupted`` before the cancellation goes on.

The trace gets ``model_start`` before each model call, ``model_retry`` and
``model_adapted`` as the model client reports them, ``tool_start`` and
``tool_call`` around each call (``tool_call`` as each one ends), and, with
``live_output``, ``tool_output`` notifications carrying command output as
it arrives (delivered to listeners, never written to the file).

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
from harnessd.models import (
    AssistantTurn,
    CallInfo,
    ChatMessage,
    Model,
    ModelError,
    ToolCall,
    calling,
)
from harnessd.toolbox import Toolbox, ToolConfig, ToolResult, ToolSet
from harnessd.tools import TOOLS
from harnessd.trace import Trace

ToolOrder = Literal["concurrent", "in_order"]
"""How the tool calls of one turn run: all at once, or one after another as given."""

_PROMPT = (
    "You are an autonomous software agent working in a Linux workspace through tools. "
    "Use the tools to inspect and change the workspace, run commands and check your work. "
    "When the task is complete, answer with a short summary and no tool call."
)
_ORDER_NOTE: dict[ToolOrder, str] = {
    "concurrent": (
        " Tool calls made in one reply run at the same time, in no set order: when one call "
        "needs another's effect (write a file, then run it), make it in a later reply."
    ),
    "in_order": " Tool calls made in one reply run one after another, in the order given.",
}


def default_system_prompt(tool_order: ToolOrder = "concurrent") -> str:
    """The system prompt used when none is given; it says how tool calls run."""
    return _PROMPT + _ORDER_NOTE[tool_order]


DEFAULT_SYSTEM_PROMPT = default_system_prompt()

TRACE_RESULT_CHARS = 2000
"""Characters of each tool result kept in the trace."""

StopReason = Literal["finished", "max_turns", "session_timeout", "model_error", "interrupted"]
"""Why a session stopped (``interrupted``: its run was cancelled; only the trace says so)."""


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


@dataclass(slots=True)
class _Ending:
    """How a run is ending, filled in as it winds down."""

    stop: StopReason = "max_turns"
    final_text: str | None = None
    error: str | None = None
    cancelled: bool = False


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
    for sessions sharing one execd. ``tools``: the tools' knobs;
    ``toolset``: the tools offered (default :data:`harnessd.tools.TOOLS`;
    ``ToolSet(TOOLS, mine)`` adds tools of your own, see
    :mod:`harnessd.toolbox`). ``system_prompt``: None for
    :func:`default_system_prompt`. ``tool_order``: how one turn's tool calls
    run (see the module docstring). ``live_output``: stream shell output to
    the trace's listeners as ``tool_output`` notifications. One instance
    runs one session, once.
    """

    def __init__(
        self,
        model: Model,
        client: ClientSource,
        *,
        session_id: str | None = None,
        system_prompt: str | None = None,
        limits: AgentLimits | None = None,
        tools: ToolConfig | None = None,
        toolset: ToolSet | None = None,
        trace: Trace | None = None,
        reconnect: Callable[[], Awaitable[object]] | None = None,
        batch_bytes: int | None = None,
        sync_attempts: int = 3,
        tool_prefix: str = "",
        tool_order: ToolOrder = "concurrent",
        live_output: bool = False,
    ) -> None:
        if tool_order not in _ORDER_NOTE:
            raise ValueError(f"tool_order must be 'concurrent' or 'in_order', not {tool_order!r}")
        self.model = model
        self.session_id = session_id or new_session_id()
        self._client_source = client
        self.tool_order: ToolOrder = tool_order
        self.system_prompt = (
            system_prompt if system_prompt is not None else default_system_prompt(tool_order)
        )
        self.limits = limits or AgentLimits()
        self.trace = trace if trace is not None else Trace(session=self.session_id)
        if not self.trace.session:
            self.trace.session = self.session_id
        self._reconnect = reconnect
        self.sync_attempts = max(1, sync_attempts)
        self.ledger = LocalLedger()
        self.sync = LedgerSync(self.session_id, self.ledger, batch_bytes=batch_bytes)
        self.toolbox = Toolbox(
            self.client,
            tools,
            toolset=toolset if toolset is not None else TOOLS,
            session_prefix=tool_prefix,
            on_output=self._live_output if live_output else None,
        )
        self._turn = 0
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
        Cancelled, it winds down as the module docstring says and raises
        CancelledError. The trace's last record is ``session_end`` however
        the run ends.
        """
        if self.ledger.seq:
            raise RuntimeError("an AgentSession runs once; make a new one for another task")
        self._begin(task)
        ending = _Ending()
        result: AgentResult | None = None
        started = time.perf_counter()
        try:
            await self._run_turns(ending, close_tools)
            await self._record_end(ending)
            result = AgentResult(
                session=self.session_id,
                stop_reason=ending.stop,
                final_text=ending.final_text,
                turns=list(self.reports),
                messages=list(self.messages),
                ledger_seq=self.ledger.seq,
                synced_seq=self.sync.acked,
                error=ending.error,
                syncs=list(self.syncs),
            )
        except BaseException as exc:
            if ending.error is None:
                ending.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._emit_end(ending, result is not None, started)
        if ending.cancelled:
            raise asyncio.CancelledError
        return result

    def _begin(self, task: str) -> None:
        """The session announced, its first ledger entry, and the prompt and task as messages."""
        limits = self.limits
        self.trace.emit(
            "session_start",
            model=self.model.name,
            task=task,
            max_turns=limits.max_turns,
            turn_timeout=limits.turn_timeout,
            session_timeout=limits.session_timeout,
            tool_order=self.tool_order,
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

    async def _run_turns(self, ending: _Ending, close_tools: bool) -> None:
        """The turns within the session's deadline, then (``close_tools``) the tools closed.

        How they ended goes into ``ending``; a cancel is recorded there, not raised.
        """
        limit = self.limits.session_timeout
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                ending.stop, ending.final_text, ending.error = await self._loop()
        except TimeoutError:
            if not deadline.expired():
                raise
            ending.stop, ending.error = "session_timeout", f"the session ran past {limit} s"
        except asyncio.CancelledError:
            ending.cancelled = True
            ending.stop, ending.error = "interrupted", "the run was cancelled"
        finally:
            if close_tools:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(10.0):
                        await self.toolbox.close()

    async def _record_end(self, ending: _Ending) -> None:
        """The end in the ledger, and the ledger synced; after a cancel, execd may be gone."""
        self.ledger.append(
            {
                "kind": "end",
                "reason": ending.stop,
                "turns": len(self.reports),
                "error": ending.error,
            }
        )
        try:
            async with asyncio.timeout(self.limits.final_sync_timeout):
                final_sync = await self._sync()
        except Exception as exc:
            if not ending.cancelled:
                raise
            # Winding down after a cancel: the end is recorded locally even if execd is gone.
            self.trace.emit("sync_error", turn=None, error=f"{type(exc).__name__}: {exc}")
        else:
            self.trace.emit("sync", turn=None, **final_sync.as_dict())

    def _emit_end(self, ending: _Ending, completed: bool, started: float) -> None:
        """The trace's last record: how the session ended (``completed``: with a result)."""
        self.trace.emit(
            "session_end",
            reason=ending.stop if completed else "error",
            turns=len(self.reports),
            tool_calls=sum(len(turn.results) for turn in self.reports),
            tool_errors=sum(1 for t in self.reports for r in t.results if not r.ok),
            ledger_seq=self.ledger.seq,
            synced_seq=self.sync.acked,
            error=ending.error,
            final_text=ending.final_text,
            ms=round((time.perf_counter() - started) * 1000.0, 3),
        )

    async def _loop(self) -> tuple[StopReason, str | None, str | None]:
        specs = self.toolbox.specs
        for index in range(1, self.limits.max_turns + 1):
            self._turn = index
            self.trace.emit("model_start", turn=index, messages=len(self.messages))
            model_started = time.perf_counter()
            info = CallInfo(
                turn=index,
                parallel_tool_calls=self.tool_order == "concurrent",
                report=self._model_report(index),
            )
            try:
                with calling(info):
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
            if self.tool_order == "in_order":
                results, interrupted = await self._run_in_order(index, reply.tool_calls)
            else:
                results, interrupted = await self._run_concurrently(index, reply.tool_calls)
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

    def _model_report(self, index: int) -> Callable[[str, dict[str, Any]], None]:
        def report(event: str, fields: dict[str, Any]) -> None:
            self.trace.emit(event, turn=index, **fields)

        return report

    def _live_output(self, call: ToolCall, stream: str, data: bytes) -> None:
        self.trace.notify(
            "tool_output", turn=self._turn, id=call.id, name=call.name, stream=stream, data=data
        )

    async def _call_tool(self, index: int, call: ToolCall) -> ToolResult:
        """One call, announced when it starts and recorded when it ends."""
        self.trace.emit(
            "tool_start", turn=index, id=call.id, name=call.name, arguments=call.arguments
        )
        result = await self.toolbox.call(call)
        self._record_tool_call(index, call, result)
        return result

    async def _run_concurrently(
        self, index: int, calls: list[ToolCall]
    ) -> tuple[list[ToolResult], bool]:
        """Run a turn's calls concurrently; cancel what is still running at the turn's end."""
        if len(calls) == 1:
            # One call runs alike either way: spare it a task and two waits (event loop rounds).
            return await self._run_in_order(index, calls)
        tasks = [asyncio.create_task(self._call_tool(index, call)) for call in calls]
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
        for call, task in zip(calls, tasks, strict=True):
            if task in pending or task.cancelled():
                result = self._cut_short(call, started, ran=True)
                self._record_tool_call(index, call, result)
            else:
                result = task.result()
            results.append(result)
        return results, bool(pending)

    async def _run_in_order(
        self, index: int, calls: list[ToolCall]
    ) -> tuple[list[ToolResult], bool]:
        """Run a turn's calls one after another; those the turn's time does not reach are not run."""
        results: list[ToolResult] = []
        started = time.perf_counter()
        deadline = asyncio.timeout(self.limits.turn_timeout)
        try:
            async with deadline:
                for call in calls:
                    results.append(await self._call_tool(index, call))
        except TimeoutError:
            if not deadline.expired():
                raise
        interrupted = len(results) < len(calls)
        for number, call in enumerate(calls[len(results) :]):
            result = self._cut_short(call, started, ran=number == 0)
            self._record_tool_call(index, call, result)
            results.append(result)
        return results, interrupted

    def _cut_short(self, call: ToolCall, started: float, *, ran: bool) -> ToolResult:
        """The result of a call the turn's time limit stopped (``ran``) or never reached."""
        timeout = self.limits.turn_timeout
        ms = (time.perf_counter() - started) * 1000.0 if ran else 0.0
        if ran:
            text = (
                f"error: interrupted: the turn's time limit of {timeout} s ran out "
                "and the call was stopped"
            )
        else:
            text = (
                f"error: not run: the turn's time limit of {timeout} s ran out before "
                "this call's turn came"
            )
        return ToolResult(call.id, call.name, text, False, ms, "TurnTimeout", len(text))

    def _record_tool_call(self, index: int, call: ToolCall, result: ToolResult) -> None:
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
