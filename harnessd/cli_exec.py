"""``harnessd exec``: run one command in the workspace, like ``docker exec``.

Output streams live to this process's stdout and stderr; with ``-i`` this
process's stdin is forwarded, and ``exec`` still returns as soon as the
command ends, whether stdin is a file, a terminal or a pipe that never sends.
The first SIGINT, SIGTERM or SIGHUP received here is forwarded to the remote
command's process group; a second one closes the connection (execd then kills
the command) and ends ``exec`` with 128+N. Exit status: the command's (128+N
when signal N ended it); 127 when the command does not exist, 126 when it
cannot be started (not executable, its working directory missing or not
accessible, or a limit asked for cannot be enforced there); 141 quietly when
stdout is closed under it (``| head``), as coreutils die of SIGPIPE; 2 for
usage errors (a limit out of range or above execd's own); 255 when execd
cannot be reached or the connection fails, as ssh does.

``-e NAME=VALUE`` (or ``-e NAME``: this process's value) sets a variable
for the command, on top of execd's environment; the token's variable cannot
be passed on.

``--limit-memory BYTES``, ``--limit-cpu SECONDS``, ``--limit-processes N``,
``--limit-file-size BYTES`` and ``--limit-open-files N`` (execd's own
option names) bound the command and everything it starts; when it ran into
one, a line on stderr names it. A memory limit that execd can only enforce
as an rlimit (no memory cgroup: an allocation past it merely fails) cannot
be told apart from other failures; a command that fails under one gets a
line saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import signal
import sys
from typing import Any

import msgspec

from harnessd.api import ExecdClient, RunningCommand, connect
from harnessd.cli_common import STOP_SIGNALS, USAGE, UsageError, say, silence_stdout
from harnessd.errors import HarnessError, InvalidParams, NotSupported, SpawnFailed
from harnessd.tool_text import memory_note
from protocol.rpc.resources import LIMIT_NAMES, Limits
from protocol.rpc.shell import RunResult
from protocol.values import (
    LIMIT_OPTIONS,
    TOKEN_VAR,
    from_options,
    option_name,
    port_number,
    positive_seconds,
    read_token,
)

STDIN_BLOCK = 64 * 1024
PROG = "harnessd exec"
NOT_FOUND = 127
"""Exit status when the command does not exist (the shell's)."""
CANNOT_INVOKE = 126
"""Exit status when the command exists but cannot be started, or its directory is unusable."""
CONNECTION_FAILED = 255
"""Exit status when execd cannot be reached or the connection breaks (ssh's)."""
CLOSED_STDOUT = 128 + signal.SIGPIPE


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``exec`` on the harnessd command line."""
    parser = sub.add_parser(
        "exec",
        help="run one command in the workspace and stream its output",
        description=(
            "Run ARGV in the workspace of the execd at HOST:PORT, streaming its output. Exit "
            "status: the command's (128+N after signal N), 127 command not found, 126 command "
            "or working directory unusable, 141 stdout closed, 2 usage error, 255 connection "
            "failure."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, required=True, help="1-65535")
    parser.add_argument("--token-file", help="file holding the token (else $EXECD_TOKEN)")
    parser.add_argument("-i", "--interactive", action="store_true", help="forward stdin")
    parser.add_argument(
        "-t",
        "--tty",
        action="store_true",
        help="run the command on a terminal when stdin is one (raw mode here, like ssh -t)",
    )
    parser.add_argument("--cwd", help="working directory in the workspace")
    parser.add_argument(
        "-e",
        "--env",
        action="append",
        type=env_entry,
        default=[],
        metavar="NAME=VALUE",
        help="set a variable for the command (repeatable); -e NAME passes its value here",
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        help="kill the command after this many seconds (more than 0; omit for no timeout)",
    )
    parser.add_argument("--encrypt", action="store_true", help="encrypt every frame")
    limit = parser.add_argument_group(
        "limits", "resource limits of the command (execd's own defaults may be lowered, not raised)"
    )
    for name, kind, unit in LIMIT_OPTIONS:
        limit.add_argument(option_name(name), type=kind, metavar=unit)
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- ARGV...")
    parser.set_defaults(func=main)


def env_entry(text: str) -> tuple[str, str]:
    """argparse type of ``-e``: ``NAME=VALUE``, or ``NAME`` for this process's value of it."""
    name, equals, value = text.partition("=")
    if not name or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    if name == TOKEN_VAR:
        raise argparse.ArgumentTypeError(f"{name} holds the token and is never passed on")
    if not equals:
        if name not in os.environ:
            raise argparse.ArgumentTypeError(f"{name} is not set here (give -e {name}=VALUE)")
        value = os.environ[name]
    return name, value


def exit_status(exit_code: int | None, signum: int | None) -> int:
    """The shell convention: the exit code, or 128+N after signal N."""
    if signum is not None:
        return 128 + signum
    return exit_code if exit_code is not None else 1


def spawn_status(exc: SpawnFailed) -> int:
    """127 for a command that does not exist, else 126 (found but not startable)."""
    data: Any = exc.data
    what = data.get("what") if isinstance(data, dict) else None
    code = data.get("errno") if isinstance(data, dict) else None
    if what == "command" and code == errno.errorcode[errno.ENOENT]:
        return NOT_FOUND
    return CANNOT_INVOKE


def refused(exc: InvalidParams | NotSupported) -> int:
    """Say why execd refused the command; 2 for what was asked (a limit above execd's), else 126.

    ``NotSupported``: a limit execd cannot enforce where it runs.
    """
    say(f"{PROG}: {exc}")
    return USAGE if isinstance(exc, InvalidParams) else CANNOT_INVOKE


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _pump_stdin(command: RunningCommand[Any]) -> None:
    """Forward this process's stdin until EOF, without a thread that could outlive the command.

    A terminal or pipe is read only after the event loop reports it readable,
    so cancelling the pump (the command ended) never waits for input. Files
    and devices the loop cannot poll never block, and are read directly.
    """
    fd = sys.stdin.fileno() if sys.stdin is not None else -1
    if fd < 0:
        await command.close_stdin()
        return
    pollable = True
    while True:
        if pollable:
            try:
                await _readable(fd)
            except (OSError, ValueError):
                pollable = False
        try:
            data = os.read(fd, STDIN_BLOCK)
        except OSError:
            data = b""
        if not data:
            await command.close_stdin()
            return
        await command.write_stdin(data)


async def run_exec(args: argparse.Namespace) -> int:
    """Connect, run, stream, and return the exit status."""
    try:
        argv, limits, token = _request(args)
    except UsageError as exc:
        say(f"{PROG}: {exc}")
        return USAGE
    env = dict(args.env) or None
    where = f"{args.host}:{args.port}"
    try:
        client = await connect(args.host, args.port, token, encrypt=bool(args.encrypt))
    except HarnessError as exc:
        text = str(exc)
        say(f"{PROG}: {text}" if where in text else f"{PROG}: {where}: {text}")
        return CONNECTION_FAILED
    try:
        if args.tty and sys.stdin is not None and os.isatty(sys.stdin.fileno()):
            from harnessd.cli_tty import run_terminal

            try:
                return await run_terminal(client, argv, args.cwd, limits, env)
            except (InvalidParams, NotSupported) as exc:
                return refused(exc)
        return await _run_streaming(client, args, argv, limits, env)
    finally:
        await client.close()


def _request(args: argparse.Namespace) -> tuple[list[str], Limits | None, bytes]:
    """What to run, its limits and the token, from the command line; UsageError says what is wrong."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError(f"no command given (use: {PROG} ... -- ARGV...)")
    try:
        limits = from_options({name: getattr(args, f"limit_{name}") for name in LIMIT_NAMES})
    except msgspec.ValidationError as exc:
        raise UsageError(f"invalid limit: {exc} (see {PROG} --help)") from None
    try:
        token = read_token(args.token_file, os.environ)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return argv, limits, token


async def _run_streaming(
    client: ExecdClient,
    args: argparse.Namespace,
    argv: list[str],
    limits: Limits | None,
    env: dict[str, str] | None,
) -> int:
    """The command run with its output streamed here, stdin forwarded (``-i``), signals passed on.

    The first signal goes to the command; a second one cancels it and ends
    ``exec`` with 128+N.
    """
    loop = asyncio.get_running_loop()
    stdin_task: asyncio.Task[None] | None = None
    forwarding: set[asyncio.Task[None]] = set()
    received: list[int] = []
    try:
        command = client.run_streaming(
            argv,
            cwd=args.cwd,
            env=env,
            timeout=args.timeout,
            stdin_stream=bool(args.interactive),
            limits=limits,
        )
        memory = limits.memory if limits is not None else None
        streaming = loop.create_task(_stream(command, memory))

        def on_signal(signum: int) -> None:
            received.append(signum)
            if len(received) > 1:
                command.cancel()  # execd stops it (closing alone would leave it its grace)
                streaming.cancel()
                return
            task = loop.create_task(_forward_signal(command, signum))
            forwarding.add(task)
            task.add_done_callback(forwarding.discard)

        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, on_signal, signum)
        if args.interactive:
            stdin_task = loop.create_task(_pump_stdin(command))
        try:
            return await streaming
        except asyncio.CancelledError:
            if not streaming.cancelled():
                raise
        name = signal.Signals(received[-1]).name
        say(f"{PROG}: {name} received twice, closing the connection (execd stops the command)")
        return 128 + received[-1]
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
        if stdin_task is not None:
            stdin_task.cancel()
            await asyncio.wait([stdin_task])
            if not stdin_task.cancelled():
                stdin_task.exception()  # retrieved: a send after the command ended may fail


async def _stream(command: RunningCommand[RunResult], memory: int | None) -> int:
    out = sys.stdout.buffer
    err = sys.stderr.buffer
    try:
        async for name, data in command.output():
            target = out if name == "stdout" else err
            target.write(data)
            target.flush()
    except BrokenPipeError:
        # Like coreutils under `| head`: stop quietly. Closing the connection
        # (the caller does) makes execd stop the command.
        command.cancel()
        silence_stdout()
        return CLOSED_STDOUT
    try:
        result = await command.result()
    except SpawnFailed as exc:
        say(f"{PROG}: {exc}")
        return spawn_status(exc)
    except (InvalidParams, NotSupported) as exc:
        return refused(exc)
    if result.timed_out:
        say(f"{PROG}: command timed out")
    if result.limit_exceeded is not None:
        say(f"{PROG}: the command ran into its {result.limit_exceeded} limit")
    note = memory_note(result, memory)
    if note is not None:
        say(f"{PROG}: {note}")
    return exit_status(result.exit_code, result.signal)


async def _forward_signal(command: RunningCommand[Any], signum: int) -> None:
    with contextlib.suppress(HarnessError):
        await command.signal(signum)


def main(args: argparse.Namespace) -> int:
    """Entry of ``harnessd exec``."""
    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(run_exec(args))
    except HarnessError as exc:
        say(f"{PROG}: {exc}")
        return CONNECTION_FAILED
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
