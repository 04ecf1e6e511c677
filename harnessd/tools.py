"""The standard tools: shell commands, files, services, persistent shells, path waits.

Each is declared as :mod:`harnessd.toolbox` describes (an argument Struct and
a handler, registered on :data:`CORE_TOOLS`); :data:`TOOLS` joins them with
the terminal tools (:mod:`harnessd.tools_terminal`), and :data:`TOOL_SPECS`
is what the model is offered. The persistent shell sessions and services a
toolbox's tools open are remembered per toolbox and closed when it closes.

With the toolbox's ``on_output``, the shell tool streams its command's
output as it arrives (to that callback) and keeps a bounded head and tail of
each stream for the result, as execd does in collected mode.

Cancellation: a tool call's task, when cancelled (turn timeout, session
timeout, caller cancel), cancels its execd call; execd then kills the
command's process group. The shell tool also waits (up to
``cancel_grace``) for execd to confirm the cancelled command is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Final, Literal

import msgspec

from harnessd.errors import HarnessError, SessionBusy
from harnessd.models import ToolSpec
from harnessd.tool_text import (
    HeadTail,
    ToolFailed,
    format_run,
    format_service,
    format_session_run,
    plain_text,
)
from harnessd.toolbox import (
    Args,
    CallContext,
    Command,
    Name,
    PathArg,
    Port,
    Seconds,
    Toolbox,
    ToolSet,
    WorkDir,
    about,
)
from harnessd.tools_terminal import TERMINAL_TOOLS
from protocol.rpc import services, sessions, shell

MAX_CONTENT: Final = 16 * 1024 * 1024
"""Longest text one write_file call carries."""

DEFAULT_LOG_LINES: Final = 100
"""Log lines service_logs returns unless the model asks for another number."""


class ShellArgs(Args):
    """Run a shell command (/bin/sh -c) in the workspace and return its exit status, stdout and
    stderr. Each call is a fresh shell; use session_run to keep state."""

    command: Command
    cwd: WorkDir | None = None
    timeout: Annotated[Seconds, about("seconds before it is killed")] | None = None


class ReadFileArgs(Args):
    """Read a text file from the workspace."""

    path: PathArg
    offset: Annotated[int, msgspec.Meta(ge=0, le=2**62), about("byte offset to start at")] = 0
    max_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**40), about("most bytes to read")] | None = (
        None
    )


class WriteFileArgs(Args):
    """Write (or append to) a text file in the workspace, creating parents."""

    path: PathArg
    content: Annotated[str, msgspec.Meta(max_length=MAX_CONTENT), about("the text to write")]
    append: Annotated[bool, about("append instead of replacing")] = False


class ListFilesArgs(Args):
    """List a directory of the workspace (type, size, path)."""

    path: PathArg = "."
    recursive: Annotated[bool, about("descend into subdirectories")] = False


class ProbeArgs(Args):
    """How to know the service is ready."""

    type: Annotated[
        Literal["tcp", "log", "command"],
        about(
            "tcp: a port accepts connections; log: a log line matches; "
            "command: a check command exits 0"
        ),
    ]
    port: Annotated[Port, about("tcp: the port")] | None = None
    host: (
        Annotated[
            str,
            msgspec.Meta(min_length=1, max_length=255),
            about("tcp: the host (default 127.0.0.1)"),
        ]
        | None
    ) = None
    pattern: (
        Annotated[
            str, msgspec.Meta(min_length=1, max_length=4096), about("log: a regular expression")
        ]
        | None
    ) = None
    command: Annotated[Command, about("command: the check command line")] | None = None
    timeout: Annotated[Seconds, about("seconds to wait for readiness")] | None = None


class StartServiceArgs(Args):
    """Start a long-running background service (a server, a watcher) under a name, optionally
    waiting until a readiness probe succeeds."""

    name: Annotated[Name, about("service name ([A-Za-z0-9_.-])")]
    command: Command
    cwd: WorkDir | None = None
    probe: ProbeArgs | None = None


class ServiceLogsArgs(Args):
    """The recent output of a service started with start_service."""

    name: Annotated[Name, about("service name")]
    lines: (
        Annotated[int, msgspec.Meta(ge=1, le=100_000), about("how many last lines (default 100)")]
        | None
    ) = None


class StopServiceArgs(Args):
    """Stop a service started with start_service."""

    name: Annotated[Name, about("service name")]


class WaitForPathArgs(Args):
    """Wait until a path exists (or is absent, a file, a dir, nonempty)."""

    path: PathArg
    condition: Annotated[
        Literal["exists", "absent", "file", "dir", "nonempty"], about("what to wait for")
    ] = "exists"
    timeout: Annotated[Seconds, about("seconds to wait (default 30)")] = 30.0


class SessionRunArgs(Args):
    """Run a command in a persistent shell session (opened on first use): the working directory,
    exported variables and shell state persist between calls."""

    session: Annotated[Name, about("session name ([A-Za-z0-9_.-])")]
    command: Command
    timeout: Annotated[Seconds, about("seconds before it is interrupted")] | None = None


# -- the handlers ----------------------------------------------------------------------------

CORE_TOOLS: Final = ToolSet()
"""The tools of this module, in the order they are offered."""


@dataclass
class _Opened:
    """What one toolbox's tools opened in execd, to close with it (names as execd knows them)."""

    sessions: set[str] = field(default_factory=set)
    services: set[str] = field(default_factory=set)
    interrupted: set[str] = field(default_factory=set)
    """Sessions whose command a cancelled turn interrupted (it may still be winding down)."""


@CORE_TOOLS.tool("shell", ShellArgs)
async def _shell(box: Toolbox, args: ShellArgs, context: CallContext) -> str:
    cap = box.exec_cap()
    if context.output is not None:
        return await _shell_streaming(box, args, cap, context.output)
    params = shell.RunParams(
        command=args.command,
        cwd=box.cwd(args.cwd),
        timeout=box.timeout(args.timeout),
        output_cap=cap,
        limits=box.config.limits,
    )
    handle = box.client().start(shell.RUN, params)
    try:
        result = await handle.result()
    except asyncio.CancelledError:
        # handle.result() already asked execd to cancel; wait for its word that it did.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(box.config.cancel_grace):
                await handle.result()
        raise
    return format_run(result, cap)


async def _shell_streaming(
    box: Toolbox, args: ShellArgs, cap: int, output: Callable[[str, bytes], None]
) -> str:
    """The shell tool with live output: each chunk to ``output``, a bounded copy kept."""
    running = box.client().run_streaming(
        command=args.command,
        cwd=box.cwd(args.cwd),
        timeout=box.timeout(args.timeout),
        limits=box.config.limits,
    )
    kept = {shell.STDOUT_STREAM: HeadTail(cap), shell.STDERR_STREAM: HeadTail(cap)}
    try:
        async for stream, data in running.output():
            kept[stream].add(data)
            output(stream, data)
        result = await running.result()
    except asyncio.CancelledError:
        running.cancel()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(box.config.cancel_grace):
                await running.result()
        raise
    stdout, stdout_dropped = kept[shell.STDOUT_STREAM].value()
    stderr, stderr_dropped = kept[shell.STDERR_STREAM].value()
    collected = msgspec.structs.replace(
        result,
        stdout=stdout,
        stderr=stderr,
        stdout_dropped=stdout_dropped,
        stderr_dropped=stderr_dropped,
    )
    return format_run(collected, cap)


@CORE_TOOLS.tool("read_file", ReadFileArgs)
async def _read_file(box: Toolbox, args: ReadFileArgs, context: CallContext) -> str:
    cap = min(args.max_bytes or box.config.read_cap, box.config.read_cap)
    data = await box.client().read_file(box.path(args.path), offset=args.offset, length=cap + 1)
    more = len(data) > cap
    text = plain_text(data[:cap])
    if more:
        text += f"\n[... file continues past byte {args.offset + cap}; read with offset ...]"
    return text


@CORE_TOOLS.tool("write_file", WriteFileArgs)
async def _write_file(box: Toolbox, args: WriteFileArgs, context: CallContext) -> str:
    data = args.content.encode()
    path = box.path(args.path)
    await box.client().write_file(path, data, create_parents=True, append=args.append)
    verb = "appended" if args.append else "wrote"
    return f"{verb} {len(data)} bytes to {path}"


@CORE_TOOLS.tool("list_files", ListFilesArgs)
async def _list_files(box: Toolbox, args: ListFilesArgs, context: CallContext) -> str:
    path = box.path(args.path)
    listing = await box.client().list_dir(
        path, recursive=args.recursive, limit=box.config.list_limit
    )
    lines = []
    for entry in listing.entries:
        suffix = "/" if entry.type == "dir" else ""
        size = "" if entry.type == "dir" else f" {entry.size}"
        lines.append(f"{entry.type[0]} {entry.path}{suffix}{size}")
    if listing.truncated:
        lines.append(f"[... listing truncated at {len(listing.entries)} entries ...]")
    if not lines:
        lines.append(f"({path} is empty)")
    return "\n".join(lines)


@CORE_TOOLS.tool("wait_for_path", WaitForPathArgs)
async def _wait_for_path(box: Toolbox, args: WaitForPathArgs, context: CallContext) -> str:
    path = box.path(args.path)
    result = await box.client().wait_for_path(
        path, condition=args.condition, timeout=min(args.timeout, box.config.max_timeout)
    )
    return f"{path}: {args.condition} after {result.waited:.3f} s"


@CORE_TOOLS.tool("start_service", StartServiceArgs)
async def _start_service(box: Toolbox, args: StartServiceArgs, context: CallContext) -> str:
    opened = box.state(_Opened)
    name = box.scoped_name(args.name)
    probe = _probe(args.probe, box.config.probe_timeout) if args.probe else None
    info = await box.client().start_service(
        name,
        command=args.command,
        cwd=box.cwd(args.cwd),
        probe=probe,
        limits=box.config.limits,
    )
    opened.services.add(name)
    return format_service(info)


@CORE_TOOLS.tool("service_logs", ServiceLogsArgs)
async def _service_logs(box: Toolbox, args: ServiceLogsArgs, context: CallContext) -> str:
    logs = await box.client().service_logs(
        box.scoped_name(args.name),
        lines=args.lines if args.lines is not None else DEFAULT_LOG_LINES,
        nbytes=min(box.config.read_cap, services.MAX_LOG_READ),
    )
    head = f"log bytes {logs.start}..{logs.end} of {logs.size}"
    return f"{head}\n{plain_text(logs.data)}" if logs.data else f"{head} (empty)"


@CORE_TOOLS.tool("stop_service", StopServiceArgs)
async def _stop_service(box: Toolbox, args: StopServiceArgs, context: CallContext) -> str:
    opened = box.state(_Opened)
    name = box.scoped_name(args.name)
    info = await box.client().stop_service(name)
    opened.services.discard(name)
    return format_service(info)


@CORE_TOOLS.tool("session_run", SessionRunArgs)
async def _session_run(box: Toolbox, args: SessionRunArgs, context: CallContext) -> str:
    opened = box.state(_Opened)
    client = box.client()
    name = box.scoped_name(args.session)
    if name not in opened.sessions:
        await client.open_session(name, cwd=box.config.root, limits=box.config.limits)
        opened.sessions.add(name)
    cap = box.exec_cap()
    params = sessions.RunParams(
        name=name, command=args.command, timeout=box.timeout(args.timeout), output_cap=cap
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + box.config.cancel_grace
    while True:
        try:
            result = await client.call(sessions.RUN, params)
        except SessionBusy:
            # A command interrupted by an earlier turn may still be winding down.
            if name not in opened.interrupted or loop.time() >= deadline:
                raise
            await asyncio.sleep(0.05)
            continue
        except asyncio.CancelledError:
            # execd interrupts the command (SIGINT, then SIGKILL after its grace).
            opened.interrupted.add(name)
            raise
        break
    opened.interrupted.discard(name)
    if result.session_ended:
        opened.sessions.discard(name)
    return format_session_run(result, cap)


@CORE_TOOLS.closer
async def _close_opened(box: Toolbox) -> None:
    """Close the persistent shell sessions and stop the services the toolbox's tools started."""
    opened = box.state(_Opened)
    client = box.client()
    for name in sorted(opened.sessions):
        with contextlib.suppress(HarnessError):
            await client.close_session_shell(name)
    opened.sessions.clear()
    for name in sorted(opened.services):
        with contextlib.suppress(HarnessError):
            await client.stop_service(name)
    opened.services.clear()


def _probe(args: ProbeArgs, default_timeout: float) -> services.Probe:
    timeout = args.timeout if args.timeout is not None else default_timeout
    if args.type == "tcp":
        if args.port is None:
            raise ToolFailed("a tcp probe needs a port")
        return services.TcpProbe(port=args.port, host=args.host or "127.0.0.1", timeout=timeout)
    if args.type == "log":
        if args.pattern is None:
            raise ToolFailed("a log probe needs a pattern")
        return services.LogProbe(pattern=args.pattern, timeout=timeout)
    if args.command is None:
        raise ToolFailed("a command probe needs a command")
    return services.CommandProbe(command=args.command, timeout=timeout)


TOOLS: Final = ToolSet(CORE_TOOLS, TERMINAL_TOOLS)
"""The standard tools, in the order they are offered: these, then the terminal tools."""

TOOL_SPECS: Final[tuple[ToolSpec, ...]] = TOOLS.specs
"""What the model is offered, in order."""
