"""How tools are declared, registered and dispatched onto execd: the foundation of the tools.

Each tool is declared once: an argument Struct (deriving from :class:`Args`)
whose docstring is the tool's description and whose fields (types, bounds,
``about(...)`` descriptions) are its parameters, and a handler registered on
a :class:`ToolSet` with ``@tools.tool(name, Struct)``. The JSON schema the
model sees is generated from the Struct (:func:`parameters_schema`), and the
same Struct decodes the model's arguments, so what the model is told and
what is accepted cannot drift apart. A handler calls execd through the
toolbox's current :class:`~harnessd.api.ExecdClient` and returns text for
the model; a failure becomes text too (``error: <Type> (code N): message``),
so one bad call never ends the session. The text the model sees is cut to
``output_cap`` characters (head and tail kept, with a marker saying how much
was cut).

The registry is explicit: a tool module makes its own :class:`ToolSet`,
registers its handlers and, with ``@tools.closer``, a hook that closes what
its tools leave open (shells, services, terminals). ``ToolSet(a, b)`` joins
sets; :data:`harnessd.tools.TOOLS` is the standard one. One
:class:`Toolbox` serves one agent session with one set: it dispatches calls,
keeps each tool module's per-session state (:meth:`Toolbox.state`), and runs
the close hooks when it closes. Toolboxes share nothing.
"""

from __future__ import annotations

import functools
import inspect
import posixpath
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, TypeVar, cast

import msgspec

from harnessd.api import ExecdClient
from harnessd.errors import HarnessError
from harnessd.models import ToolCall, ToolSpec
from harnessd.tool_text import ToolFailed, describe_error, truncate
from protocol.rpc.resources import Limits
from protocol.rpc.types import MAX_COMMAND, MAX_PATH

MAX_NAME: Final = 64
"""Longest name of a shell session, service or terminal in execd, the session prefix included."""

MAX_SECONDS: Final = 24 * 3600.0
"""Longest wait or timeout a model may ask of a tool."""


def about(text: str) -> msgspec.Meta:
    """A parameter's description, as the model reads it in the tool's schema."""
    return msgspec.Meta(description=text)


PathArg = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=MAX_PATH),
    about("a path; relative paths are under the workspace root"),
]
WorkDir = Annotated[PathArg, about("working directory (default: the workspace root)")]
Command = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_COMMAND), about("the command line")
]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME, pattern=r"^[A-Za-z0-9_.-]+$")]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class Args(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of a tool's arguments, as the model sends them: unknown keys are refused so typos surface."""


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

A = TypeVar("A", bound=Args)
S = TypeVar("S")
Handler = Callable[["Toolbox", A, "CallContext"], Awaitable[str]]
"""A tool's handler: the toolbox, the decoded arguments and the call; the text for the model."""
Closer = Callable[["Toolbox"], Awaitable[None]]
"""A hook that closes what a tool module's tools left open in one toolbox."""


@dataclass(frozen=True, slots=True)
class Tool:
    """One tool: its name, argument type, handler, and the spec the model sees."""

    name: str
    args: type[Args]
    handler: Handler[Any]
    spec: ToolSpec
    decoder: msgspec.json.Decoder[Any]


class ToolSet(Mapping[str, Tool]):
    """Tools by name in the order they are offered, and the hooks that close what they open.

    ``ToolSet(a, b)`` holds the tools of ``a`` then ``b`` and the close hooks
    of both; a name declared twice is refused.
    """

    def __init__(self, *parts: ToolSet) -> None:
        self._tools: dict[str, Tool] = {}
        self.closers: list[Closer] = []
        for part in parts:
            for entry in part.values():
                self._add(entry)
            self.closers.extend(part.closers)

    def tool(self, name: str, args: type[A]) -> Callable[[Handler[A]], Handler[A]]:
        """Register the decorated function as tool ``name`` taking ``args``."""

        def register(handler: Handler[A]) -> Handler[A]:
            description = " ".join(inspect.cleandoc(args.__doc__ or "").split())
            spec = ToolSpec(name=name, description=description, parameters=parameters_schema(args))
            self._add(Tool(name, args, handler, spec, msgspec.json.Decoder(args)))
            return handler

        return register

    def closer(self, hook: Closer) -> Closer:
        """Register ``hook`` to run when a toolbox of this set closes (last registered, first run)."""
        self.closers.append(hook)
        return hook

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        """What the model is offered, in order."""
        return tuple(entry.spec for entry in self._tools.values())

    def _add(self, entry: Tool) -> None:
        if entry.name in self._tools:
            raise RuntimeError(f"tool {entry.name!r} is declared twice")
        self._tools[entry.name] = entry

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)


# -- one session's tools ---------------------------------------------------------------------


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
    reconnect). ``toolset``: the tools offered (:data:`harnessd.tools.TOOLS`
    for the standard ones). ``session_prefix``: prepended to persistent shell
    session and service names in execd, so agent sessions sharing one execd
    do not collide. ``on_output``: when given, shell commands stream their
    output to it as it arrives (see :mod:`harnessd.tools`).
    """

    def __init__(
        self,
        client: Callable[[], ExecdClient],
        config: ToolConfig | None = None,
        *,
        toolset: ToolSet,
        session_prefix: str = "",
        on_output: OutputListener | None = None,
    ) -> None:
        self._source = client
        self.config = config or ToolConfig()
        self.toolset = toolset
        self.prefix = session_prefix
        self.on_output = on_output
        self._states: dict[type, object] = {}

    @property
    def specs(self) -> list[ToolSpec]:
        """The tool schemas offered to the model."""
        return list(self.toolset.specs)

    def client(self) -> ExecdClient:
        """The session's current execd client."""
        return self._source()

    def state(self, kind: type[S]) -> S:
        """This toolbox's ``kind()``, made on first use: where a tool module keeps what it opened."""
        found = self._states.get(kind)
        if found is None:
            found = self._states[kind] = kind()
        return cast(S, found)

    async def call(
        self, call: ToolCall, *, output: Callable[[str, bytes], None] | None = None
    ) -> ToolResult:
        """Run one tool call; never raises except CancelledError.

        ``output``: where this call's command output goes as it arrives (by
        default ``on_output``'s; with neither, the shell tool collects it).
        """
        started = time.perf_counter()
        entry = self.toolset.get(call.name)
        ok, error = True, None
        if entry is None:
            text = f"error: unknown tool {call.name!r}; the tools are: {', '.join(self.toolset)}"
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
        """Close what the tools left open (shells, services, terminals): every close hook runs.

        The hooks run last registered first; an exception from one is raised
        once the others have run.
        """
        failures: list[Exception] = []
        for hook in reversed(self.toolset.closers):
            try:
                await hook(self)
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    # -- what handlers share ---------------------------------------------------------------

    def path(self, path: str) -> str:
        """``path`` resolved against the workspace root (an absolute one as it is)."""
        root = self.config.root
        if root is None or posixpath.isabs(path):
            return path
        return posixpath.normpath(posixpath.join(root, path))

    def cwd(self, cwd: str | None) -> str | None:
        """Where a command starts: ``cwd`` resolved, else the workspace root."""
        return self.path(cwd) if cwd is not None else self.config.root

    def timeout(self, asked: float | None) -> float:
        """A command's timeout: what the model asked (else the default), at most the ceiling."""
        value = self.config.shell_timeout if asked is None else asked
        return min(value, self.config.max_timeout)

    def exec_cap(self) -> int:
        """Bytes execd keeps per output stream: enough for the model's cap, not megabytes."""
        return max(4096, self.config.output_cap * 4)

    def scoped_name(self, name: str) -> str:
        """A name the model gave, as execd knows it: with this session's prefix."""
        full = f"{self.prefix}{name}"
        if len(full) > MAX_NAME:
            raise ToolFailed(f"name {name!r} is too long (at most {MAX_NAME - len(self.prefix)})")
        return full
