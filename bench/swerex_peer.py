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
* a 4 KiB file written then read back (text: SWE-ReX moves strings, and
  writes in place without fsync) beside ``files.write`` (``atomic=False``,
  the same semantics) + ``files.read``.

Without SWE-ReX installed the section is skipped with one line on stderr and
its rows are absent.

``python -m bench.swerex_peer`` is the server (it reads the token as the
first line of stdin, prints ``{"event": "listening", "port": N}`` and serves
until SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import secrets
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any, Final

from bench.env import Env
from bench.execd_proc import ExecdProcess, start_execd
from bench.report import Row
from bench.settings import HOST
from bench.stats import Call, interleaved, summarize

SECTION: Final = "12. SWE-ReX (swerex-remote + RemoteRuntime) beside execd, same operations"
SIZE: Final = 4096
#: (key, what it measures) in table order; each has an execd row and a SWE-ReX row.
OPERATIONS: Final = (
    ("noop", "no-op (execd server.noop; SWE-ReX is_alive)"),
    ("true", "`true` as a command (execd shell.run; SWE-ReX execute)"),
    ("session", "`true` in a persistent shell (execd sessions.run; SWE-ReX run_in_session)"),
    ("files", "4 KiB file written in place then read back"),
)
ROW_KEYS: Final = tuple(f"swerex.{op}.{who}" for op, _ in OPERATIONS for who in ("execd", "swerex"))


def installed() -> bool:
    """Whether SWE-ReX can be measured here."""
    return importlib.util.find_spec("swerex") is not None


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
    """Both peers on each operation, interleaved; empty when SWE-ReX is not installed."""
    if not installed():
        print(
            "bench: SWE-ReX not installed, section 11 skipped (pip install -e '.[bench]')",
            file=sys.stderr,
        )
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
        print(f"bench: SWE-ReX section failed, rows left out: {exc!r}", file=sys.stderr)
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

            async def rex_files() -> object:
                await rex.write_file(WriteFileRequest(path=path, content=text))
                got = await rex.read_file(ReadFileRequest(path=path))
                if got.content != text:
                    raise RuntimeError("SWE-ReX read back other content")
                return got

            async def execd_files() -> object:
                # SWE-ReX writes in place without fsync: the same as atomic=False.
                await client.write_file(path, data, atomic=False)
                if await client.read_file(path) != data:
                    raise RuntimeError("execd read back other content")
                return None

            async def rex_true() -> object:
                return await rex.execute(Command(command=["true"], shell=False))

            async def execd_true() -> object:
                return await client.run(["true"])

            async def rex_session() -> object:
                action = BashAction(command="true", session="bench", timeout=60)
                return await rex.run_in_session(action)

            async def execd_session() -> object:
                return await client.session_run("bench-swerex", "true")

            pairs: dict[str, tuple[Call, Call]] = {
                "noop": (client.noop, rex.is_alive),
                "true": (execd_true, rex_true),
                "session": (execd_session, rex_session),
                "files": (execd_files, rex_files),
            }
            counts = _counts(env.settings.quick)
            rows: list[Row] = []
            for op, label in OPERATIONS:
                execd_call, rex_call = pairs[op]
                try:
                    samples = await interleaved(
                        {"execd": execd_call, "swerex": rex_call},
                        {"execd": counts[op], "swerex": counts[op]},
                        rounds=max(2, counts[op] // 25),
                        warmup=3,
                    )
                except Exception as exc:
                    # SWE-ReX waits 0.1 s for its shell's prompt, which a loaded
                    # machine can miss: that operation's rows are left out.
                    print(f"bench: SWE-ReX {op} failed, rows left out: {exc!r}", file=sys.stderr)
                    continue
                rows += _rows(op, label, samples)
            with contextlib.suppress(Exception):
                await rex.close()
    finally:
        await client.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return rows


def _counts(quick: bool) -> dict[str, int]:
    if quick:
        return {"noop": 20, "true": 10, "session": 4, "files": 10}
    return {"noop": 600, "true": 200, "session": 40, "files": 200}


def _rows(op: str, label: str, samples: dict[str, list[float]]) -> list[Row]:
    execd, rex = (
        summarize([s / 1000 for s in samples["execd"]]),
        summarize([s / 1000 for s in samples["swerex"]]),
    )
    common: dict[str, Any] = {"section": SECTION, "unit": "ms"}
    return [
        Row(
            key=f"swerex.{op}.execd",
            label=f"execd: {label}",
            short="execd",
            **execd.figures(),
            **common,
        ),
        Row(
            key=f"swerex.{op}.swerex",
            label=f"SWE-ReX: {label}",
            **rex.figures(),
            baselines=(f"swerex.{op}.execd",),
            **common,
        ),
    ]


if __name__ == "__main__":
    serve()
