"""The alternatives execd is compared with: HTTP/JSON (FastAPI on uvicorn) and gRPC unary.

Servers (run in their own process by :mod:`bench.servers`):

* :func:`serve_http`: a FastAPI app on uvicorn (uvloop; httptools when
  installed, else h11) with ``POST /call`` taking ``{"method", "params"}``
  and answering ``{"result": ...}`` -- the shape of the HTTP tool servers
  other sandbox daemons run. Access logs are off.
* :func:`serve_grpc`: a ``grpc.aio`` server with one generic unary method
  ``/bench.Tool/Call`` whose request and response are raw bytes (msgpack of
  the call, msgpack of the result): no code generation, no protobuf work.

Clients (in the bench process, on its uvloop): :class:`HttpClient` (one
keep-alive ``httpx.AsyncClient``) and :class:`GrpcClient` (one
``grpc.aio`` channel).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec

GRPC_METHOD: Final = "/bench.Tool/Call"
_NIL_REPLY: Final = msgspec.msgpack.encode({"result": None})


def http_parser_name() -> str:
    """Which HTTP parser uvicorn uses here: httptools when installed, else h11."""
    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


def missing_packages() -> list[str]:
    """Baseline packages that are not installed (the bench cannot measure those rows)."""
    names = ("fastapi", "uvicorn", "httpx", "grpc")
    return [name for name in names if importlib.util.find_spec(name) is None]


async def serve_http(
    host: str, announce: Callable[[int], None], app: Any = None, **options: Any
) -> None:
    """Run an ASGI ``app`` on uvicorn until cancelled; ``announce(port)`` once it listens.

    ``app`` defaults to the FastAPI baseline (:mod:`bench.http_app`); ``options``
    go to ``uvicorn.Config`` (``ssl_certfile``, ``ssl_keyfile``, ...).
    """
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    sock.set_inheritable(True)
    if app is None:
        from bench.http_app import app

    config = uvicorn.Config(
        app,
        loop="none",
        http=http_parser_name(),
        access_log=False,
        log_level="warning",
        lifespan="off",
        **options,
    )
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            return
        await asyncio.sleep(0.01)
    announce(sock.getsockname()[1])
    await task


def _quiet_grpc() -> None:
    # The bench process forks servers and execd while grpc is loaded; grpc's
    # fork handlers are not needed (children exec at once) and only log noise.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


async def serve_grpc(host: str, announce: Callable[[int], None]) -> None:
    """Run the gRPC server until cancelled; ``announce(port)`` once it listens."""
    _quiet_grpc()
    import grpc  # type: ignore[import-untyped, unused-ignore]

    async def call(request: bytes, context: Any) -> bytes:
        body = msgspec.msgpack.decode(request)
        if isinstance(body, dict) and body.get("method") == "echo":
            return msgspec.msgpack.encode({"result": body.get("params")})
        return _NIL_REPLY

    handler = grpc.method_handlers_generic_handler(
        "bench.Tool", {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    announce(port)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(0)


class HttpClient:
    """A keep-alive httpx client of the FastAPI baseline."""

    def __init__(self, host: str, port: int) -> None:
        import httpx

        self._client = httpx.AsyncClient(
            base_url=f"http://{host}:{port}",
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            timeout=30.0,
        )

    async def call(self, method: str, params: Any = None) -> Any:
        """POST one call and return its decoded result."""
        response = await self._client.post("/call", json={"method": method, "params": params})
        response.raise_for_status()
        return response.json()["result"]

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()


class GrpcClient:
    """A grpc.aio channel to the gRPC baseline with one bytes-in, bytes-out unary method."""

    def __init__(self, host: str, port: int) -> None:
        _quiet_grpc()
        import grpc  # type: ignore[import-untyped, unused-ignore]

        self._channel = grpc.aio.insecure_channel(f"{host}:{port}")
        self._call: Callable[[bytes], Awaitable[bytes]] = self._channel.unary_unary(GRPC_METHOD)

    async def ready(self, timeout: float = 10.0) -> None:
        """Wait until the channel is connected."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    async def call(self, method: str, params: Any = None) -> Any:
        """One unary call: msgpack in, msgpack out."""
        reply = await self._call(msgspec.msgpack.encode({"method": method, "params": params}))
        return msgspec.msgpack.decode(reply)["result"]

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()
