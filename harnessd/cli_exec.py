"""``harnessd exec``: run one command in the workspace, like ``docker exec``.

Output streams live to this process's stdout and stderr; with ``-i`` this
process's stdin is forwarded; SIGINT, SIGTERM and SIGHUP received here are
forwarded to the remote command's process group; the exit status is the
command's (128+N when a signal N killed it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

from harnessd.api import RunningCommand, connect
from harnessd.errors import HarnessError
from harnessd.token import read_token

STDIN_BLOCK = 64 * 1024


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``exec`` on the harnessd command line."""
    parser = sub.add_parser("exec", help="run one command in the workspace and stream its output")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-file", help="file holding the token (else $EXECD_TOKEN)")
    parser.add_argument("-i", "--interactive", action="store_true", help="forward stdin")
    parser.add_argument("--cwd", help="working directory in the workspace")
    parser.add_argument("--timeout", type=float, help="hard timeout in seconds")
    parser.add_argument("--encrypt", action="store_true", help="encrypt every frame")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- ARGV...")
    parser.set_defaults(func=main)


def exit_status(exit_code: int | None, signum: int | None) -> int:
    """The shell convention: the exit code, or 128+N after signal N."""
    if signum is not None:
        return 128 + signum
    return exit_code if exit_code is not None else 1


async def _pump_stdin(command: RunningCommand) -> None:
    while True:
        data = await asyncio.to_thread(os.read, sys.stdin.fileno(), STDIN_BLOCK)
        if not data:
            await command.close_stdin()
            return
        await command.write_stdin(data)


async def run_exec(args: argparse.Namespace) -> int:
    """Connect, run, stream, and return the exit status."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print(
            "harnessd exec: no command given (use: harnessd exec ... -- ARGV...)", file=sys.stderr
        )
        return 2
    token = read_token(args.token_file)
    client = await connect(args.host, args.port, token, encrypt=bool(args.encrypt))
    loop = asyncio.get_running_loop()
    try:
        command = client.run_streaming(
            argv, cwd=args.cwd, timeout=args.timeout, stdin_stream=bool(args.interactive)
        )

        forwarding: set[asyncio.Task[None]] = set()

        def forward(signum: int) -> None:
            task = loop.create_task(_forward_signal(command, signum))
            forwarding.add(task)
            task.add_done_callback(forwarding.discard)

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(signum, forward, signum)
        stdin_task = loop.create_task(_pump_stdin(command)) if args.interactive else None
        out = sys.stdout.buffer
        err = sys.stderr.buffer
        async for name, data in command.output():
            target = out if name == "stdout" else err
            target.write(data)
            target.flush()
        result = await command.result()
        if stdin_task is not None:
            stdin_task.cancel()
        if result.timed_out:
            print("harnessd exec: command timed out", file=sys.stderr)
        return exit_status(result.exit_code, result.signal)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        await client.close()


async def _forward_signal(command: RunningCommand, signum: int) -> None:
    with contextlib.suppress(HarnessError):
        await command.signal(signum)


def main(args: argparse.Namespace) -> int:
    """Entry of ``harnessd exec``."""
    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(run_exec(args))
    except HarnessError as exc:
        print(f"harnessd exec: {exc}", file=sys.stderr)
        return 255
    except ValueError as exc:
        print(f"harnessd exec: {exc}", file=sys.stderr)
        return 2
