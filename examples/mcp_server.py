"""An MCP server of your own around a workspace, from harnessd mcp's parts.

An MCP client starts it as ``python mcp_server.py ROOT`` and speaks MCP on its stdin and
stdout: execd is launched on this machine, the model's tools are confined to ROOT and
capped at ten minutes a call, and when the client closes stdin every process the
tools started is killed and execd stops.
"""

import asyncio
import sys

from harnessd.mcp import LaunchTarget, ServerOptions, Workspace, WorkspaceServer, serve_stdio
from harnessd.toolbox import ToolConfig


async def main(root: str) -> None:
    workspace = await Workspace.open(LaunchTarget(lease=30))
    server = await WorkspaceServer.start(
        workspace, ServerOptions(tools=ToolConfig(root=root, max_timeout=600), confine=True)
    )
    try:
        await serve_stdio(server)
    finally:
        await server.close()  # kills every marked process; stops the launched execd


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
