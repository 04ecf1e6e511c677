"""The tools an MCP client is offered, and their dispatch onto execd.

They are the agent loop's tools (:data:`harnessd.tools.TOOLS`): the same
argument Structs give the JSON schemas (``inputSchema``) and decode the
arguments, the same descriptions tell the model what each does, and one
:class:`~harnessd.tools.Toolbox` runs them. Two more that a client without a
shell of its own needs are declared here the same way: ``stat_path`` and
``service_status``.

What the server's flags fix (:class:`~harnessd.tools.ToolConfig`) applies to
every call and is not an argument the model could raise: resource limits of
every command, service and terminal, the longest timeout, the characters of
a result, the bytes of a read. With ``confine``, a path (or working
directory) that resolves outside the workspace root is refused with a tool
error. That is a check of the path's text, not a sandbox: symlinks inside the
workspace are not resolved, and commands run by the shell tools can reach
whatever the workspace's user can.

A call never raises for what the model sent or for what execd answered: it
returns a :class:`~harnessd.tools.ToolResult` with ``ok`` false and the typed
error's message (``error: NotFound (code N): ...``), which the server turns
into an MCP tool error (``isError``). Only an unknown tool name raises
:class:`UnknownTool`, a protocol error by the MCP specification.
"""

from __future__ import annotations

import itertools
import posixpath
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from harnessd.api import ExecdClient
from harnessd.errors import HarnessError
from harnessd.mcp.relay import OutputRelay
from harnessd.models import ToolCall
from harnessd.tool_text import ToolFailed, describe_error, format_service, truncate
from harnessd.tools import (
    TOOLS,
    Name,
    Path_,
    Toolbox,
    ToolConfig,
    ToolResult,
    about,
    parameters_schema,
)


class UnknownTool(LookupError):
    """A call named a tool that is not offered."""


class _Extra(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of the tools declared here: unknown keys are refused, as the agent's are."""


class StatPathArgs(_Extra):
    """Describe a path in the workspace without reading it: its type (file, dir, symlink, ...),
    size in bytes, permission bits, owner and modification time. Fails when it does not exist."""

    path: Path_
    follow_symlinks: Annotated[
        bool, about("describe what a symlink points to (default) instead of the link itself")
    ] = True


class ServiceStatusArgs(_Extra):
    """The state of a service started with start_service: running or exited, its pid, whether
    its readiness probe passed, restarts, its last exit status and the size of its log."""

    name: Annotated[Name, about("service name")]


@dataclass(frozen=True, slots=True)
class Offer:
    """One tool as the MCP client sees it."""

    name: str
    description: str
    schema: dict[str, Any]
    read_only: bool
    """True when the tool changes nothing in the workspace (an MCP annotation hint)."""


READ_ONLY = frozenset(
    {"read_file", "list_files", "stat_path", "wait_for_path", "service_logs", "service_status"}
)
"""Tools that only look; every other one may change the workspace."""


class ConfinedToolbox(Toolbox):
    """A toolbox whose paths may be held to the workspace root (``confine``)."""

    def __init__(
        self,
        client: Callable[[], ExecdClient],
        config: ToolConfig,
        *,
        confine: bool,
    ) -> None:
        if confine and config.root is None:
            raise ValueError("confining paths needs a workspace root")
        super().__init__(client, config)
        self.confine = confine

    def _path(self, path: str) -> str:
        resolved = posixpath.normpath(super()._path(path))
        root = self.config.root
        if self.confine and root is not None and not within(resolved, root):
            raise ToolFailed(
                f"{path} is outside the workspace {root} (this server keeps paths inside it)"
            )
        return resolved

    def resolve(self, path: str) -> str:
        """``path`` as the tools resolve it (relative to the root; checked when confined)."""
        return self._path(path)


def within(path: str, root: str) -> bool:
    """Whether the normalized absolute ``path`` is ``root`` or below it."""
    base = posixpath.normpath(root)
    return path == base or path.startswith(base.rstrip("/") + "/")


_ExtraHandler = Callable[[ConfinedToolbox, ExecdClient, Any], Awaitable[str]]


async def _stat_path(box: ConfinedToolbox, client: ExecdClient, args: StatPathArgs) -> str:
    path = box.resolve(args.path)
    info = await client.stat(path, follow_symlinks=args.follow_symlinks)
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info.mtime))
    text = (
        f"{path}: {info.type}, {info.size} bytes, mode {info.mode:04o}, "
        f"uid {info.uid} gid {info.gid}, modified {when}"
    )
    return f"{text}, symlink to {info.target}" if info.target is not None else text


async def _service_status(
    box: ConfinedToolbox, client: ExecdClient, args: ServiceStatusArgs
) -> str:
    return format_service(await client.service_status(args.name))


_EXTRAS: dict[str, tuple[type[_Extra], _ExtraHandler]] = {
    "stat_path": (StatPathArgs, _stat_path),
    "service_status": (ServiceStatusArgs, _service_status),
}


def _offer(name: str, args: type[msgspec.Struct], description: str) -> Offer:
    return Offer(name, description, parameters_schema(args), name in READ_ONLY)


def offers() -> list[Offer]:
    """Every tool offered: the agent loop's, in its order, then the ones declared here."""
    listed = [
        Offer(entry.name, entry.spec.description, entry.spec.parameters, entry.name in READ_ONLY)
        for entry in TOOLS.values()
    ]
    for name, (args, _) in _EXTRAS.items():
        listed.append(_offer(name, args, " ".join((args.__doc__ or "").split())))
    return listed


class WorkspaceTools:
    """Runs tool calls against the workspace; a call given a relay streams its shell output there.

    Without one the shell tool collects the output in execd, as the agent loop does.
    """

    def __init__(
        self,
        client: Callable[[], ExecdClient],
        config: ToolConfig,
        *,
        confine: bool = False,
    ) -> None:
        self._client = client
        self.box = ConfinedToolbox(client, config, confine=confine)
        self._ids = itertools.count(1)
        self._decoders = {name: msgspec.json.Decoder(args) for name, (args, _) in _EXTRAS.items()}

    @property
    def config(self) -> ToolConfig:
        """The limits and defaults every call runs with."""
        return self.box.config

    def new_call(self, name: str, arguments: dict[str, Any] | None) -> ToolCall:
        """A call with a fresh id; raises UnknownTool for a name not offered."""
        if name not in TOOLS and name not in _EXTRAS:
            raise UnknownTool(name)
        text = msgspec.json.encode(arguments or {}).decode()
        return ToolCall(id=f"call-{next(self._ids)}", name=name, arguments=text)

    async def run(self, call: ToolCall, relay: OutputRelay | None = None) -> ToolResult:
        """Run ``call``; its command output (shell) goes to ``relay`` as it arrives."""
        extra = _EXTRAS.get(call.name)
        if extra is not None:
            return await self._run_extra(call, extra[1])
        return await self.box.call(call, output=relay.add if relay is not None else None)

    async def _run_extra(self, call: ToolCall, handler: _ExtraHandler) -> ToolResult:
        started = time.perf_counter()
        ok, error = True, None
        try:
            args = self._decoders[call.name].decode(call.arguments)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            text = f"error: invalid arguments for {call.name}: {exc}"
            ok, error = False, "InvalidArguments"
        else:
            try:
                text = await handler(self.box, self._client(), args)
            except (HarnessError, ToolFailed, OSError, ValueError) as exc:
                text, ok, error = describe_error(exc), False, type(exc).__name__
        return ToolResult(
            call_id=call.id,
            name=call.name,
            text=truncate(text, self.config.output_cap),
            ok=ok,
            ms=(time.perf_counter() - started) * 1000.0,
            error=error,
            full_chars=len(text),
        )
