"""Section 8b: what the agent loop adds to one tool call over a bare client call.

An :class:`~harnessd.agent.AgentSession` with a scripted model whose every
turn is one ``read_file`` tool call (a 4 KiB file) runs against the shared
execd on loopback, beside the bare client call that tool makes
(``read_file`` with the same arguments) on the same connection, in
interleaved rounds. Two figures per turn come from the session:

* the tool call inside the loop (the turn's ``tools_ms``: from the model's
  reply to the recorded result: the trace records, argument decoding, the
  call, the result's text and the ledger entry) -- what the loop adds to
  one tool call. Target: its p50 within 0.1 ms of the bare call's.
* the whole turn, from one reply of the model to the next request to it:
  the tool call plus the turn's bookkeeping and its ledger sync to execd (a
  round trip of its own, once per turn whatever the number of tool calls).
  Shown beside the bare call, without a target.

The bare call is measured two ways. Back to back, both processes stay hot.
Inside the loop each tool call follows the previous turn's ledger sync, a
durable append (two fdatasyncs in execd) during which both processes sleep;
a call right after such a wait costs more whoever makes it (measured here:
about 0.3 ms back to back against 0.7 to 1.3 ms after a 5 ms sleep or an
append, on two cores of a VM: waking idle CPUs and a cold worker thread).
So the target compares the loop's call with the bare call made the same way,
each one right after a ledger sync of a turn's entries; the back-to-back
figure stays in the table for orientation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from bench.env import Env
from bench.report import Row, SectionRows, Target
from bench.settings import HOST
from bench.stats import Summary, summarize
from harnessd.agent import AgentLimits, AgentSession
from harnessd.api import ExecdClient, connect
from harnessd.ledger_sync import LedgerSync, LocalLedger
from harnessd.models import AssistantTurn, ChatMessage, ModelWrapper, ToolSpec
from harnessd.scripted_model import ScriptedModel
from harnessd.toolbox import ToolConfig

SECTION = "8b. The agent loop around one tool call (loopback, scripted model)"
#: Most the loop may add to one tool call's p50, in ms (issue 12).
LOOP_TARGET_MS = 0.1
#: Rounds of one session and one batch of bare calls, interleaved.
ROUNDS = 3


class _TimedModel(ModelWrapper):
    """A model that notes when each request came and when its reply went back."""

    def __init__(self, inner: ScriptedModel) -> None:
        super().__init__(inner)
        self.asked: list[float] = []
        self.answered: list[float] = []

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        self.asked.append(time.perf_counter())
        reply = await super().complete(messages, tools)
        self.answered.append(time.perf_counter())
        return reply

    def turn_ms(self) -> list[float]:
        """From each reply to the next request: one iteration of the loop, in ms."""
        return [(a - b) * 1000 for b, a in zip(self.answered, self.asked[1:], strict=False)]


async def _session(client: ExecdClient, path: str, turns: int) -> tuple[list[float], list[float]]:
    """One session of ``turns`` one-call turns: the loop's per-turn and per-tool-call ms."""
    call = {"tool_calls": [{"name": "read_file", "arguments": {"path": path}}]}
    model = _TimedModel(ScriptedModel([call] * turns + [{"content": "done"}]))
    session = AgentSession(
        model,
        client,
        tools=ToolConfig(root=os.path.dirname(path)),
        limits=AgentLimits(max_turns=turns + 1),
    )
    result = await session.run("read the file, again and again")
    if result.stop_reason != "finished" or result.tool_errors:
        raise RuntimeError(f"the scripted session failed: {result.stop_reason} {result.error}")
    return model.turn_ms(), [turn.tools_ms for turn in result.turns if turn.results]


async def _bare_after_sync(
    client: ExecdClient, path: str, length: int, name: str, turns: int
) -> list[float]:
    """The bare call, each right after a durable ledger sync as a turn of the loop ends."""
    ledger = LocalLedger()
    sync = LedgerSync(name, ledger)
    text = "x" * 4096
    times: list[float] = []
    for turn in range(turns):
        ledger.append({"kind": "message", "turn": turn, "role": "tool", "content": text})
        await sync.sync(client)
        started = time.perf_counter()
        await client.read_file(path, length=length)
        times.append((time.perf_counter() - started) * 1000)
    return times


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


async def run(env: Env) -> list[Row]:
    """The loop's per-call and per-turn figures beside the bare call."""
    directory = env.path("agent-loop")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "input.txt")
    _write(path, b"x" * 4096)
    turns = env.settings.turns * 10
    client = await connect(HOST, env.execd.port, env.execd.token, keepalive=None)
    bare: list[float] = []
    synced: list[float] = []
    loop_turns: list[float] = []
    loop_calls: list[float] = []
    try:
        cap = ToolConfig().read_cap
        await client.read_file(path, length=cap + 1)
        for round_ in range(ROUNDS):
            synced += await _bare_after_sync(client, path, cap + 1, f"bench-bare-{round_}", turns)
            for _ in range(turns):
                started = time.perf_counter()
                await client.read_file(path, length=cap + 1)
                bare.append((time.perf_counter() - started) * 1000)
            per_turn, per_call = await _session(client, path, turns)
            loop_turns += per_turn
            loop_calls += per_call
    finally:
        await client.close()
    hot, base = summarize(bare), summarize(synced)
    call, turn = summarize(loop_calls), summarize(loop_turns)
    ms = SectionRows(SECTION, "ms")
    hot_row = ms.row(
        "loop.bare_hot",
        "client.read_file of 4 KiB, as the tool calls it, back to back",
        hot,
        short="bare call, back to back",
    )
    bare_row = ms.row(
        "loop.bare",
        "the same bare call, each right after a ledger sync (as inside the loop)",
        base,
        short="bare call",
    )

    def over_bare(key: str, label: str, summary: Summary) -> Row:
        """A row measured against the bare call: its p50 ratio and the ms the loop adds."""
        extra = {"added_ms": summary.p50 - base.p50}
        return ms.row(key, label, summary, baselines=("loop.bare",), extra=extra)

    call_row = over_bare("loop.call", "the read_file tool call inside the agent loop", call)
    call_row.target = Target(
        f"p50 <= bare call + {LOOP_TARGET_MS:g} ms", call.p50 - base.p50, LOOP_TARGET_MS
    )
    turn_row = over_bare(
        "loop.turn", "one turn of the loop with that call (ledger sync included)", turn
    )
    return [hot_row, bare_row, call_row, turn_row]
