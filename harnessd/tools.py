"""The tools offered to the model, and their dispatch onto execd.

Each tool is declared once: an argument Struct whose docstring is the
tool's description and whose fields (types, bounds, ``about(...)``
descriptions) are its parameters, and a handler registered with
``@tool(name, Struct)``. The JSON schema the model sees
(:data:`TOOL_SPECS`) is generated from the Struct (:func:`parameters_schema`),
and the same Struct decodes the model's arguments, so what the model is
told and what is accepted cannot drift apart. A handler calls execd
through the session's current :class:`~harnessd.api.ExecdClient` and
returns text for the model; a failure becomes text too
(``error: <Type> (code N): message``), so one bad call never ends the
session. The text the model sees is cut to ``output_cap`` characters (head
and tail kept, with a marker saying how much was cut).

One :class:`Toolbox` serves one agent session: it remembers the persistent
shell sessions and services it opened, nothing else, and shares nothing
with other toolboxes. With ``on_output``, the shell tool streams its
command's output as it arrives (to that callback) and keeps a bounded head
and tail of each stream for the result, as execd does in collected mode.

Cancellation: a tool call's task, when cancelled (turn timeout, session
timeout, caller cancel), cancels its execd call; execd then kills the
command's process group. The shell tool also waits (up to
``cancel_grace``) for execd to confirm the cancelled command is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import posixpath
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from harnessd.api import ExecdClient
from harnessd.errors import HarnessError, SessionBusy
from harnessd.models import ToolCall, ToolSpec
from harnessd.terminal import Terminal
from harnessd.tool_text import (
    HeadTail,
    ToolFailed,
    _text,
    describe_error,
    format_run,
    format_service,
    format_session_run,
    truncate,
)
from protocol.rpc import services, sessions, shell
from protocol.rpc.resources import Limits

MAX_PATH = 4096
MAX_COMMAND = 1024 * 1024
MAX_CONTENT = 16 * 1024 * 1024
MAX_NAME = 64
MAX_SECONDS = 24 * 3600.0
DEFAULT_LOG_LINES = 100


def about(text: str) -> msgspec.Meta:
    """A parameter's description, as the model reads it in the tool's schema."""
    return msgspec.Meta(description=text)


Path_ = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=MAX_PATH),
    about("a path; relative paths are under the workspace root"),
]
WorkDir = Annotated[Path_, about("working directory (default: the workspace root)")]
Command = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_COMMAND), about("the command line")
]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME, pattern=r"^[A-Za-z0-9_.-]+$")]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class _Args(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments the model sends: unknown keys are refused so typos surface."""


class ShellArgs(_Args):
    """Run a shell command (/bin/sh -c) in the workspace and return its exit status, stdout and
    stderr. Each call is a fresh shell; use session_run to keep state."""

    command: Command
    cwd: WorkDir | None = None
    timeout: Annotated[Seconds, about("seconds before it is killed")] | None = None


class ReadFileArgs(_Args):
    """Read a text file from the workspace."""

    path: Path_
    offset: Annotated[int, msgspec.Meta(ge=0, le=2**62), about("byte offset to start at")] = 0
    max_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**40), about("most bytes to read")] | None = (
        None
    )


class WriteFileArgs(_Args):
    """Write (or append to) a text file in the workspace, creating parents."""

    path: Path_
    content: Annotated[str, msgspec.Meta(max_length=MAX_CONTENT), about("the text to write")]
    append: Annotated[bool, about("append instead of replacing")] = False


class ListFilesArgs(_Args):
    """List a directory of the workspace (type, size, path)."""

    path: Path_ = "."
    recursive: Annotated[bool, about("descend into subdirectories")] = False


class ProbeArgs(_Args):
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


class StartServiceArgs(_Args):
    """Start a long-running background service (a server, a watcher) under a name, optionally
    waiting until a readiness probe succeeds."""

    name: Annotated[Name, about("service name ([A-Za-z0-9_.-])")]
    command: Command
    cwd: WorkDir | None = None
    probe: ProbeArgs | None = None


class ServiceLogsArgs(_Args):
    """The recent output of a service started with start_service."""

    name: Annotated[Name, about("service name")]
    lines: (
        Annotated[int, msgspec.Meta(ge=1, le=100_000), about("how many last lines (default 100)")]
        | None
    ) = None


class StopServiceArgs(_Args):
    """Stop a service started with start_service."""

    name: Annotated[Name, about("service name")]


class WaitForPathArgs(_Args):
    """Wait until a path exists (or is absent, a file, a dir, nonempty)."""

    path: Path_
    condition: Annotated[
        Literal["exists", "absent", "file", "dir", "nonempty"], about("what to wait for")
    ] = "exists"
    timeout: Annotated[Seconds, about("seconds to wait (default 30)")] = 30.0


class SessionRunArgs(_Args):
    """Run a command in a persistent shell session (opened on first use): the working directory,
    exported variables and shell state persist between calls."""

    session: Annotated[Name, about("session name ([A-Za-z0-9_.-])")]
    command: Command
    timeout: Annotated[Seconds, about("seconds before it is interrupted")] | None = None


# -- schemas ---------------------------------------------------------------------------------


def parameters_schema(args: type[msgspec.Struct]) -> dict[str, Any]:
    """The JSON schema of a tool's arguments as the model is shown it.

    ``msgspec.json.schema(args)`` made self-contained and plain: references
    inlined (no ``$defs``), titles dropped, the root's description left to
    the tool's, string enums typed, and a ``X | None = None`` field shown as
    an optional ``X`` (a model leaves it out rather than sending null; null
    is still accepted).
    """
    schema = msgspec.json.schema(args)
    root = _plain(schema, schema.get("$defs", {}))
    root.pop("description", None)
    return root


def _plain(node: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    node = dict(node)
    ref = node.pop("$ref", None)
    if ref is not None:
        node = {**definitions[ref.rsplit("/", 1)[1]], **node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("$defs", "title"):
            continue
        if key == "properties":
            out[key] = {name: _plain(sub, definitions) for name, sub in value.items()}
        elif key in ("anyOf", "oneOf", "allOf"):
            out[key] = [_plain(sub, definitions) for sub in value]
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _plain(value, definitions)
        else:
            out[key] = value
    branches = out.get("anyOf")
    if branches is not None and "default" in out and out["default"] is None:
        kept = [branch for branch in branches if branch != {"type": "null"}]
        if len(kept) == 1 and len(branches) == 2:
            rest = {k: v for k, v in out.items() if k not in ("anyOf", "default")}
            out = {**kept[0], **rest}
    enum = out.get("enum")
    if enum is not None and "type" not in out and all(isinstance(v, str) for v in enum):
        out["type"] = "string"
    return out


# -- the registry ----------------------------------------------------------------------------

A = TypeVar("A", bound=_Args)
Handler = Callable[["Toolbox", A, "CallContext"], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Tool:
    """One tool: its name, argument type, handler, and the spec the model sees."""

    name: str
    args: type[_Args]
    handler: Handler[Any]
    spec: ToolSpec
    decoder: msgspec.json.Decoder[Any]


TOOLS: dict[str, Tool] = {}
"""Every tool by name, in the order they are offered."""


def tool(name: str, args: type[A]) -> Callable[[Handler[A]], Handler[A]]:
    """Register the decorated Toolbox method as tool ``name`` taking ``args``."""

    def register(handler: Handler[A]) -> Handler[A]:
        if name in TOOLS:
            raise RuntimeError(f"tool {name!r} is declared twice")
        description = " ".join(inspect.cleandoc(args.__doc__ or "").split())
        spec = ToolSpec(name=name, description=description, parameters=parameters_schema(args))
        TOOLS[name] = Tool(name, args, handler, spec, msgspec.json.Decoder(args))
        return handler

    return register


@dataclass(frozen=True, slots=True)
class CallContext:
    """The call a handler serves, and where its live output goes (None: nowhere)."""

    call: ToolCall
    output: Callable[[str, bytes], None] | None = None


OutputListener = Callable[[ToolCall, str, bytes], None]
"""Receives ``(call, stream name, bytes)`` as a command's output arrives."""


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """Knobs of the tools.

    ``root``: the workspace directory; relative paths resolve against it and
    commands start there (None: execd's working directory). ``output_cap``:
    characters of a tool result shown to the model. ``shell_timeout``:
    default seconds for a command (``max_timeout`` caps what the model may
    ask). ``read_cap``: most bytes one read_file returns. ``list_limit``:
    most entries one list_files returns. ``probe_timeout``: default seconds a
    service may take to become ready. ``cancel_grace``: how long an
    interrupted command waits for execd to confirm it stopped.
    """

    root: str | None = None
    output_cap: int = 16_000
    shell_timeout: float = 120.0
    max_timeout: float = 3600.0
    read_cap: int = 256 * 1024
    list_limit: int = 1000
    probe_timeout: float = 30.0
    cancel_grace: float = 5.0
    limits: Limits | None = None
    """Resource limits of every command the shell, session, service and terminal tools start."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    """One tool call's outcome: the text for the model (already cut) and how it went."""

    call_id: str
    name: str
    text: str
    ok: bool
    ms: float
    error: str | None = None
    full_chars: int = 0


class Toolbox:
    """The tools of one agent session, dispatched onto execd.

    ``client``: returns the session's current client (it may change after a
    reconnect). ``session_prefix``: prepended to persistent shell session
    and service names in execd, so agent sessions sharing one execd do not
    collide. ``on_output``: when given, shell commands stream their output
    to it as it arrives (see the module docstring).
    """

    def __init__(
        self,
        client: Callable[[], ExecdClient],
        config: ToolConfig | None = None,
        *,
        session_prefix: str = "",
        on_output: OutputListener | None = None,
    ) -> None:
        self._client = client
        self.config = config or ToolConfig()
        self.prefix = session_prefix
        self.on_output = on_output
        self.opened_sessions: set[str] = set()
        self.started_services: set[str] = set()
        self._interrupted: set[str] = set()
        self.terminals: dict[str, Terminal] = {}

    @property
    def specs(self) -> list[ToolSpec]:
        """The tool schemas offered to the model."""
        return list(TOOL_SPECS)

    async def call(
        self, call: ToolCall, *, output: Callable[[str, bytes], None] | None = None
    ) -> ToolResult:
        """Run one tool call; never raises except CancelledError.

        ``output``: where this call's command output goes as it arrives (by
        default ``on_output``'s; with neither, the shell tool collects it).
        """
        started = time.perf_counter()
        entry = TOOLS.get(call.name)
        ok, error = True, None
        if entry is None:
            text = f"error: unknown tool {call.name!r}; the tools are: {', '.join(TOOLS)}"
            ok, error = False, "UnknownTool"
        else:
            try:
                args = entry.decoder.decode(call.arguments or "{}")
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                text = f"error: invalid arguments for {call.name}: {exc}"
                ok, error = False, "InvalidArguments"
            else:
                if output is None and self.on_output is not None:
                    output = functools.partial(self.on_output, call)
                try:
                    text = await entry.handler(self, args, CallContext(call, output))
                except (HarnessError, ToolFailed, OSError, ValueError) as exc:
                    text, ok, error = describe_error(exc), False, type(exc).__name__
        ms = (time.perf_counter() - started) * 1000.0
        return ToolResult(
            call_id=call.id,
            name=call.name,
            text=truncate(text, self.config.output_cap),
            ok=ok,
            ms=ms,
            error=error,
            full_chars=len(text),
        )

    async def close(self) -> None:
        """Close the persistent shell sessions and terminals, stop the services it started."""
        from harnessd.tools_terminal import close_terminals

        await close_terminals(self)
        client = self._client()
        for name in sorted(self.opened_sessions):
            with contextlib.suppress(HarnessError):
                await client.close_session_shell(name)
        self.opened_sessions.clear()
        for name in sorted(self.started_services):
            with contextlib.suppress(HarnessError):
                await client.stop_service(name)
        self.started_services.clear()

    # -- helpers -------------------------------------------------------------------

    def _path(self, path: str) -> str:
        root = self.config.root
        if root is None or posixpath.isabs(path):
            return path
        return posixpath.normpath(posixpath.join(root, path))

    def _cwd(self, cwd: str | None) -> str | None:
        return self._path(cwd) if cwd is not None else self.config.root

    def _timeout(self, asked: float | None) -> float:
        value = self.config.shell_timeout if asked is None else asked
        return min(value, self.config.max_timeout)

    def _exec_cap(self) -> int:
        """Bytes execd keeps per output stream: enough for the model's cap, not megabytes."""
        return max(4096, self.config.output_cap * 4)

    def _name(self, name: str) -> str:
        full = f"{self.prefix}{name}"
        if len(full) > MAX_NAME:
            raise ToolFailed(f"name {name!r} is too long (at most {MAX_NAME - len(self.prefix)})")
        return full

    # -- handlers ------------------------------------------------------------------

    @tool("shell", ShellArgs)
    async def _shell(self, args: ShellArgs, context: CallContext) -> str:
        cap = self._exec_cap()
        if context.output is not None:
            return await self._shell_streaming(args, cap, context.output)
        params = shell.RunParams(
            command=args.command,
            cwd=self._cwd(args.cwd),
            timeout=self._timeout(args.timeout),
            output_cap=cap,
            limits=self.config.limits,
        )
        handle = self._client().start(shell.RUN, params)
        try:
            result = await handle.result()
        except asyncio.CancelledError:
            # handle.result() already asked execd to cancel; wait for its word that it did.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.config.cancel_grace):
                    await handle.result()
            raise
        return format_run(result, cap)

    async def _shell_streaming(
        self, args: ShellArgs, cap: int, output: Callable[[str, bytes], None]
    ) -> str:
        """The shell tool with live output: each chunk to ``output``, a bounded copy kept."""
        running = self._client().run_streaming(
            command=args.command,
            cwd=self._cwd(args.cwd),
            timeout=self._timeout(args.timeout),
            limits=self.config.limits,
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
                async with asyncio.timeout(self.config.cancel_grace):
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

    @tool("read_file", ReadFileArgs)
    async def _read_file(self, args: ReadFileArgs, context: CallContext) -> str:
        cap = min(args.max_bytes or self.config.read_cap, self.config.read_cap)
        data = await self._client().read_file(
            self._path(args.path), offset=args.offset, length=cap + 1
        )
        more = len(data) > cap
        text = _text(data[:cap])
        if more:
            text += f"\n[... file continues past byte {args.offset + cap}; read with offset ...]"
        return text

    @tool("write_file", WriteFileArgs)
    async def _write_file(self, args: WriteFileArgs, context: CallContext) -> str:
        data = args.content.encode()
        path = self._path(args.path)
        await self._client().write_file(path, data, create_parents=True, append=args.append)
        verb = "appended" if args.append else "wrote"
        return f"{verb} {len(data)} bytes to {path}"

    @tool("list_files", ListFilesArgs)
    async def _list_files(self, args: ListFilesArgs, context: CallContext) -> str:
        path = self._path(args.path)
        listing = await self._client().list_dir(
            path, recursive=args.recursive, limit=self.config.list_limit
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

    @tool("wait_for_path", WaitForPathArgs)
    async def _wait_for_path(self, args: WaitForPathArgs, context: CallContext) -> str:
        path = self._path(args.path)
        result = await self._client().wait_for_path(
            path, condition=args.condition, timeout=min(args.timeout, self.config.max_timeout)
        )
        return f"{path}: {args.condition} after {result.waited:.3f} s"

    @tool("start_service", StartServiceArgs)
    async def _start_service(self, args: StartServiceArgs, context: CallContext) -> str:
        name = self._name(args.name)
        probe = _probe(args.probe, self.config.probe_timeout) if args.probe else None
        info = await self._client().start_service(
            name,
            command=args.command,
            cwd=self._cwd(args.cwd),
            probe=probe,
            limits=self.config.limits,
        )
        self.started_services.add(name)
        return format_service(info)

    @tool("service_logs", ServiceLogsArgs)
    async def _service_logs(self, args: ServiceLogsArgs, context: CallContext) -> str:
        logs = await self._client().service_logs(
            self._name(args.name),
            lines=args.lines if args.lines is not None else DEFAULT_LOG_LINES,
            nbytes=min(self.config.read_cap, services.MAX_LOG_READ),
        )
        head = f"log bytes {logs.start}..{logs.end} of {logs.size}"
        return f"{head}\n{_text(logs.data)}" if logs.data else f"{head} (empty)"

    @tool("stop_service", StopServiceArgs)
    async def _stop_service(self, args: StopServiceArgs, context: CallContext) -> str:
        name = self._name(args.name)
        info = await self._client().stop_service(name)
        self.started_services.discard(name)
        return format_service(info)

    @tool("session_run", SessionRunArgs)
    async def _session_run(self, args: SessionRunArgs, context: CallContext) -> str:
        client = self._client()
        name = self._name(args.session)
        if name not in self.opened_sessions:
            await client.open_session(name, cwd=self.config.root, limits=self.config.limits)
            self.opened_sessions.add(name)
        cap = self._exec_cap()
        params = sessions.RunParams(
            name=name, command=args.command, timeout=self._timeout(args.timeout), output_cap=cap
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.cancel_grace
        while True:
            try:
                result = await client.call(sessions.RUN, params)
            except SessionBusy:
                # A command interrupted by an earlier turn may still be winding down.
                if name not in self._interrupted or loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.05)
                continue
            except asyncio.CancelledError:
                # execd interrupts the command (SIGINT, then SIGKILL after its grace).
                self._interrupted.add(name)
                raise
            break
        self._interrupted.discard(name)
        if result.session_ended:
            self.opened_sessions.discard(name)
        return format_session_run(result, cap)


from harnessd import tools_terminal  # noqa: E402, F401 - registers the terminal tools

TOOL_SPECS: tuple[ToolSpec, ...] = tuple(entry.spec for entry in TOOLS.values())
"""What the model is offered, in order."""


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
