"""``harnessd demo``: one scripted agent session end to end, on this machine.

Launches a local execd in a fresh temporary workspace, runs the scripted task
shipped in ``harnessd/demo/task.json`` (shell, files, concurrent calls, a
path wait, an HTTP service with a readiness probe, a persistent shell
session, the ledger synced every turn), prints a transcript with each tool
call's round-trip time, reads the ledger back and verifies it, closes the
session and reports how many processes were left. The workspace is removed
at the end. Exit status 0 when everything worked.
"""

from __future__ import annotations

import shlex
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from harnessd.agent import AgentLimits, AgentResult, AgentSession
from harnessd.launcher import CloseResult, serve
from harnessd.models import ScriptedModel
from harnessd.runtime import LocalRuntime
from harnessd.tools import ToolConfig
from harnessd.trace import Trace

SCRIPT_PACKAGE = "harnessd"
SCRIPT_RESOURCE = "demo/task.json"
RESULT_LINES = 8


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class TranscriptPrinter:
    """Prints trace records as a readable transcript."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def __call__(self, record: dict[str, Any]) -> None:
        event = record["event"]
        handler = getattr(self, f"_{event}", None)
        if handler is not None:
            handler(record)
            self.out.flush()

    def _line(self, text: str) -> None:
        print(text, file=self.out)

    def _session_start(self, record: dict[str, Any]) -> None:
        self._line(f"session {record['session']} with model {record['model']}")
        self._line(f"task: {record['task']}")

    def _model_turn(self, record: dict[str, Any]) -> None:
        self._line("")
        self._line(f"[turn {record['turn']}] assistant: {record.get('content') or ''}")
        for call in record["tool_calls"]:
            self._line(f"  -> {call['name']} {call['arguments']}")

    def _tool_call(self, record: dict[str, Any]) -> None:
        status = "ok" if record["ok"] else f"failed ({record.get('error')})"
        self._line(f"  <- {record['name']} [{record['id']}] {record['ms']:.1f} ms, {status}")
        lines = str(record["result"]).splitlines() or [""]
        for line in lines[:RESULT_LINES]:
            self._line(f"     | {line}")
        if len(lines) > RESULT_LINES:
            self._line(f"     | ... ({len(lines) - RESULT_LINES} more lines)")

    def _sync(self, record: dict[str, Any]) -> None:
        label = "ledger sync" if record.get("turn") is not None else "final ledger sync"
        self._line(
            f"  {label}: {record['entries']} entries, {record['bytes']} bytes, "
            f"{record['batches']} batch(es), {record['ms']:.1f} ms, execd head {record['head']}"
        )

    def _model_error(self, record: dict[str, Any]) -> None:
        self._line(f"  model error: {record['error']}")

    def _session_end(self, record: dict[str, Any]) -> None:
        self._line("")
        self._line(
            f"session ended: {record['reason']} after {record['turns']} turns, "
            f"{record['tool_calls']} tool calls ({record['tool_errors']} failed), "
            f"{record['ms'] / 1000.0:.2f} s"
        )


async def run_demo(
    *, trace_path: str | None = None, encrypt: bool = False, out: TextIO | None = None
) -> int:
    """Run the demo; return the exit status (0: every step worked and nothing was left)."""
    stream = out if out is not None else sys.stdout
    workspace = Path(tempfile.mkdtemp(prefix="harnessd-demo-"))
    trace: Trace | None = None
    try:
        root = workspace / "work"
        root.mkdir()
        model = ScriptedModel.from_resource(
            SCRIPT_PACKAGE,
            SCRIPT_RESOURCE,
            variables={"python": shlex.quote(sys.executable), "port": free_port()},
        )
        trace = Trace(trace_path, listeners=[TranscriptPrinter(stream)])
        print(f"workspace: {workspace} (removed at the end)", file=stream)
        session = await serve(
            LocalRuntime(),
            workdir=str(workspace / "execd"),
            extra_args=("--state-dir", str(workspace / "state")),
            encrypt=encrypt,
            lease=300.0,
        )
        print(
            f"execd up at {session.host}:{session.port} (pid {session.pid}, "
            f"cipher {session.client.cipher}, marker {session.marker})",
            file=stream,
        )
        result: AgentResult | None = None
        verified = -1
        failure: str | None = None
        try:
            agent = AgentSession(
                model,
                lambda: session.client,
                reconnect=session.reconnect,
                tools=ToolConfig(root=str(root)),
                trace=trace,
                limits=AgentLimits(max_turns=30, turn_timeout=120.0, session_timeout=300.0),
            )
            result = await agent.run(model.task or "run the demo", close_tools=False)
            verified = await agent.sync.verify_remote(session.client)
            print(
                f"ledger: {verified} entries read back from execd, hash chain and payloads "
                f"verified against the local ledger (head {agent.ledger.head_hash.hex()[:16]}...)",
                file=stream,
            )
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
            print(f"demo failed: {failure}", file=stream)
        finally:
            closed = await session.close()
        trace.emit(
            "cleanup",
            killed=closed.killed,
            left=closed.leftover,
            remaining=list(closed.remaining),
            fallback_ran=closed.fallback_ran,
            worker_exited=closed.worker_exited,
        )
        _report_cleanup(closed, stream)
        ok = (
            failure is None
            and result is not None
            and result.stop_reason == "finished"
            and result.tool_errors == 0
            and verified == result.ledger_seq
            and closed.clean
        )
        print("demo " + ("succeeded" if ok else "FAILED"), file=stream)
        return 0 if ok else 1
    finally:
        if trace is not None:
            trace.close()
        shutil.rmtree(workspace, ignore_errors=True)


def _report_cleanup(closed: CloseResult, out: TextIO) -> None:
    print(
        f"cleanup: execd closed its services and shells and stopped, "
        f"{closed.killed} stray processes killed by marker, {closed.leftover} processes left",
        file=out,
    )
    if closed.remaining:
        print(f"cleanup: still alive: {list(closed.remaining)}", file=out)
