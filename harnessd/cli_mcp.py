"""``harnessd mcp``: serve a workspace's tools to an MCP client (an agent CLI or IDE).

Where execd runs is chosen as for the other commands: launched on this
machine (the default), launched through a command prefix (``--via "ssh
host"``, ``--via "docker exec -i box"``), or an execd already running
(``--port``, its token from ``--token-file`` or ``$EXECD_TOKEN``).

``--transport stdio`` (the default) speaks MCP on stdin and stdout, the way
agent CLIs start MCP servers; the session ends when stdin closes.
``--transport http`` serves streamable HTTP on ``--http-host`` (loopback by
default) and ``--http-port``; every request needs ``Authorization: Bearer
TOKEN``, the token read from ``--http-token-file`` or ``$HARNESSD_MCP_TOKEN``
(never from the command line). Once listening, one JSON line on stdout gives
the endpoint.

Limits given here (``--max-timeout``, ``--output-cap``, ``--read-cap``,
``--limit-memory`` and the other resource limits) hold for every tool call;
the model cannot raise them. ``--confine`` refuses paths outside the
workspace.

When the session ends (stdin closes, SIGTERM, SIGINT, SIGHUP) every process
carrying execd's marker is killed and a launched execd stops; a launched
execd also cleans up by itself after ``--lease`` seconds if this process is
killed outright. Exit status: 0, or 1 when marked processes survived the
cleanup; 2 for usage errors; 128+N after signal N.

The MCP SDK is an extra: ``pip install 'splitexec[mcp]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from harnessd.cli_common import USAGE, UsageError, run_session, say
from harnessd.launcher import DEFAULT_LEASE
from harnessd.toolbox import ToolConfig
from protocol.handshake import EmptyToken, token_bytes
from protocol.rpc.resources import LIMIT_NAMES
from protocol.values import (
    LIMIT_OPTIONS,
    bind_port,
    from_options,
    option_name,
    port_number,
    positive_int,
    positive_seconds,
    read_token,
)

if TYPE_CHECKING:
    from harnessd.mcp.server import WorkspaceServer
    from harnessd.mcp.workspace import Cleanup, ConnectTarget, LaunchTarget, Workspace

PROG = "harnessd mcp"
HTTP_TOKEN_VAR = "HARNESSD_MCP_TOKEN"  # noqa: S105 - a variable name, not a secret
DEFAULT_HTTP_PORT = 8765


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``mcp`` on the harnessd command line."""
    parser = sub.add_parser(
        "mcp",
        help="serve a workspace's tools to an MCP client (stdio or streamable HTTP)",
        description=(
            "Serve shell, file, service, terminal and session tools that run in a workspace "
            "through execd, to an MCP client. Launches execd locally unless --via or --port "
            "says otherwise."
        ),
    )
    parser.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    where = parser.add_argument_group("where execd runs (default: launched on this machine)")
    where.add_argument("--via", help='launch execd through this command prefix, e.g. "ssh host"')
    where.add_argument(
        "--remote-shell", action="store_true", help="the prefix goes through a remote shell (ssh)"
    )
    where.add_argument(
        "--execd", help='the command that starts execd there, e.g. "python3 -m execd"'
    )
    where.add_argument("--bind-host", default="127.0.0.1", help="what a launched execd listens on")
    where.add_argument("--connect-host", help="where to reach a launched execd")
    where.add_argument("--port", type=port_number, help="port of a running execd (else launch one)")
    where.add_argument("--host", default="127.0.0.1", help="host of a running execd")
    where.add_argument("--token-file", help="token of the running execd (else $EXECD_TOKEN)")
    where.add_argument("--encrypt", action="store_true", help="encrypt every frame")
    where.add_argument(
        "--lease",
        type=positive_seconds,
        default=DEFAULT_LEASE,
        help="a launched execd cleans up and exits after this many seconds without hearing "
        f"from this process (default {DEFAULT_LEASE:g})",
    )
    tools = parser.add_argument_group("tools (every call is held to these)")
    tools.add_argument(
        "--workspace",
        help="directory the tools work in (default: a new temporary directory for a local "
        "execd, execd's working directory otherwise)",
    )
    tools.add_argument(
        "--confine", action="store_true", help="refuse paths outside the workspace directory"
    )
    defaults = ToolConfig()
    for option, parse, default, what in (
        ("--shell-timeout", positive_seconds, defaults.shell_timeout, "seconds a command runs "
         "when the call gives no timeout"),
        ("--max-timeout", positive_seconds, defaults.max_timeout, "most seconds a call may ask for"),
        ("--output-cap", positive_int, defaults.output_cap, "characters of a tool result"),
        ("--read-cap", positive_int, defaults.read_cap, "bytes one file read returns"),
    ):  # fmt: skip
        tools.add_argument(
            option, type=parse, default=default, help=f"{what} (default {default:g})"
        )
    for name, kind, unit in LIMIT_OPTIONS:
        tools.add_argument(option_name(name), type=kind, metavar=unit)
    http = parser.add_argument_group("streamable HTTP")
    http.add_argument(
        "--http-host", default="127.0.0.1", help="address to serve on (default loopback)"
    )
    http.add_argument(
        "--http-port",
        type=bind_port,
        default=DEFAULT_HTTP_PORT,
        help=f"port to serve on (default {DEFAULT_HTTP_PORT}; 0: any free one)",
    )
    http.add_argument(
        "--http-token-file", help=f"file holding the bearer token (else ${HTTP_TOKEN_VAR})"
    )
    parser.set_defaults(func=main)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What was checked before anything started."""

    target: LaunchTarget | ConnectTarget
    tools: ToolConfig
    confine: bool
    http: socket.socket | None = None
    http_token: bytes = field(default=b"", repr=False)


def _plan(args: argparse.Namespace) -> _Plan:
    from harnessd.mcp.workspace import ConnectTarget, LaunchTarget

    if args.port is not None and (args.via or args.execd):
        raise UsageError("--port connects to a running execd; --via and --execd launch one")
    target: LaunchTarget | ConnectTarget
    if args.port is not None:
        try:
            token = read_token(args.token_file, os.environ)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        target = ConnectTarget(args.host, args.port, token, encrypt=bool(args.encrypt))
    else:
        target = LaunchTarget(
            prefix=tuple(shlex.split(args.via)) if args.via else (),
            remote_shell=bool(args.remote_shell),
            execd_command=tuple(shlex.split(args.execd)) if args.execd else None,
            bind_host=args.bind_host,
            connect_host=args.connect_host,
            encrypt=bool(args.encrypt),
            lease=args.lease,
            scrub=(HTTP_TOKEN_VAR,),
        )
    try:
        limits = from_options({name: getattr(args, f"limit_{name}") for name in LIMIT_NAMES})
    except msgspec.ValidationError as exc:
        raise UsageError(f"invalid limit: {exc}") from None
    root = args.workspace
    local = isinstance(target, LaunchTarget) and target.local
    if root is not None and local:
        root = os.path.abspath(root)
        if not os.path.isdir(root):
            raise UsageError(f"the workspace {root} is not a directory")
    elif root is None and local:
        root = tempfile.mkdtemp(prefix="harnessd-mcp-")
    tools = ToolConfig(
        root=root,
        output_cap=args.output_cap,
        shell_timeout=min(args.shell_timeout, args.max_timeout),
        max_timeout=args.max_timeout,
        read_cap=args.read_cap,
        limits=limits,
    )
    if args.transport != "http":
        return _Plan(target, tools, bool(args.confine))
    return _Plan(target, tools, bool(args.confine), *_http(args))


def _http(args: argparse.Namespace) -> tuple[socket.socket, bytes]:
    from harnessd.mcp.http import listen_socket

    token = _http_token(args.http_token_file)
    try:
        sock = listen_socket(args.http_host, args.http_port)
    except OSError as exc:
        raise UsageError(
            f"cannot listen on {args.http_host}:{args.http_port}: {exc.strerror or exc}"
        ) from None
    return sock, token


def _http_token(path: str | None) -> bytes:
    """The bearer token: from the file, else from $HARNESSD_MCP_TOKEN (never the command line)."""
    try:
        if path:
            return read_token(path, {})
        return token_bytes(os.environ.get(HTTP_TOKEN_VAR, ""))
    except EmptyToken:
        raise UsageError(
            f"the http transport needs a bearer token: --http-token-file FILE or ${HTTP_TOKEN_VAR}"
        ) from None
    except ValueError as exc:
        raise UsageError(str(exc) if path else f"{HTTP_TOKEN_VAR}: {exc}") from None


async def _serve(plan: _Plan) -> int:
    from harnessd.mcp.server import ServerOptions, WorkspaceServer
    from harnessd.mcp.workspace import Workspace

    workspace = await Workspace.open(plan.target)
    server: WorkspaceServer | None = None
    try:
        server = await WorkspaceServer.start(
            workspace, ServerOptions(tools=plan.tools, confine=plan.confine)
        )
        _announce_start(server)
        if plan.http is not None:
            await _serve_http(server, plan.http, plan.http_token)
        else:
            from harnessd.mcp.stdio import serve_stdio

            await serve_stdio(server)
    finally:
        # Shielded: a signal during the cleanup must not cut it (or its report) short.
        closing = asyncio.ensure_future(_close(server or workspace))
        try:
            cleanup = await asyncio.shield(closing)
        except asyncio.CancelledError:
            await asyncio.wait([closing])
            raise
    return 1 if cleanup.left else 0


async def _close(what: WorkspaceServer | Workspace) -> Cleanup:
    """Close the server (or the workspace when no server was built) and say what it did."""
    say(f"{PROG}: the session ended; cleaning up the workspace")
    cleanup = await what.close()
    stopped = "; execd stopped" if cleanup.stopped else ""
    say(f"{PROG}: cleanup: {cleanup.killed} processes killed, {cleanup.left} left{stopped}")
    if cleanup.error:
        say(f"{PROG}: cleanup: {cleanup.error}")
    return cleanup


def _announce_start(server: WorkspaceServer) -> None:
    session = server.workspace.session
    where = (
        f"execd at {session.host}:{session.port} (marker {session.marker})" if session else "execd"
    )
    say(
        f"{PROG} (pid {os.getpid()}): {where}; workspace {server.root}; ledger {server.journal.name}"
    )


async def _serve_http(server: WorkspaceServer, sock: socket.socket, token: bytes) -> None:
    from harnessd.mcp.http import endpoint, serve_http

    line = {"event": "listening", "url": endpoint(sock), "workspace": server.root}
    print(json.dumps(line), flush=True)
    await serve_http(server, sock, token)


def main(args: argparse.Namespace) -> int:
    """Entry of ``harnessd mcp``."""
    try:
        import mcp  # noqa: F401 - only to say what is missing, before anything starts
    except ImportError:
        say(f"{PROG}: the MCP SDK is not installed (pip install 'splitexec[mcp]')")
        return USAGE
    try:
        plan = _plan(args)
    except UsageError as exc:
        say(f"{PROG}: {exc}")
        return USAGE
    try:
        return run_session(lambda: _serve(plan), PROG)
    finally:
        if plan.http is not None:
            plan.http.close()
        sys.stdout.flush()
