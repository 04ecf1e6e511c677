"""``harnessd demo`` and ``harnessd run``: the agent loop on the command line.

``demo`` runs the scripted end-to-end demo (see :mod:`harnessd.demo`).
``run`` drives a real model (any OpenAI-compatible chat-completions endpoint)
against a workspace: an execd already running (``--port``, token from
``--token-file`` or ``$EXECD_TOKEN``), or a local one launched for the run.
The API key is read from the variable named by ``--api-key-env`` and stays in
this process: a locally launched execd is started without that variable.

stdout is the transcript (each turn, each tool result, the final answer);
stderr is live progress (:mod:`harnessd.progress`: tool calls starting and
ending, command output as it arrives, model waits and retries) and errors,
so ``harnessd run ... > transcript.txt`` still shows what is happening.
``--quiet`` turns the progress off.

Everything that can be checked is checked before execd starts (the trace
file, the workspace directory, the token, the model's configuration); once
execd runs, every way out -- success, an error, SIGINT, SIGTERM, SIGHUP --
closes the session first (see :func:`harnessd.cli_common.run_session`); the
trace then holds ``session_end`` followed by ``cleanup``, and a ``signal``
record naming the signal that stopped the run.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from harnessd.agent import AgentLimits, AgentResult, AgentSession
from harnessd.api import ExecdClient, connect
from harnessd.cli_common import USAGE, UsageError, run_session, say
from harnessd.demo import TranscriptPrinter, demo_model, run_demo
from harnessd.errors import RemoteError
from harnessd.launcher import DEFAULT_LEASE, Session, serve
from harnessd.leftovers import Hold
from harnessd.models import ModelConfigError
from harnessd.openai_model import (
    DEFAULT_MAX_RETRY_WAIT,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    OpenAIChatModel,
)
from harnessd.progress import Progress
from harnessd.runtime import LocalRuntime
from harnessd.scripted_model import ScriptedModel
from harnessd.toolbox import ToolConfig
from harnessd.trace import Listener, Trace
from protocol.values import (
    count,
    non_negative,
    port_number,
    positive_int,
    positive_seconds,
    read_token,
)

_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``demo`` and ``run`` on the harnessd command line."""
    demo = sub.add_parser(
        "demo", help="run a scripted agent session end to end against a local execd"
    )
    demo.add_argument("--trace", help="write the session's JSONL trace to this file")
    demo.add_argument("--encrypt", action="store_true", help="encrypt every frame")
    demo.add_argument(
        "--script",
        help="run this scripted task (JSON: {task, turns: [{content, tool_calls}]}) "
        "instead of the built-in one; {{python}} and {{port}} are filled in",
    )
    _add_lease(demo, "execd")
    demo.set_defaults(func=demo_main)

    run = sub.add_parser("run", help="run a model (OpenAI-compatible API) against a workspace")
    run.add_argument("--model", required=True, help="model name sent to the endpoint")
    run.add_argument("--base-url", required=True, help="e.g. https://api.openai.com/v1")
    run.add_argument("--api-key-env", help="NAME of the environment variable holding the API key")
    run.add_argument("--task", required=True, help="what the agent should do")
    run.add_argument("--max-turns", type=positive_int, default=30)
    run.add_argument(
        "--turn-timeout", type=positive_seconds, default=600.0, help="seconds per turn's tools"
    )
    run.add_argument("--session-timeout", type=positive_seconds, default=3600.0)
    run.add_argument(
        "--output-cap", type=positive_int, default=16_000, help="characters per tool result"
    )
    run.add_argument(
        "--system-prompt",
        help="the system message (default: one describing the workspace, the tools and how "
        "one turn's tool calls run)",
    )
    run.add_argument(
        "--in-order",
        action="store_true",
        help="run one turn's tool calls one after another, in the order given (default: all "
        "at once, so a write and a read of the same file in one turn race); the model is then "
        "asked for one call per turn (parallel_tool_calls: false)",
    )
    run.add_argument(
        "--model-timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT,
        help=f"seconds one model request may take (default {DEFAULT_TIMEOUT:g})",
    )
    run.add_argument(
        "--retries",
        type=count,
        default=DEFAULT_RETRIES,
        help="times a failed model request (timeout, 408, 409, 425, 429, 5xx) is tried again "
        f"(default {DEFAULT_RETRIES})",
    )
    run.add_argument(
        "--max-retry-wait",
        type=non_negative,
        default=DEFAULT_MAX_RETRY_WAIT,
        help="longest wait, in seconds, before a retry when the endpoint's Retry-After asks "
        f"for more (default {DEFAULT_MAX_RETRY_WAIT:g})",
    )
    run.add_argument("--temperature", type=non_negative, help="sampling temperature to send")
    run.add_argument("--max-tokens", type=positive_int, help="max_tokens to send")
    run.add_argument(
        "--quiet",
        action="store_true",
        help="no live progress on stderr (the transcript on stdout stays)",
    )
    run.add_argument("--trace", help="write the session's JSONL trace to this file")
    run.add_argument(
        "--workspace",
        help="workspace directory the tools work in (default: a new temporary directory "
        "for a local execd, removed at the end; execd's working directory for a running one)",
    )
    run.add_argument("--host", default="127.0.0.1", help="host of a running execd")
    run.add_argument("--port", type=port_number, help="port of a running execd (else launch one)")
    run.add_argument("--token-file", help="token of the running execd (else $EXECD_TOKEN)")
    run.add_argument("--encrypt", action="store_true", help="encrypt every frame")
    _add_lease(run, "a launched execd")
    run.set_defaults(func=run_main)


def _add_lease(parser: argparse.ArgumentParser, launched: str) -> None:
    parser.add_argument(
        "--lease",
        type=positive_seconds,
        default=DEFAULT_LEASE,
        help=f"{launched} cleans up and exits after this many seconds without hearing from "
        f"this process (default {DEFAULT_LEASE:g})",
    )


def open_trace(path: str | None, listeners: Sequence[Listener]) -> Trace:
    """The session's trace, or UsageError naming the file when it cannot be written."""
    try:
        return Trace(path, listeners=list(listeners))
    except OSError as exc:
        raise UsageError(f"cannot write the trace file {path}: {exc.strerror or exc}") from None


def demo_main(args: argparse.Namespace) -> int:
    """Entry of ``harnessd demo``: check the script and the trace file, then run the demo."""
    try:
        model = _demo_model(args.script)
        trace = open_trace(args.trace, ())
    except UsageError as exc:
        say(f"harnessd demo: {exc}")
        return USAGE

    async def main() -> int:
        return await run_demo(
            trace=trace, encrypt=bool(args.encrypt), lease=args.lease, model=model
        )

    return run_session(main, "harnessd demo")


def _demo_model(script: str | None) -> ScriptedModel:
    if script is None:
        return demo_model()
    try:
        with open(script, "rb") as handle:
            text = handle.read()
    except OSError as exc:
        raise UsageError(f"cannot read the script {script}: {exc.strerror or exc}") from None
    try:
        return demo_model(text)
    except ModelConfigError as exc:
        raise UsageError(f"{script}: {exc}") from None


def run_main(args: argparse.Namespace) -> int:
    """Entry of ``harnessd run``: check everything checkable, then run the session."""
    try:
        ready = _prepare(args)
    except UsageError as exc:
        say(f"harnessd run: {exc}")
        return USAGE

    def record(signum: int) -> None:
        ready.trace.emit("signal", name=signal.Signals(signum).name)

    return run_session(lambda: run_agent(args, ready), "harnessd run", on_signal=record)


@dataclass(frozen=True, slots=True)
class _Ready:
    """What ``run`` checked and opened before anything was started."""

    model: OpenAIChatModel
    token: bytes | None
    trace: Trace
    progress: Progress | None


def _prepare(args: argparse.Namespace) -> _Ready:
    model = _model(args)
    token = _token(args.token_file) if args.port is not None else None
    if token is None and args.workspace is not None:
        if not os.path.isdir(args.workspace):
            raise UsageError(f"the workspace {args.workspace} is not a directory")
        # execd runs in it, so a relative path would name another directory there.
        args.workspace = os.path.abspath(args.workspace)
    progress = None if args.quiet else Progress(sys.stderr)
    # Progress first: it erases its status line before the transcript prints.
    listeners: list[Listener] = [] if progress is None else [progress]
    listeners.append(TranscriptPrinter(sys.stdout))
    trace = open_trace(args.trace, listeners)
    return _Ready(model, token, trace, progress)


def _model(args: argparse.Namespace) -> OpenAIChatModel:
    name: str | None = args.api_key_env
    # The value is never repeated back: it may be the key itself, pasted by mistake.
    if name is not None and not _VARIABLE_NAME.fullmatch(name):
        raise UsageError(
            "--api-key-env takes the NAME of an environment variable, and the value given "
            "is not a variable name (not shown, in case it is the key itself)"
        )
    if name is not None and not os.environ.get(name, "").strip():
        raise UsageError(
            "the environment variable named by --api-key-env is unset or empty "
            "(its name is not shown, in case it is the key itself)"
        )
    try:
        return OpenAIChatModel(
            args.model,
            args.base_url,
            name,
            timeout=args.model_timeout,
            max_retries=args.retries,
            max_retry_wait=args.max_retry_wait,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
        )
    except ModelConfigError as exc:
        raise UsageError(str(exc)) from None


async def run_agent(args: argparse.Namespace, ready: _Ready) -> int:
    """Launch or connect, run the session, report, clean up; return the exit status."""
    execd: _Execd | None = None
    finished = False
    try:
        execd = await _open_execd(args, ready.token)
        if execd.workspace and execd.scratch is None:
            print(f"workspace: {execd.workspace}")
        agent = AgentSession(
            ready.model,
            execd.current,
            system_prompt=args.system_prompt,
            limits=AgentLimits(
                max_turns=args.max_turns,
                turn_timeout=args.turn_timeout,
                session_timeout=args.session_timeout,
            ),
            tools=ToolConfig(root=execd.workspace, output_cap=args.output_cap),
            trace=ready.trace,
            reconnect=execd.reconnect,
            tool_order="in_order" if args.in_order else "concurrent",
            live_output=ready.progress is not None,
        )
        print(f"ledger session: {agent.session_id}")
        result: AgentResult = await agent.run(args.task)
        if result.final_text:
            print(f"\nfinal answer:\n{result.final_text}")
        if result.error:
            print(f"stopped: {result.error}")
        finished = result.stop_reason == "finished"
        return 0 if finished else 1
    finally:
        if ready.progress is not None:
            ready.progress.close()
        await ready.model.aclose()
        if execd is not None:
            await execd.close(ready.trace)
        ready.trace.close()


@dataclass(frozen=True, slots=True)
class _Execd:
    """The execd a run works through: one it launched (``session``) or one it connected to."""

    current: Callable[[], ExecdClient]
    workspace: str | None
    session: Session | None = None
    reconnect: Callable[[], Awaitable[object]] | None = None
    scratch: Hold | None = None
    """The workspace made for the run (removed at the end), when none was given."""

    async def close(self, trace: Trace) -> None:
        """Close the connection; a launched execd is cleaned up and stopped, and says how it went.

        execd's log (its own directory under /tmp) stays only when its close was not
        clean: how the model's part ended is in the transcript, not in that log.
        """
        session = self.session
        if session is None:
            await self.current().close()
            return
        try:
            closed = await session.close()
            trace.emit("cleanup", killed=closed.killed, left=closed.leftover)
            print(f"cleanup: {closed.killed} processes killed, {closed.leftover} processes left")
            if closed.log_kept:
                print(f"execd's log kept: {session.log_path}")
        finally:
            if self.scratch is not None:
                self.scratch.remove()


async def _open_execd(args: argparse.Namespace, token: bytes | None) -> _Execd:
    """Connect to the execd at ``--port`` (with a token), else launch one here."""
    if token is not None:
        client = await connect(args.host, args.port, token, encrypt=bool(args.encrypt))
        workspace = args.workspace
        if workspace is not None:
            try:
                await _check_remote_workspace(client, workspace, f"{args.host}:{args.port}")
            except BaseException:
                await client.close()
                raise
        return _Execd(lambda: client, workspace)
    scratch = _new_workspace() if args.workspace is None else None
    workspace = scratch.path if scratch is not None else args.workspace
    # The runtime drops the key's variable (and anything credential-like)
    # from execd's environment, so no command in the workspace sees it.
    scrub = [args.api_key_env] if args.api_key_env else []
    try:
        session = await serve(
            LocalRuntime(scrub=scrub), encrypt=bool(args.encrypt), lease=args.lease, cwd=workspace
        )
    except BaseException:
        if scratch is not None:
            scratch.remove()
        raise
    print(f"execd up at {session.host}:{session.port} (marker {session.marker})")
    print(f"execd's log: {session.log_path} (kept only if execd fails)")
    if scratch is not None:
        print(f"workspace: {workspace} (new, removed at the end; --workspace DIR keeps files)")
    return _Execd(lambda: session.client, workspace, session, session.reconnect, scratch)


def _new_workspace() -> Hold:
    try:
        return Hold("harnessd-run-")
    except OSError as exc:
        raise UsageError(f"cannot make a workspace in the temporary directory: {exc}") from None


def _token(path: str | None) -> bytes:
    try:
        return read_token(path, os.environ)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


async def _check_remote_workspace(client: ExecdClient, path: str, where: str) -> None:
    try:
        kind = (await client.stat(path)).type
    except RemoteError as exc:
        raise UsageError(f"the workspace {path} on execd at {where}: {exc}") from None
    if kind != "dir":
        raise UsageError(f"the workspace {path} on execd at {where} is not a directory")
