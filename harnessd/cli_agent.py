"""``harnessd demo`` and ``harnessd run``: the agent loop on the command line.

``demo`` runs the scripted end-to-end demo (see :mod:`harnessd.demo`).
``run`` drives a real model (any OpenAI-compatible chat-completions endpoint)
against a workspace: an execd already running (``--port``, token from
``--token-file`` or ``$EXECD_TOKEN``), or a local one launched for the run.
The API key is read from the variable named by ``--api-key-env`` and stays in
this process: a locally launched execd is started without that variable.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Awaitable, Callable

from harnessd.agent import (
    DEFAULT_SYSTEM_PROMPT,
    AgentLimits,
    AgentResult,
    AgentSession,
)
from harnessd.api import ExecdClient, connect
from harnessd.demo import TranscriptPrinter, run_demo
from harnessd.errors import HarnessError
from harnessd.launcher import Session, serve
from harnessd.models import OpenAIChatModel
from harnessd.runtime import LocalRuntime
from harnessd.token import read_token
from harnessd.tools import ToolConfig
from harnessd.trace import Trace


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``demo`` and ``run`` on the harnessd command line."""
    demo = sub.add_parser(
        "demo", help="run a scripted agent session end to end against a local execd"
    )
    demo.add_argument("--trace", help="write the session's JSONL trace to this file")
    demo.add_argument("--encrypt", action="store_true", help="encrypt every frame")
    demo.set_defaults(func=demo_main)

    run = sub.add_parser("run", help="run a model (OpenAI-compatible API) against a workspace")
    run.add_argument("--model", required=True, help="model name sent to the endpoint")
    run.add_argument("--base-url", required=True, help="e.g. https://api.openai.com/v1")
    run.add_argument("--api-key-env", help="NAME of the environment variable holding the API key")
    run.add_argument("--task", required=True, help="what the agent should do")
    run.add_argument("--max-turns", type=int, default=30)
    run.add_argument("--turn-timeout", type=float, default=600.0, help="seconds per turn's tools")
    run.add_argument("--session-timeout", type=float, default=3600.0)
    run.add_argument("--output-cap", type=int, default=16_000, help="characters per tool result")
    run.add_argument("--system-prompt", default=DEFAULT_SYSTEM_PROMPT)
    run.add_argument("--trace", help="write the session's JSONL trace to this file")
    run.add_argument(
        "--workspace",
        help="workspace directory the tools work in (default: a new temporary directory "
        "for a local execd, execd's working directory for a running one)",
    )
    run.add_argument("--host", default="127.0.0.1", help="host of a running execd")
    run.add_argument("--port", type=int, help="port of a running execd (else launch one)")
    run.add_argument("--token-file", help="token of the running execd (else $EXECD_TOKEN)")
    run.add_argument("--encrypt", action="store_true", help="encrypt every frame")
    run.set_defaults(func=run_main)


def _run_async(main: Callable[[], Awaitable[int]], prog: str) -> int:
    import uvloop

    async def wrapped() -> int:
        return await main()

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(wrapped())
    except HarnessError as exc:
        print(f"harnessd {prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"harnessd {prog}: interrupted", file=sys.stderr)
        return 130


def demo_main(args: argparse.Namespace) -> int:
    """Entry of ``harnessd demo``."""
    return _run_async(lambda: run_demo(trace_path=args.trace, encrypt=bool(args.encrypt)), "demo")


def run_main(args: argparse.Namespace) -> int:
    """Entry of ``harnessd run``."""
    if args.max_turns < 1:
        print("harnessd run: --max-turns must be at least 1", file=sys.stderr)
        return 2
    return _run_async(lambda: run_agent(args), "run")


async def run_agent(args: argparse.Namespace) -> int:
    """Launch or connect, run the session, report, clean up; return the exit status."""
    model = OpenAIChatModel(args.model, args.base_url, args.api_key_env)
    secret_vars = [args.api_key_env] if args.api_key_env else []
    session: Session | None = None
    if args.port is not None:
        client = await connect(
            args.host, args.port, read_token(args.token_file), encrypt=bool(args.encrypt)
        )
        workspace = args.workspace

        def current() -> ExecdClient:
            return client

        reconnect = None
    else:
        workspace = args.workspace or tempfile.mkdtemp(prefix="harnessd-run-")
        # The runtime drops the key's variable (and anything credential-like)
        # from execd's environment, so no command in the workspace sees it.
        session = await serve(LocalRuntime(scrub=secret_vars), encrypt=bool(args.encrypt))
        print(f"execd up at {session.host}:{session.port} (marker {session.marker})")
        launched = session

        def current() -> ExecdClient:
            return launched.client

        reconnect = launched.reconnect
    if workspace:
        print(f"workspace: {workspace}")
    trace = Trace(args.trace, listeners=[TranscriptPrinter(sys.stdout)])
    result: AgentResult | None = None
    try:
        agent = AgentSession(
            model,
            current,
            system_prompt=args.system_prompt,
            limits=AgentLimits(
                max_turns=args.max_turns,
                turn_timeout=args.turn_timeout,
                session_timeout=args.session_timeout,
            ),
            tools=ToolConfig(root=workspace, output_cap=args.output_cap),
            trace=trace,
            reconnect=reconnect,
        )
        print(f"ledger session: {agent.session_id}")
        result = await agent.run(args.task)
        if result.final_text:
            print(f"\nfinal answer:\n{result.final_text}")
        if result.error:
            print(f"stopped: {result.error}")
    finally:
        if session is not None:
            closed = await session.close()
            trace.emit("cleanup", killed=closed.killed, left=closed.leftover)
            print(f"cleanup: {closed.killed} processes killed, {closed.leftover} processes left")
        else:
            await current().close()
        trace.close()
    return 0 if result is not None and result.stop_reason == "finished" else 1
