"""An MCP server whose tools run in a workspace through execd (``harnessd mcp``).

Agent CLIs and IDEs take their tools from MCP servers. This one offers the
agent loop's tools -- shell, persistent shell sessions, files, services,
path waits, interactive terminals -- with the same schemas and
descriptions, plus the workspace's files and session ledgers as resources;
every call runs in the workspace through execd, while this process (and any
credentials) stays on the harness side.

Needs the ``mcp`` extra (``pip install 'splitexec[mcp]'``); ``import
harnessd`` never imports it. Modules: :mod:`~harnessd.mcp.workspace`
(launch or connect, teardown), :mod:`~harnessd.mcp.catalog` (the tools),
:mod:`~harnessd.mcp.resources`, :mod:`~harnessd.mcp.journal` (the session
ledger), :mod:`~harnessd.mcp.relay` (output as notifications),
:mod:`~harnessd.mcp.server`, and the transports :mod:`~harnessd.mcp.stdio`
and :mod:`~harnessd.mcp.http`.

Embedding it::

    workspace = await Workspace.open(LaunchTarget())
    server = await WorkspaceServer.start(workspace, ServerOptions(tools=ToolConfig()))
    try:
        await serve_stdio(server)
    finally:
        await server.close()  # kills every marked process, stops the launched execd
"""

from harnessd.mcp.server import ServerOptions, WorkspaceServer
from harnessd.mcp.stdio import serve_stdio
from harnessd.mcp.workspace import Cleanup, ConnectTarget, LaunchTarget, Workspace

__all__ = [
    "Cleanup",
    "ConnectTarget",
    "LaunchTarget",
    "ServerOptions",
    "Workspace",
    "WorkspaceServer",
    "serve_stdio",
]
