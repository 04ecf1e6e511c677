"""What MCP adds to one tool call: through ``harnessd mcp`` versus the client library.

    python -m bench.mcp_call [--samples N] [--warmup N] [--no-http]

One execd is started on this machine. The client library (``ExecdClient``)
and ``harnessd mcp`` (connected to that same execd with ``--port``) then make
the same calls, interleaved, one at a time:

* ``read_file``: a 1 KiB file (``client.read_file`` / the read_file tool);
* ``shell``: ``true`` through ``/bin/sh -c`` (``client.run`` / the shell tool).

The MCP side is the SDK's own client over stdio (a ``harnessd mcp``
subprocess, the way agent CLIs run it) and, unless ``--no-http``, over
streamable HTTP on loopback. Printed per call and path: p50, p99 and mean in
milliseconds, and the ratio of MCP's p50 to the library's. The MCP figures
include what every MCP tool call costs here: JSON-RPC over the transport,
argument decoding, the session ledger's record, the result's text.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TextIO

import anyio

from bench.execd_proc import start_execd, stop_process
from bench.stats import summarize
from harnessd.api import ExecdClient

FILE_BYTES = 1024


@dataclass(frozen=True)
class Path_:
    """One way to make the calls: a name and, per call kind, a coroutine function."""

    name: str
    calls: dict[str, Callable[[], Awaitable[object]]]


def _library(client: ExecdClient, path: str) -> Path_:
    async def read() -> object:
        return await client.read_file(path, length=256 * 1024 + 1)

    async def shell() -> object:
        return await client.run(command="true", timeout=120.0, output_cap=64_000)

    return Path_("library", {"read_file": read, "shell": shell})


def _through_mcp(name: str, client: Any, path: str) -> Path_:
    async def call(tool: str, arguments: dict[str, Any]) -> object:
        result = await client.call_tool(tool, arguments)
        if result.is_error:
            raise RuntimeError(f"{tool} failed: {result.content[0].text}")
        return result

    async def read() -> object:
        return await call("read_file", {"path": path})

    async def shell() -> object:
        return await call("shell", {"command": "true"})

    return Path_(name, {"read_file": read, "shell": shell})


def _write(path: str, data: bytes) -> str:
    """Write ``data`` to a new 0600 file at ``path``; return the path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return path


def _devnull() -> TextIO:
    return open(os.devnull, "w")


def _server_argv(workspace: str, port: int, token_file: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "harnessd", "mcp", "--workspace", workspace,
        "--port", str(port), "--token-file", token_file, *extra,
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def _stdio(argv: list[str], errlog: TextIO) -> AsyncIterator[Any]:
    from mcp import StdioServerParameters, stdio_client
    from mcp.client import Client

    params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ))
    async with Client(stdio_client(params, errlog=errlog), mode="legacy") as client:
        yield client


@contextlib.asynccontextmanager
async def _http(argv: list[str]) -> AsyncIterator[Any]:
    import httpx2
    from mcp.client import Client
    from mcp.client.streamable_http import streamable_http_client

    token = secrets.token_hex(32)
    proc = await asyncio.create_subprocess_exec(
        *argv,
        "--transport",
        "http",
        "--http-port",
        "0",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "HARNESSD_MCP_TOKEN": token},
    )
    try:
        assert proc.stdout is not None
        url = json.loads(await proc.stdout.readline())["url"]
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60.0)
        async with Client(streamable_http_client(url, http_client=http), mode="legacy") as client:
            yield client
    finally:
        await stop_process(proc, 30.0)


async def _measure(
    paths: list[Path_], samples: int, warmup: int
) -> dict[str, dict[str, list[float]]]:
    timings: dict[str, dict[str, list[float]]] = {p.name: {} for p in paths}
    for kind in paths[0].calls:
        for index in range(warmup + samples):
            for path in paths:  # interleaved: drift hits every path alike
                started = time.perf_counter()
                await path.calls[kind]()
                elapsed = (time.perf_counter() - started) * 1000.0
                if index >= warmup:
                    timings[path.name].setdefault(kind, []).append(elapsed)
    return timings


async def run(samples: int, warmup: int, http: bool) -> list[str]:
    """Measure and return the report's lines."""
    workspace = tempfile.mkdtemp(prefix="bench-mcp-")
    try:
        return await _run_in(workspace, samples, warmup, http)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


async def _run_in(workspace: str, samples: int, warmup: int, http: bool) -> list[str]:
    target = _write(os.path.join(workspace, "data.txt"), b"x" * FILE_BYTES)
    async with start_execd(workspace) as execd, contextlib.AsyncExitStack() as stack:
        client = await execd.connect()
        stack.push_async_callback(client.close)
        # harnessd mcp reads the token from a 0600 file, removed once both servers are up.
        token_file = _write(os.path.join(workspace, ".token"), execd.token.encode())
        argv = _server_argv(workspace, execd.port, token_file)
        quiet = stack.enter_context(_devnull())
        paths = [_library(client, target)]
        stdio = await stack.enter_async_context(_stdio(argv, quiet))
        paths.append(_through_mcp("mcp stdio", stdio, target))
        if http:
            over_http = await stack.enter_async_context(_http(argv))
            paths.append(_through_mcp("mcp http", over_http, target))
        os.unlink(token_file)
        timings = await _measure(paths, samples, warmup)
    lines = [f"one tool call, {samples} samples each (ms): p50 p99 mean, and p50 / library's p50"]
    for kind in paths[0].calls:
        base = summarize(timings["library"][kind])
        for path in paths:
            got = summarize(timings[path.name][kind])
            lines.append(
                f"{kind:10s} {path.name:10s} p50 {got.p50:7.3f}  p99 {got.p99:7.3f}  "
                f"mean {got.mean:7.3f}  x{got.p50 / base.p50:.1f}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry of ``python -m bench.mcp_call``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--no-http", action="store_true", help="skip streamable HTTP")
    args = parser.parse_args(argv)
    lines = anyio.run(
        run, args.samples, args.warmup, not args.no_http, backend_options={"use_uvloop": True}
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
