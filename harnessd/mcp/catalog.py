"""The tools an MCP client is offered, and their dispatch onto execd.

They are the agent loop's tools (:data:`harnessd.tools.TOOLS`): the same
argument Structs give the JSON schemas (``inputSchema``) and decode the
arguments, the same descriptions tell the model what each does, and a
:class:`~harnessd.toolbox.Toolbox` runs them. Two more that a client
without a shell of its own needs are declared here the same way, on
:data:`MCP_TOOLS`: ``stat_path`` and ``service_status``.

What the server's flags fix (:class:`~harnessd.toolbox.ToolConfig`) applies
to every call and is not an argument the model could raise: resource limits
of every command, service and terminal, the longest timeout, the characters
of a result, the bytes of a read. With ``confine``, a path (or working
directory) that resolves outside the workspace root is refused with a tool
error. That is a check of the path's text, not a sandbox: symlinks inside the
workspace are not resolved, and commands run by the shell tools can reach
whatever the workspace's user can.

A call never raises for what the model sent or for what execd answered: it
returns a :class:`~harnessd.toolbox.ToolResult` with ``ok`` false and the
typed error's message (``error: NotFound (code N): ...``), which the server
turns into an MCP tool error (``isError``). Only an unknown tool name raises
:class:`UnknownTool`, a protocol error by the MCP specification.
"""

from __future__ import annotations

import itertools
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

from harnessd.api import ExecdClient
from harnessd.mcp.relay import OutputRelay
from harnessd.models import ToolCall
from harnessd.tool_text import ToolFailed, format_service
from harnessd.toolbox import (
    Args,
    CallContext,
    Name,
    PathArg,
    Toolbox,
    ToolConfig,
    ToolResult,
    ToolSet,
    about,
)
from harnessd.tools import TOOLS


class UnknownTool(LookupError):
    """A call named a tool that is not offered."""


class StatPathArgs(Args):
    """Describe a path in the workspace without reading it: its type (file, dir, symlink, ...),
    size in bytes, permission bits, owner and modification time. Fails when it does not exist."""

    path: PathArg
    follow_symlinks: Annotated[
        bool, about("describe what a symlink points to (default) instead of the link itself")
    ] = True


class ServiceStatusArgs(Args):
    """The state of a service started with start_service: running or exited, its pid, whether
    its readiness probe passed, restarts, its last exit status and the size of its log."""

    name: Annotated[Name, about("service name")]


MCP_TOOLS: Final = ToolSet()
"""The tools declared here, offered after the agent loop's."""


@MCP_TOOLS.tool("stat_path", StatPathArgs)
async def _stat_path(box: Toolbox, args: StatPathArgs, context: CallContext) -> str:
    path = box.path(args.path)
    info = await box.client().stat(path, follow_symlinks=args.follow_symlinks)
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info.mtime))
    text = (
        f"{path}: {info.type}, {info.size} bytes, mode {info.mode:04o}, "
        f"uid {info.uid} gid {info.gid}, modified {when}"
    )
    return f"{text}, symlink to {info.target}" if info.target is not None else text


@MCP_TOOLS.tool("service_status", ServiceStatusArgs)
async def _service_status(box: Toolbox, args: ServiceStatusArgs, context: CallContext) -> str:
    return format_service(await box.client().service_status(box.scoped_name(args.name)))


OFFERED: Final = ToolSet(TOOLS, MCP_TOOLS)
"""Every tool the MCP server offers, in order."""

READ_ONLY: Final = frozenset(
    {"read_file", "list_files", "stat_path", "wait_for_path", "service_logs", "service_status"}
)
"""Tools that only look; every other one may change the workspace."""


@dataclass(frozen=True, slots=True)
class Offer:
    """One tool as the MCP client sees it."""

    name: str
    description: str
    schema: dict[str, Any]
    read_only: bool
    """True when the tool changes nothing in the workspace (an MCP annotation hint)."""


def offers() -> list[Offer]:
    """Every tool offered: the agent loop's, in its order, then the ones declared here."""
    return [
        Offer(name, entry.spec.description, entry.spec.parameters, name in READ_ONLY)
        for name, entry in OFFERED.items()
    ]


class ConfinedToolbox(Toolbox):
    """A toolbox of :data:`OFFERED` whose paths may be held to the workspace root."""

    def __init__(
        self, client: Callable[[], ExecdClient], config: ToolConfig, *, confine: bool
    ) -> None:
        if confine and config.root is None:
            raise ValueError("confining paths needs a workspace root")
        super().__init__(client, config, toolset=OFFERED)
        self.confine = confine

    def path(self, path: str) -> str:
        """``path`` resolved against the root; ToolFailed outside it when confined."""
        resolved = posixpath.normpath(super().path(path))
        root = self.config.root
        if self.confine and root is not None and not within(resolved, root):
            raise ToolFailed(
                f"{path} is outside the workspace {root} (this server keeps paths inside it)"
            )
        return resolved


def within(path: str, root: str) -> bool:
    """Whether the normalized absolute ``path`` is ``root`` or below it."""
    base = posixpath.normpath(root)
    return path == base or path.startswith(base.rstrip("/") + "/")


class WorkspaceTools:
    """Runs tool calls against the workspace; a call given a relay streams its shell output there.

    Without one the shell tool collects the output in execd, as the agent loop does.
    """

    def __init__(
        self, client: Callable[[], ExecdClient], config: ToolConfig, *, confine: bool = False
    ) -> None:
        self.box = ConfinedToolbox(client, config, confine=confine)
        self._ids = itertools.count(1)

    @property
    def config(self) -> ToolConfig:
        """The limits and defaults every call runs with."""
        return self.box.config

    def new_call(self, name: str, arguments: dict[str, Any] | None) -> ToolCall:
        """A call with a fresh id; raises UnknownTool for a name not offered."""
        if name not in OFFERED:
            raise UnknownTool(name)
        text = msgspec.json.encode(arguments or {}).decode()
        return ToolCall(id=f"call-{next(self._ids)}", name=name, arguments=text)

    async def run(self, call: ToolCall, relay: OutputRelay | None = None) -> ToolResult:
        """Run ``call``; its command output (shell) goes to ``relay`` as it arrives."""
        return await self.box.call(call, output=relay.add if relay is not None else None)
