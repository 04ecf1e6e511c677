"""The tools offered to the model, and their dispatch onto execd.

Each tool has a JSON schema (:data:`TOOL_SPECS`, what the model sees), a
bounded msgspec argument type (what the model's JSON must decode into), and
a handler that calls execd through the session's current
:class:`~harnessd.api.ExecdClient`. A handler returns text for the model; a
failure becomes text too (``error: <Type> (code N): message``), so one bad
call never ends the session. The text the model sees is cut to
``output_cap`` characters (head and tail kept, with a marker saying how much
was cut).

One :class:`Toolbox` serves one agent session: it remembers the persistent
shell sessions it opened, nothing else, and shares nothing with other
toolboxes.

Cancellation: a tool call's task, when cancelled (turn timeout, session
timeout, caller cancel), cancels its execd call; execd then kills the
command's process group. The shell tool also waits (up to
``cancel_grace``) for execd to confirm the cancelled command is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from harnessd.api import ExecdClient
from harnessd.errors import HarnessError, RemoteError, SessionBusy
from harnessd.models import ToolCall, ToolSpec
from protocol.api import services, sessions, shell

MAX_PATH = 4096
MAX_COMMAND = 1024 * 1024
MAX_CONTENT = 16 * 1024 * 1024
MAX_NAME = 64
MAX_SECONDS = 24 * 3600.0
DEFAULT_LOG_LINES = 100

Path_ = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH)]
Command = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_COMMAND)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME, pattern=r"^[A-Za-z0-9_.-]+$")]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class _Args(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments the model sends: unknown keys are refused so typos surface."""


class ShellArgs(_Args):
    command: Command
    cwd: Path_ | None = None
    timeout: Seconds | None = None


class ReadFileArgs(_Args):
    path: Path_
    offset: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0
    max_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**40)] | None = None


class WriteFileArgs(_Args):
    path: Path_
    content: Annotated[str, msgspec.Meta(max_length=MAX_CONTENT)]
    append: bool = False


class ListFilesArgs(_Args):
    path: Path_ = "."
    recursive: bool = False


class ProbeArgs(_Args):
    type: Literal["tcp", "log", "command"]
    port: Port | None = None
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)] | None = None
    pattern: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None
    command: Command | None = None
    timeout: Seconds | None = None


class StartServiceArgs(_Args):
    name: Name
    command: Command
    cwd: Path_ | None = None
    probe: ProbeArgs | None = None


class ServiceLogsArgs(_Args):
    name: Name
    lines: Annotated[int, msgspec.Meta(ge=1, le=100_000)] | None = None


class StopServiceArgs(_Args):
    name: Name


class WaitForPathArgs(_Args):
    path: Path_
    condition: Literal["exists", "absent", "file", "dir", "nonempty"] = "exists"
    timeout: Seconds = 30.0


class SessionRunArgs(_Args):
    session: Name
    command: Command
    timeout: Seconds | None = None


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_PATH = {"type": "string", "description": "a path; relative paths are under the workspace root"}
_PROBE = {
    "type": "object",
    "description": "how to know the service is ready",
    "properties": {
        "type": {
            "type": "string",
            "enum": ["tcp", "log", "command"],
            "description": "tcp: a port accepts connections; log: a log line matches; "
            "command: a check command exits 0",
        },
        "port": {"type": "integer", "description": "tcp: the port"},
        "host": {"type": "string", "description": "tcp: the host (default 127.0.0.1)"},
        "pattern": {"type": "string", "description": "log: a regular expression"},
        "command": {"type": "string", "description": "command: the check command line"},
        "timeout": {"type": "number", "description": "seconds to wait for readiness"},
    },
    "required": ["type"],
    "additionalProperties": False,
}

TOOL_SPECS: tuple[ToolSpec, ...] = (
    ToolSpec(
        name="shell",
        description=(
            "Run a shell command (/bin/sh -c) in the workspace and return its exit status, "
            "stdout and stderr. Each call is a fresh shell; use session_run to keep state."
        ),
        parameters=_schema(
            {
                "command": {"type": "string", "description": "the command line"},
                "cwd": {"type": "string", "description": "working directory"},
                "timeout": {"type": "number", "description": "seconds before it is killed"},
            },
            ["command"],
        ),
    ),
    ToolSpec(
        name="read_file",
        description="Read a text file from the workspace.",
        parameters=_schema(
            {
                "path": _PATH,
                "offset": {"type": "integer", "description": "byte offset to start at"},
                "max_bytes": {"type": "integer", "description": "most bytes to read"},
            },
            ["path"],
        ),
    ),
    ToolSpec(
        name="write_file",
        description="Write (or append to) a text file in the workspace, creating parents.",
        parameters=_schema(
            {
                "path": _PATH,
                "content": {"type": "string", "description": "the text to write"},
                "append": {"type": "boolean", "description": "append instead of replacing"},
            },
            ["path", "content"],
        ),
    ),
    ToolSpec(
        name="list_files",
        description="List a directory of the workspace (type, size, path).",
        parameters=_schema(
            {
                "path": _PATH,
                "recursive": {"type": "boolean", "description": "descend into subdirectories"},
            },
            [],
        ),
    ),
    ToolSpec(
        name="start_service",
        description=(
            "Start a long-running background service (a server, a watcher) under a name, "
            "optionally waiting until a readiness probe succeeds."
        ),
        parameters=_schema(
            {
                "name": {"type": "string", "description": "service name ([A-Za-z0-9_.-])"},
                "command": {"type": "string", "description": "the command line"},
                "cwd": {"type": "string", "description": "working directory"},
                "probe": _PROBE,
            },
            ["name", "command"],
        ),
    ),
    ToolSpec(
        name="service_logs",
        description="The recent output of a service started with start_service.",
        parameters=_schema(
            {
                "name": {"type": "string"},
                "lines": {"type": "integer", "description": "how many last lines (default 100)"},
            },
            ["name"],
        ),
    ),
    ToolSpec(
        name="stop_service",
        description="Stop a service started with start_service.",
        parameters=_schema({"name": {"type": "string"}}, ["name"]),
    ),
    ToolSpec(
        name="wait_for_path",
        description="Wait until a path exists (or is absent, a file, a dir, nonempty).",
        parameters=_schema(
            {
                "path": _PATH,
                "condition": {
                    "type": "string",
                    "enum": ["exists", "absent", "file", "dir", "nonempty"],
                },
                "timeout": {"type": "number", "description": "seconds to wait (default 30)"},
            },
            ["path"],
        ),
    ),
    ToolSpec(
        name="session_run",
        description=(
            "Run a command in a persistent shell session (opened on first use): the working "
            "directory, exported variables and shell state persist between calls."
        ),
        parameters=_schema(
            {
                "session": {"type": "string", "description": "session name ([A-Za-z0-9_.-])"},
                "command": {"type": "string", "description": "the command line"},
                "timeout": {"type": "number", "description": "seconds before it is interrupted"},
            },
            ["session", "command"],
        ),
    ),
)


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


class ToolFailed(Exception):
    """A tool could not do what was asked; the message goes to the model."""


def truncate(text: str, cap: int) -> str:
    """``text`` cut to about ``cap`` characters: head and tail, with a marker of what was cut."""
    if len(text) <= cap:
        return text
    marker_room = 64
    keep = max(0, cap - marker_room)
    head = keep // 2
    tail = keep - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[len(text) - tail :]}"


def describe_error(exc: BaseException) -> str:
    """The text a model sees for a failed call."""
    if isinstance(exc, RemoteError):
        return f"error: {type(exc).__name__} (code {exc.code}): {exc.message}"
    if isinstance(exc, ToolFailed):
        return f"error: {exc}"
    return f"error: {type(exc).__name__}: {exc}"


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


Handler = Callable[[Any], Awaitable[str]]


class Toolbox:
    """The tools of one agent session, dispatched onto execd.

    ``client``: returns the session's current client (it may change after a
    reconnect). ``session_prefix``: prepended to persistent shell session
    and service names in execd, so agent sessions sharing one execd do not
    collide.
    """

    def __init__(
        self,
        client: Callable[[], ExecdClient],
        config: ToolConfig | None = None,
        *,
        session_prefix: str = "",
    ) -> None:
        self._client = client
        self.config = config or ToolConfig()
        self.prefix = session_prefix
        self.opened_sessions: set[str] = set()
        self.started_services: set[str] = set()
        self._interrupted: set[str] = set()
        self._handlers: dict[str, tuple[type[_Args], Handler]] = {
            "shell": (ShellArgs, self._shell),
            "read_file": (ReadFileArgs, self._read_file),
            "write_file": (WriteFileArgs, self._write_file),
            "list_files": (ListFilesArgs, self._list_files),
            "start_service": (StartServiceArgs, self._start_service),
            "service_logs": (ServiceLogsArgs, self._service_logs),
            "stop_service": (StopServiceArgs, self._stop_service),
            "wait_for_path": (WaitForPathArgs, self._wait_for_path),
            "session_run": (SessionRunArgs, self._session_run),
        }

    @property
    def specs(self) -> list[ToolSpec]:
        """The tool schemas offered to the model."""
        return list(TOOL_SPECS)

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one tool call; never raises except CancelledError."""
        started = time.perf_counter()
        entry = self._handlers.get(call.name)
        ok, error = True, None
        if entry is None:
            text = f"error: unknown tool {call.name!r}; the tools are: {', '.join(self._handlers)}"
            ok, error = False, "UnknownTool"
        else:
            args_type, handler = entry
            try:
                args = msgspec.json.decode(call.arguments or "{}", type=args_type)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                text = f"error: invalid arguments for {call.name}: {exc}"
                ok, error = False, "InvalidArguments"
            else:
                try:
                    text = await handler(args)
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
        """Close the persistent shell sessions and stop the services this toolbox started."""
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

    async def _shell(self, args: ShellArgs) -> str:
        cap = self._exec_cap()
        params = shell.RunParams(
            command=args.command,
            cwd=self._cwd(args.cwd),
            timeout=self._timeout(args.timeout),
            output_cap=cap,
        )
        handle = self._client().start(shell.RUN, params)
        try:
            result = await handle.result(shell.RunResult)
        except asyncio.CancelledError:
            # handle.result() already asked execd to cancel; wait for its word that it did.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.config.cancel_grace):
                    await handle.result()
            raise
        return format_run(result, cap)

    async def _read_file(self, args: ReadFileArgs) -> str:
        cap = min(args.max_bytes or self.config.read_cap, self.config.read_cap)
        data = await self._client().read_file(
            self._path(args.path), offset=args.offset, length=cap + 1
        )
        more = len(data) > cap
        text = _text(data[:cap])
        if more:
            text += f"\n[... file continues past byte {args.offset + cap}; read with offset ...]"
        return text

    async def _write_file(self, args: WriteFileArgs) -> str:
        data = args.content.encode()
        path = self._path(args.path)
        await self._client().write_file(path, data, create_parents=True, append=args.append)
        verb = "appended" if args.append else "wrote"
        return f"{verb} {len(data)} bytes to {path}"

    async def _list_files(self, args: ListFilesArgs) -> str:
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

    async def _wait_for_path(self, args: WaitForPathArgs) -> str:
        path = self._path(args.path)
        result = await self._client().wait_for_path(
            path, condition=args.condition, timeout=min(args.timeout, self.config.max_timeout)
        )
        return f"{path}: {args.condition} after {result.waited:.3f} s"

    async def _start_service(self, args: StartServiceArgs) -> str:
        name = self._name(args.name)
        probe = _probe(args.probe, self.config.probe_timeout) if args.probe else None
        info = await self._client().start_service(
            name, command=args.command, cwd=self._cwd(args.cwd), probe=probe
        )
        self.started_services.add(name)
        return format_service(info)

    async def _service_logs(self, args: ServiceLogsArgs) -> str:
        logs = await self._client().service_logs(
            self._name(args.name),
            lines=args.lines if args.lines is not None else DEFAULT_LOG_LINES,
            nbytes=min(self.config.read_cap, services.MAX_LOG_READ),
        )
        head = f"log bytes {logs.start}..{logs.end} of {logs.size}"
        return f"{head}\n{_text(logs.data)}" if logs.data else f"{head} (empty)"

    async def _stop_service(self, args: StopServiceArgs) -> str:
        name = self._name(args.name)
        info = await self._client().stop_service(name)
        self.started_services.discard(name)
        return format_service(info)

    async def _session_run(self, args: SessionRunArgs) -> str:
        client = self._client()
        name = self._name(args.session)
        if name not in self.opened_sessions:
            await client.open_session(name, cwd=self.config.root)
            self.opened_sessions.add(name)
        cap = self._exec_cap()
        params = sessions.RunParams(
            name=name, command=args.command, timeout=self._timeout(args.timeout), output_cap=cap
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.cancel_grace
        while True:
            try:
                result = await client.call(sessions.RUN, params, sessions.RunResult)
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


def format_service(info: services.ServiceInfo) -> str:
    """A service's state as one line for the model."""
    parts = [f"service {info.name}: {info.state}"]
    if info.pid is not None:
        parts.append(f"pid {info.pid}")
    if info.ready:
        parts.append("ready")
    if info.exit_code is not None:
        parts.append(f"exit code {info.exit_code}")
    if info.signal is not None:
        parts.append(f"killed by signal {info.signal}")
    if info.restarts:
        parts.append(f"{info.restarts} restarts")
    parts.append(f"log {info.log_path} ({info.log_size} bytes)")
    if info.error:
        parts.append(f"error: {info.error}")
    return ", ".join(parts)


def format_run(result: shell.RunResult, exec_cap: int | None = None) -> str:
    """A command's result as text: status line, then stdout and stderr when not empty.

    When execd dropped the middle of a stream (``exec_cap`` being the
    ``output_cap`` the command ran with), a marker stands where the bytes were
    and the status line gives the stream's full size.
    """
    if result.timed_out:
        status = f"timed out after {result.duration:.1f} s"
    elif result.idle_out:
        status = f"stopped after {result.duration:.1f} s without output"
    elif result.signal is not None:
        status = f"killed by signal {result.signal}"
    else:
        status = f"exit code {result.exit_code}"
    return _with_streams(status, result, exec_cap)


def format_session_run(result: sessions.RunResult, exec_cap: int | None = None) -> str:
    """A persistent-session command's result: status, cwd afterwards, then its output."""
    if result.session_ended:
        how = f"signal {result.signal}" if result.signal is not None else f"{result.exit_code}"
        status = f"the session's shell ended ({how}); the next call opens a new one"
    elif result.timed_out:
        status = f"timed out after {result.duration:.1f} s and was interrupted"
    elif result.interrupted:
        status = f"interrupted (exit code {result.exit_code})"
    else:
        status = f"exit code {result.exit_code}"
    if result.cwd is not None:
        status += f"; cwd {result.cwd}"
    return _with_streams(status, result, exec_cap)


def _with_streams(
    status: str, result: shell.RunResult | sessions.RunResult, exec_cap: int | None
) -> str:
    parts = [status]
    for label, data, dropped in (
        ("stdout", result.stdout, result.stdout_dropped),
        ("stderr", result.stderr, result.stderr_dropped),
    ):
        if not data and not dropped:
            continue
        if dropped:
            parts[0] += f"; {label} was {len(data) + dropped} bytes"
            split = exec_cap // 2 if exec_cap is not None else len(data)
            body = (
                _text(data[:split])
                + f"\n[... {dropped} bytes of {label} dropped in the workspace ...]\n"
                + _text(data[split:])
            )
        else:
            body = _text(data)
        parts.append(f"{label}:\n{body}")
    return "\n".join(parts)
