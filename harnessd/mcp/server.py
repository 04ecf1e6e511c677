"""The MCP server: the workspace's tools and resources behind the SDK's low-level server.

Theory of operation
-------------------
One :class:`WorkspaceServer` serves one workspace (:class:`~harnessd.mcp.workspace.Workspace`) to
any number of MCP sessions (one over stdio; any number over HTTP). They
share one toolbox, so persistent shells, services and terminals are named
per server, not per session.

A ``tools/call`` runs as its own task::

    call ──► journal(tool_call) ──► task: reconnect if needed ─► toolbox ─► result
                                        │ shell output, chunk by chunk
                                        ▼
                                   OutputRelay ──► notifications/progress (with a
                                                   progressToken) and
                                                   notifications/message (with a
                                                   log level set), in order,
                                                   before the result
    result ──► journal(tool_result) ──► CallToolResult (isError when it failed)

``notifications/cancelled`` cancels the handler; the call's task is then
cancelled, which cancels its execd call (execd kills the command's process
group), and the handler waits up to the toolbox's ``cancel_grace`` for
execd to confirm before it lets go. No response follows a cancelled request.

Resources and their subscriptions are :mod:`harnessd.mcp.resources`. On the
2026-07-28 protocol, subscriptions arrive as ``subscriptions/listen``
streams; the URIs of one are watched while the stream is open.

:meth:`WorkspaceServer.close` ends subscriptions, syncs the ledger, and
closes the workspace: every marked process is killed (the tools' shells,
terminals and services with them), and a launched execd stops. It is quick
(a client's SIGKILL follows its SIGTERM within seconds) and runs to its end
even when a signal arrives meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any, TypeVar, get_args

import anyio
import mcp_types as types
from mcp.server.connection import allowed_log_levels
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ResourceUpdated
from mcp.shared.exceptions import MCPError
from mcp.shared.jsonrpc_dispatcher import progress_token_from_params
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from harnessd.errors import HarnessError, NotFound
from harnessd.mcp.catalog import UnknownTool, WorkspaceTools, offers
from harnessd.mcp.journal import Journal
from harnessd.mcp.relay import OutputRelay
from harnessd.mcp.resources import TEMPLATES, ResourceError, WorkspaceResources, ledger_uri
from harnessd.mcp.workspace import Cleanup, Workspace
from harnessd.models import ToolCall
from harnessd.tool_text import describe_error
from harnessd.toolbox import ToolConfig, ToolResult

log = logging.getLogger("harnessd.mcp")

RESOURCE_NOT_FOUND = -32002
"""The MCP error code for a resource that does not exist."""

NOTIFY_FLUSH = 30.0
"""Seconds a finished call waits for its output notifications to be sent."""

MAX_CALLS_IN_FLIGHT = 64
"""Tool calls running at once, over all sessions; more are refused with a tool error."""

CLOSE_STEP_TIMEOUT = 10.0
"""Seconds each step of closing (subscriptions, the ledger's last sync) may take."""

_LEVELS: tuple[types.LoggingLevel, ...] = get_args(types.LoggingLevel)

Context = ServerRequestContext[Any, Any]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """What the server's flags fix for every call: ``tools`` (limits, caps), ``confine``."""

    tools: ToolConfig
    confine: bool = False
    name: str = "harnessd"


def _version() -> str:
    try:
        return metadata.version("splitexec")
    except metadata.PackageNotFoundError:
        return "0"


class WorkspaceServer:
    """An MCP server whose tools and resources are one workspace's. Build with :meth:`start`."""

    def __init__(self, workspace: Workspace, options: ServerOptions) -> None:
        self.workspace = workspace
        self.options = options
        self.tools = WorkspaceTools(workspace.client, options.tools, confine=options.confine)
        self.journal = Journal(workspace.client)
        self.resources = WorkspaceResources(
            workspace.client, self.tools.box, journal=self.journal.name
        )
        self._levels: frozenset[types.LoggingLevel] = frozenset()
        self._bus = InMemorySubscriptionBus()
        self._listen = ListenHandler(self._bus, max_subscriptions=64)
        self._listeners = 0
        self._in_flight = 0
        self._closing: asyncio.Future[Cleanup] | None = None
        self.server: Server[Any] = Server(
            options.name,
            version=_version(),
            instructions=self._instructions(),
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_list_resource_templates=self._list_templates,
            on_read_resource=self._read_resource,
            on_subscribe_resource=self._subscribe,
            on_unsubscribe_resource=self._unsubscribe,
            on_subscriptions_listen=self._listen_stream,
        )
        # Registered directly: the constructor's argument for it warns that the
        # 2026-07-28 protocol dropped it, and older clients still send it.
        self.server.add_request_handler(
            "logging/setLevel", types.SetLevelRequestParams, self._set_level
        )
        self._tool_list = [
            types.Tool(
                name=offer.name,
                description=offer.description,
                input_schema=offer.schema,
                annotations=types.ToolAnnotations(read_only_hint=offer.read_only),
            )
            for offer in offers()
        ]

    @classmethod
    async def start(cls, workspace: Workspace, options: ServerOptions) -> WorkspaceServer:
        """The server, its workspace root settled: the given one, else execd's directory."""
        if options.tools.root is None:
            cwd = (await workspace.client().server_info()).cwd
            options = replace(options, tools=replace(options.tools, root=cwd))
        server = cls(workspace, options)
        server.journal.record(
            {
                "kind": "session_start",
                "root": server.root,
                "confine": options.confine,
                "tools": [tool.name for tool in server._tool_list],
            }
        )
        await server.journal.flush()
        return server

    @property
    def root(self) -> str | None:
        """The workspace root relative paths resolve against."""
        return self.tools.config.root

    async def close(self) -> Cleanup:
        """End subscriptions, sync the ledger and close the workspace (see the module docstring).

        Idempotent, and safe under cancellation (a signal during the cleanup):
        the cleanup runs to its end, each step bounded, before CancelledError
        propagates.
        """
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._shutdown())
        task = self._closing
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):
                await asyncio.wait([task])
            raise

    async def _shutdown(self) -> Cleanup:
        self._listen.close()
        # The workspace's close kills every marked process: the tools' shells,
        # terminals and services go with it, so they are not closed one by one.
        for step in (self.resources.unsubscribe_all, self.journal.close):
            try:
                async with asyncio.timeout(CLOSE_STEP_TIMEOUT):
                    await step()
            except Exception as exc:
                log.warning("closing: %s failed: %s", step.__qualname__, exc)
        return await self.workspace.close()

    def _instructions(self) -> str:
        config = self.options.tools
        where = f"rooted at {config.root}" if config.root else "in execd's working directory"
        parts = [
            f"These tools run in a workspace (a sandbox reached through execd), {where}; "
            "relative paths resolve against the root.",
            "Each shell call is a fresh /bin/sh; session_run keeps a shell's state between calls; "
            "start_service runs servers in the background; terminal_start drives interactive "
            "programs.",
            f"Commands stop after at most {config.max_timeout:g} s, and results are cut to "
            f"{config.output_cap} characters (head and tail kept).",
            f"Every call is recorded in the session ledger {ledger_uri(self.journal.name)} "
            "(a resource).",
        ]
        if self.options.confine:
            parts.append("Paths outside the workspace root are refused.")
        return " ".join(parts)

    # -- tools -----------------------------------------------------------------------

    async def _list_tools(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=list(self._tool_list))

    async def _call_tool(
        self, ctx: Context, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        try:
            call = self.tools.new_call(params.name, params.arguments)
        except UnknownTool:
            known = ", ".join(tool.name for tool in self._tool_list)
            raise MCPError(
                types.INVALID_PARAMS, f"unknown tool {params.name!r}; the tools are: {known}"
            ) from None
        if self._in_flight >= MAX_CALLS_IN_FLIGHT:
            busy = f"error: {MAX_CALLS_IN_FLIGHT} tool calls are running; wait for one to finish"
            return _tool_result(busy, failed=True)
        self._in_flight += 1
        try:
            return await self._run_call(ctx, call)
        finally:
            self._in_flight -= 1

    async def _run_call(self, ctx: Context, call: ToolCall) -> types.CallToolResult:
        self.journal.call(call.id, call.name, call.arguments)
        relay = OutputRelay() if self._wants_output(ctx) else None
        running = asyncio.ensure_future(self._execute(call, relay))
        sender = asyncio.ensure_future(self._send_output(ctx, relay)) if relay else None
        try:
            result = await asyncio.shield(running)
        except asyncio.CancelledError:
            await self._stop(running, sender, relay)
            self.journal.result(call.id, call.name, ok=False, error="Cancelled", text="")
            raise
        if relay is not None and sender is not None:
            relay.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(NOTIFY_FLUSH):
                    await asyncio.shield(sender)
            sender.cancel()
        self.journal.result(call.id, call.name, ok=result.ok, error=result.error, text=result.text)
        return _tool_result(result.text, failed=not result.ok)

    async def _execute(self, call: ToolCall, relay: OutputRelay | None) -> ToolResult:
        started = time.perf_counter()
        try:
            await self.workspace.ensure_connected()
        except HarnessError as exc:
            text = describe_error(exc)
            ms = (time.perf_counter() - started) * 1000.0
            return ToolResult(call.id, call.name, text, False, ms, type(exc).__name__, len(text))
        return await self.tools.run(call, relay)

    async def _stop(
        self,
        running: asyncio.Future[ToolResult],
        sender: asyncio.Future[None] | None,
        relay: OutputRelay | None,
    ) -> None:
        """Cancel a call's task and wait (bounded) until execd confirmed its command is gone."""
        running.cancel()
        if sender is not None:
            sender.cancel()
        if relay is not None:
            relay.close()
        grace = self.tools.config.cancel_grace + 1.0
        with anyio.CancelScope(shield=True):
            pending = [task for task in (running, sender) if task is not None]
            await asyncio.wait(pending, timeout=grace)

    def _wants_output(self, ctx: Context) -> bool:
        """Whether the call's output goes anywhere: a progress token, or log messages asked for."""
        has_token = progress_token_from_params(ctx.params) is not None
        return has_token or "info" in self._log_levels(ctx)

    def _log_levels(self, ctx: Context) -> frozenset[types.LoggingLevel]:
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            return allowed_log_levels(ctx.protocol_version, ctx.meta)
        return self._levels

    async def _send_output(self, ctx: Context, relay: OutputRelay | None) -> None:
        """Send a call's output as it comes: progress (with a token) and log messages."""
        assert relay is not None
        log_it = "info" in self._log_levels(ctx)
        sent = 0
        async for stream, text in relay.batches():
            sent += len(text)
            await ctx.session.report_progress(float(sent), message=text)
            if log_it:
                message = types.LoggingMessageNotification(
                    params=types.LoggingMessageNotificationParams(
                        level="info", logger=f"shell.{stream}", data=text
                    )
                )
                await ctx.session.send_notification(message, related_request_id=ctx.request_id)

    async def _set_level(
        self, ctx: Context, params: types.SetLevelRequestParams
    ) -> types.EmptyResult:
        self._levels = frozenset(_LEVELS[_LEVELS.index(params.level) :])
        return types.EmptyResult()

    # -- resources -------------------------------------------------------------------

    async def _list_resources(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=await _mcp_errors(self.resources.list()))

    async def _list_templates(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=list(TEMPLATES))

    async def _read_resource(
        self, ctx: Context, params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        return await _mcp_errors(self.resources.read(params.uri))

    async def _subscribe(
        self, ctx: Context, params: types.SubscribeRequestParams
    ) -> types.EmptyResult:
        session = ctx.session

        async def updated(uri: str) -> None:
            await session.send_resource_updated(uri)

        await _mcp_errors(self.resources.subscribe(_owner(ctx), params.uri, updated))
        return types.EmptyResult()

    async def _unsubscribe(
        self, ctx: Context, params: types.UnsubscribeRequestParams
    ) -> types.EmptyResult:
        await self.resources.unsubscribe(_owner(ctx), params.uri)
        return types.EmptyResult()

    async def _listen_stream(
        self, ctx: Context, params: types.SubscriptionsListenRequestParams
    ) -> types.SubscriptionsListenResult:
        self._listeners += 1
        owner = f"listen-{self._listeners}"

        async def updated(uri: str) -> None:
            await self._bus.publish(ResourceUpdated(uri=uri))

        try:
            for uri in params.notifications.resource_subscriptions or ():
                await _mcp_errors(self.resources.subscribe(owner, uri, updated))
            return await self._listen(ctx, params)
        finally:
            with anyio.CancelScope(shield=True):
                await self.resources.unsubscribe_all(owner)


def _tool_result(text: str, *, failed: bool) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], is_error=failed
    )


def _owner(ctx: Context) -> str:
    """Which MCP session a request belongs to: its HTTP session id, or the one stdio session."""
    headers = getattr(ctx.request, "headers", None)
    session_id = headers.get("mcp-session-id") if headers is not None else None
    return f"http-{session_id}" if session_id else "stdio"


async def _mcp_errors(work: Awaitable[T]) -> T:
    """``work``'s result; a failure becomes the MCP error a client expects, with its message."""
    try:
        return await work
    except ResourceError as exc:
        raise MCPError(types.INVALID_PARAMS, str(exc)) from None
    except NotFound as exc:
        raise MCPError(RESOURCE_NOT_FOUND, describe_error(exc)) from None
    except HarnessError as exc:
        raise MCPError(types.INTERNAL_ERROR, describe_error(exc)) from None
