"""``harnessd demo``: one scripted agent session end to end, on this machine.

Launches a local execd in a fresh temporary workspace, runs the scripted task
shipped in ``harnessd/demo/task.json`` (shell, files, concurrent calls, a
path wait, an HTTP service with a readiness probe, a persistent shell
session, the ledger synced every turn), prints a transcript with each tool
call's round-trip time, reads the ledger back and verifies it, closes the
session and reports how many processes were left. The workspace is removed
at the end; execd's log stays (its path printed) only when the session's
close was not clean. Exit status 0 when everything worked.
"""

from __future__ import annotations

import shlex
import socket
import sys
from pathlib import Path
from typing import Any, TextIO

from harnessd.agent import AgentLimits, AgentResult, AgentSession
from harnessd.launcher import DEFAULT_LEASE, CloseResult, serve
from harnessd.leftovers import Hold
from harnessd.runtime import LocalRuntime
from harnessd.scripted_model import ScriptedModel
from harnessd.toolbox import ToolConfig
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


def demo_model(script: str | bytes | None = None) -> ScriptedModel:
    """The demo's scripted model: the built-in task, or ``script`` (JSON, see ScriptedModel).

    ``{{python}}`` becomes this interpreter (quoted for a shell) and
    ``{{port}}`` a TCP port that was free a moment ago. Raises
    ModelConfigError for a script that does not parse.
    """
    variables = {"python": shlex.quote(sys.executable), "port": free_port()}
    if script is None:
        return ScriptedModel.from_resource(SCRIPT_PACKAGE, SCRIPT_RESOURCE, variables=variables)
    return ScriptedModel.from_json(script, variables=variables)


async def run_demo(
    *,
    trace: Trace | None = None,
    encrypt: bool = False,
    out: TextIO | None = None,
    lease: float | None = DEFAULT_LEASE,
    model: ScriptedModel | None = None,
) -> int:
    """Run the demo; return the exit status (0: every step worked and nothing was left).

    ``trace`` (default: none kept) gets every record and is closed at the end;
    the transcript goes to ``out`` (default stdout). ``lease`` is execd's (see
    :func:`~harnessd.launcher.serve`); ``model`` defaults to :func:`demo_model`.
    However the demo ends -- also cancelled, as the command line does on
    SIGINT, SIGTERM and SIGHUP -- the session is closed and the workspace
    removed before this returns or raises.
    """
    stream = out if out is not None else sys.stdout
    scripted = model if model is not None else demo_model()
    records = trace if trace is not None else Trace()
    records.add_listener(TranscriptPrinter(stream))
    scratch = Hold("harnessd-demo-")
    try:
        root = Path(scratch.path) / "work"
        root.mkdir()
        print(f"workspace: {scratch.path} (removed at the end)", file=stream, flush=True)
        session = await serve(LocalRuntime(), cwd=str(root), encrypt=encrypt, lease=lease)
        print(
            f"execd up at {session.host}:{session.port} (pid {session.pid}, "
            f"cipher {session.client.cipher}, marker {session.marker})",
            file=stream,
            flush=True,
        )
        result: AgentResult | None = None
        verified = -1
        failure: str | None = None
        try:
            agent = AgentSession(
                scripted,
                lambda: session.client,
                reconnect=session.reconnect,
                tools=ToolConfig(root=str(root)),
                trace=records,
                limits=AgentLimits(max_turns=30, turn_timeout=120.0, session_timeout=300.0),
            )
            result = await agent.run(scripted.task or "run the demo", close_tools=False)
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
            # Runs when cancelled too: the cleanup report is printed, then the
            # cancellation goes on.
            closed = await session.close()
            records.emit(
                "cleanup",
                killed=closed.killed,
                left=closed.leftover,
                remaining=list(closed.remaining),
                fallback_ran=closed.fallback_ran,
                worker_exited=closed.worker_exited,
            )
            _report_cleanup(closed, stream)
            if closed.log_kept:
                print(f"execd's log kept: {session.log_path}", file=stream)
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
        records.close()
        scratch.remove()


def _report_cleanup(closed: CloseResult, out: TextIO) -> None:
    print(
        f"cleanup: execd closed its services and shells and stopped, "
        f"{closed.killed} stray processes killed by marker, {closed.leftover} processes left",
        file=out,
    )
    if closed.remaining:
        print(f"cleanup: still alive: {list(closed.remaining)}", file=out)
