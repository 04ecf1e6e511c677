"""MCP over streamable HTTP, behind a bearer token, on loopback unless told otherwise.

The SDK's streamable-HTTP app (one endpoint, ``/mcp``: POST for requests,
server-sent events for their notifications and results, GET for the
session's own notification stream, DELETE to end a session) runs on uvicorn
in the server's event loop. Every HTTP request must carry ``Authorization:
Bearer TOKEN``; one without it, or with another token, is answered 401 before
it reaches MCP (compared in constant time). On a loopback address the SDK
also refuses requests whose ``Host`` or ``Origin`` is not loopback (DNS
rebinding).

The token is read by the caller from a file or an environment variable and
is never logged; uvicorn's access log is off.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from harnessd.mcp.server import WorkspaceServer

PATH = "/mcp"
"""Where the MCP endpoint is served."""

SHUTDOWN_GRACE = 5
"""Seconds open requests get to finish when the server stops."""

_CHALLENGE = [
    (b"content-type", b"application/json"),
    (b"www-authenticate", b'Bearer realm="harnessd-mcp"'),
]


class BearerGate:
    """ASGI middleware: HTTP requests without the right bearer token get 401."""

    def __init__(self, app: ASGIApp, token: bytes) -> None:
        if not token:
            raise ValueError("an empty bearer token")
        self._app = app
        self._expected = b"Bearer " + token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._allowed(scope):
            body = b'{"error": "unauthorized", "error_description": "a valid bearer token is required"}'
            await send({"type": "http.response.start", "status": 401, "headers": _CHALLENGE})
            await send({"type": "http.response.body", "body": body})
            return
        await self._app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                given = value
        return hmac.compare_digest(given, self._expected)


class _Uvicorn(uvicorn.Server):
    """uvicorn serving inside a loop whose signals are handled by its owner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: the kernel picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def endpoint(sock: socket.socket) -> str:
    """The URL of the MCP endpoint served on ``sock``."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{PATH}"


async def serve_http(server: WorkspaceServer, sock: socket.socket, token: bytes) -> None:
    """Serve ``server`` over streamable HTTP on the listening ``sock`` until cancelled.

    Connections made before uvicorn is up wait in the socket's backlog, so the
    endpoint may be announced as soon as the socket listens. Cancelling stops
    accepting, gives open requests :data:`SHUTDOWN_GRACE` seconds, ends the
    MCP sessions, then re-raises.
    """
    host = sock.getsockname()[0]
    app: Any = server.server.streamable_http_app(streamable_http_path=PATH, host=host)
    config = uvicorn.Config(
        BearerGate(app, token),
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE,
    )
    web = _Uvicorn(config)
    running = asyncio.ensure_future(web.serve(sockets=[sock]))
    try:
        await asyncio.shield(running)
    except asyncio.CancelledError:
        web.should_exit = True
        with contextlib.suppress(Exception):
            await running
        raise
