"""Section 12: SWE-ReX, the peer most often picked for this job, beside execd on the same operations.

SWE-ReX (PyPI ``swe-rex``, in the ``bench`` extra; never imported by
``harnessd``) runs a FastAPI server in the sandbox (``swerex-remote``) and
drives it with ``RemoteRuntime`` over HTTP. This section runs that server
app in a process of its own, as ``swerex-remote`` runs it (``swerex.server``
on uvicorn; the bench passes the token on stdin and binds port 0 rather than
using the command line, which would show the token), and times in
interleaved batches, client on the bench's uvloop:

* a no-op: ``is_alive`` beside execd's ``server.noop``;
* ``true`` as a subprocess: ``execute(Command(["true"]))`` beside ``shell.run``;
* ``true`` in a persistent shell: ``run_in_session(BashAction("true"))``
  beside ``sessions.run``;
* a 4 KiB file read (text: SWE-ReX moves strings) beside ``files.read``;
* a 4 KiB file written then read back (SWE-ReX writes in place without
  fsync) beside ``files.write`` (``atomic=False``, the same semantics) +
  ``files.read``.

When SWE-ReX's client cannot be imported (it is not installed, or aiohttp,
which it needs but does not declare, is missing) the section is skipped and
the report says why; an operation SWE-ReX fails leaves its rows out, also
said in the report (:mod:`bench.peers`).

``python -m bench.swerex_peer`` is the server (it reads the token as the
first line of stdin, prints ``{"event": "listening", "port": N}`` and serves
until SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import secrets
import socket
import sys
from collections.abc import AsyncIterator
from typing import Final

from bench.env import Env
from bench.execd_proc import ExecdProcess, start_execd
from bench.peers import Operation, Peer
from bench.report import Row
from bench.settings import HOST
from bench.stats import Call
from harnessd.cli_bench import install_command

PEER: Final = Peer(
    section="12. SWE-ReX (swerex-remote + RemoteRuntime) beside execd, same operations",
    prefix="swerex",
    name="SWE-ReX",
    key="swerex",
    operations=(
        Operation("noop", "no-op (execd server.noop; SWE-ReX is_alive)", 600, 20),
        Operation("true", "`true` as a command (execd shell.run; SWE-ReX execute)", 200, 10),
        Operation(
            "session",
            "`true` in a persistent shell (execd sessions.run; SWE-ReX run_in_session)",
            40,
            4,
        ),
        Operation("read", "4 KiB file read (execd files.read; SWE-ReX read_file)", 200, 10),
        Operation("files", "4 KiB file written in place then read back", 200, 10),
    ),
)
SECTION: Final = PEER.section
SIZE: Final = 4096
ROW_KEYS: Final = PEER.row_keys


def unavailable() -> str | None:
    """Why SWE-ReX cannot be measured here, or None when it can."""
    try:
        importlib.import_module("swerex.runtime.remote")
    except ImportError as exc:
        return f"SWE-ReX's client cannot be imported ({exc}); install the bench extra: {install_command()}"
    return None


def serve() -> None:
    """The SWE-ReX server app on uvicorn, token from stdin, on a port the kernel picks."""
    import uvicorn
    from swerex import server

    server.AUTH_TOKEN = sys.stdin.readline().strip()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    sock.listen(1024)
    sys.stdout.write(json.dumps({"event": "listening", "port": sock.getsockname()[1]}) + "\n")
    sys.stdout.flush()
    config = uvicorn.Config(server.app, log_level="warning", access_log=False, loop="uvloop")
    uvicorn.Server(config).run(sockets=[sock])


@contextlib.asynccontextmanager
async def _server(workdir: str) -> AsyncIterator[tuple[int, str]]:
    token = secrets.token_hex(32)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.swerex_peer",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=workdir,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(token.encode() + b"\n")
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line:
            raise RuntimeError("the SWE-ReX server did not start")
        yield int(json.loads(line)["port"]), token
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def run(env: Env) -> list[Row]:
    """Both peers on each operation, interleaved; no rows (and why, in the report) without SWE-ReX."""
    reason = unavailable()
    if reason is not None:
        env.skip(SECTION, reason)
        return []
    text = "x" * (SIZE - 1) + "\n"
    path = env.path("swerex-file.txt")
    # An execd of its own: the shared one's lease may have run out during section 9.
    try:
        async with start_execd(env.workdir) as execd:
            return await _measure(env, execd, path, text)
    except Exception as exc:
        # A peer's failure (SWE-ReX's session times out waiting for its prompt on a
        # loaded machine) leaves its rows out, not the whole run's.
        env.skip(SECTION, f"SWE-ReX failed, rows left out: {exc!r}")
        return []


async def _measure(env: Env, execd: ExecdProcess, path: str, text: str) -> list[Row]:
    from swerex.runtime.abstract import (
        BashAction,
        Command,
        CreateBashSessionRequest,
        ReadFileRequest,
        WriteFileRequest,
    )
    from swerex.runtime.remote import RemoteRuntime

    data = text.encode()
    client = await execd.connect()
    try:
        async with _server(env.workdir) as (port, token):
            rex = RemoteRuntime(host=f"http://{HOST}", port=port, auth_token=token, timeout=60)
            await rex.wait_until_alive(timeout=60)
            await rex.create_session(CreateBashSessionRequest(session="bench"))
            await client.open_session("bench-swerex")

            async def rex_read() -> object:
                got = await rex.read_file(ReadFileRequest(path=path))
                if got.content != text:
                    raise RuntimeError("SWE-ReX read back other content")
                return got

            async def rex_files() -> object:
                await rex.write_file(WriteFileRequest(path=path, content=text))
                return await rex_read()

            async def execd_read() -> object:
                if await client.read_file(path) != data:
                    raise RuntimeError("execd read back other content")
                return None

            async def execd_files() -> object:
                # SWE-ReX writes in place without fsync: the same as atomic=False.
                await client.write_file(path, data, atomic=False)
                return await execd_read()

            async def rex_true() -> object:
                return await rex.execute(Command(command=["true"], shell=False))

            async def execd_true() -> object:
                return await client.run(["true"])

            async def rex_session() -> object:
                action = BashAction(command="true", session="bench", timeout=60)
                return await rex.run_in_session(action)

            async def execd_session() -> object:
                return await client.session_run("bench-swerex", "true")

            await client.write_file(path, data, atomic=False)
            pairs: dict[str, tuple[Call, Call]] = {
                "noop": (client.noop, rex.is_alive),
                "true": (execd_true, rex_true),
                "session": (execd_session, rex_session),
                "read": (execd_read, rex_read),
                "files": (execd_files, rex_files),
            }
            rows: list[Row] = []
            for op in PEER.operations:
                # SWE-ReX waits 0.1 s for its shell's prompt, which a loaded machine
                # can miss: that operation's rows are left out, and the report says so.
                rows += await PEER.measure(env, op, *pairs[op.key])
            with contextlib.suppress(Exception):
                await rex.close()
    finally:
        await client.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return rows


if __name__ == "__main__":
    serve()
