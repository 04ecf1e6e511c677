"""The MCP SDK's own client against ``harnessd mcp``, over a real stdio subprocess or real HTTP.

:func:`stdio_server` starts ``python -m harnessd mcp`` the way an agent CLI
does (the SDK's ``stdio_client``), with a private workspace and ledger
directory, and hands back a connected SDK ``Client`` and what the server
said on stderr (its pid, execd's marker). :func:`http_server` starts it with
``--transport http`` and connects with the bearer token.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
from mcp import StdioServerParameters, stdio_client
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client

from tests.support.cli import PROXY_VARS
from tests.support.procs import terminate

_ANNOUNCE = re.compile(r"harnessd mcp \(pid (\d+)\): execd at \S+ \(marker ([0-9a-f]+)\)")


@dataclass
class ServerLog:
    """What ``harnessd mcp`` wrote on stderr."""

    path: Path

    def text(self) -> str:
        return self.path.read_text(errors="replace")

    def _announced(self) -> re.Match[str]:
        deadline = time.monotonic() + 30
        while (found := _ANNOUNCE.search(self.text())) is None:
            assert time.monotonic() < deadline, f"no announcement on stderr:\n{self.text()}"
            time.sleep(0.02)
        return found

    @property
    def pid(self) -> int:
        """The server's pid."""
        return int(self._announced().group(1))

    @property
    def marker(self) -> str:
        """The marker of the execd the server launched."""
        return self._announced().group(2)


def server_args(tmp_path: Path, *args: str) -> list[str]:
    """``-m harnessd mcp`` with a private workspace under ``tmp_path``.

    An execd it launches (no ``--port`` in ``args``) keeps its ledgers there too.
    """
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    own = ["--workspace", str(workspace)]
    if "--port" not in args:
        own += ["--execd", f"{sys.executable} -m execd --state-dir {tmp_path / 'state'}"]
    return ["-m", "harnessd", "mcp", *own, *args]


def server_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the server gets: this one without proxies, TMPDIR inside the test's."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    env["TMPDIR"] = str(tmp_path)
    env.update(extra or {})
    return env


@contextlib.asynccontextmanager
async def stdio_server(
    tmp_path: Path, *args: str, mode: str = "legacy", **client_options: Any
) -> AsyncIterator[tuple[Client, ServerLog]]:
    """An SDK client connected over stdio to a fresh ``harnessd mcp ARGS``."""
    log = ServerLog(tmp_path / "server.log")
    params = StdioServerParameters(
        command=sys.executable,
        args=server_args(tmp_path, *args),
        env=server_env(tmp_path),
        cwd=str(tmp_path),
    )
    with log.path.open("a") as errlog:
        async with Client(
            stdio_client(params, errlog=errlog), mode=mode, **client_options
        ) as client:
            yield client, log


@dataclass
class HttpServer:
    """A ``harnessd mcp --transport http`` process and its endpoint."""

    proc: subprocess.Popen[str]
    url: str
    token: str
    log: ServerLog

    def client(self, *, mode: str = "legacy", token: str | None = None, **options: Any) -> Client:
        """An SDK client of the endpoint, sending ``token`` (default: the right one)."""
        headers = {"Authorization": f"Bearer {token if token is not None else self.token}"}
        http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60.0, read=300.0))
        transport = streamable_http_client(self.url, http_client=http)
        return Client(transport, mode=mode, **options)


@contextlib.contextmanager
def http_server(tmp_path: Path, *args: str, token: str) -> Iterator[HttpServer]:
    """``harnessd mcp --transport http --http-port 0 ARGS``, the token in its environment."""
    log = ServerLog(tmp_path / "server.log")
    with log.path.open("a") as errlog:
        proc = subprocess.Popen(
            [
                sys.executable,
                *server_args(tmp_path, "--transport", "http", "--http-port", "0", *args),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errlog,
            text=True,
            env=server_env(tmp_path, {"HARNESSD_MCP_TOKEN": token}),
            cwd=str(tmp_path),
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the server ended before listening:\n{log.text()}"
        event = json.loads(line)
        assert event["event"] == "listening", event
        yield HttpServer(proc, event["url"], token, log)
    finally:
        terminate(proc, timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def text_of(result: Any) -> str:
    """The text of a tool result's first content block."""
    return str(result.content[0].text)
