"""Baseline servers in their own processes, so each gets a core as execd does.

``python -m bench.servers KIND`` runs one kind on uvloop, prints one JSON line
``{"event": "listening", "ports": {...}}`` and serves until its stdin closes
or it gets SIGTERM:

* ``raw [--scratch DIR]``: the floor RPC (:class:`bench.floor.FloorServer`,
  port ``rpc``) and the bulk pipe (:class:`bench.floor.BulkServer`, port
  ``bulk``; file uploads go to DIR);
* ``http``: FastAPI on uvicorn (port ``http``);
* ``chat [--tls-dir DIR]``: a canned chat-completions endpoint on uvicorn
  (:mod:`bench.chat_app`, port ``chat``; HTTPS with DIR's ``cert.pem`` and
  ``key.pem``);
* ``grpc``: grpc.aio generic unary (port ``grpc``);
* ``proxy --target HOST:PORT --delay SECONDS``: the delay proxy (port ``proxy``).

:func:`start_server` runs one from the bench and stops it on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvloop

from bench.execd_proc import first_event, stop_process
from bench.floor import BulkServer, FloorServer

HOST = "127.0.0.1"


def _announce(ports: dict[str, int]) -> None:
    sys.stdout.write(json.dumps({"event": "listening", "ports": ports}) + "\n")
    sys.stdout.flush()


async def _until_stopped() -> None:
    """Return when stdin reaches EOF or SIGTERM/SIGINT arrives."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    def stdin_readable() -> None:
        try:
            data = os.read(sys.stdin.fileno(), 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(sys.stdin.fileno())
            stop.set()

    os.set_blocking(sys.stdin.fileno(), False)
    loop.add_reader(sys.stdin.fileno(), stdin_readable)
    await stop.wait()


async def _serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    kind: str = args.kind
    if kind == "raw":
        rpc = await loop.create_server(FloorServer, HOST, 0, backlog=1024)
        scratch: str | None = args.scratch
        bulk = await loop.create_server(lambda: BulkServer(scratch), HOST, 0, backlog=1024)
        _announce(
            {"rpc": rpc.sockets[0].getsockname()[1], "bulk": bulk.sockets[0].getsockname()[1]}
        )
        await _until_stopped()
        rpc.close()
        bulk.close()
        return
    if kind == "proxy":
        from bench.delay_proxy import DelayProxy

        host, _, port = str(args.target).rpartition(":")
        proxy = DelayProxy((host, int(port)), float(args.delay))
        _announce({"proxy": await proxy.start(HOST)})
        await _until_stopped()
        await proxy.close()
        return
    from bench import baselines

    def announce(port: int) -> None:
        _announce({kind: port})

    if kind == "chat":
        from bench.chat_app import app

        # Keep-alive connections stay open however long a loaded machine stalls the bench.
        options: dict[str, Any] = {"timeout_keep_alive": 600}
        if args.tls_dir:
            options["ssl_certfile"] = os.path.join(args.tls_dir, "cert.pem")
            options["ssl_keyfile"] = os.path.join(args.tls_dir, "key.pem")
        task = loop.create_task(baselines.serve_http(HOST, announce, app, **options))
    else:
        serve = baselines.serve_http if kind == "http" else baselines.serve_grpc
        task = loop.create_task(serve(HOST, announce))
    stopper = loop.create_task(_until_stopped())
    await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        stopper.cancel()
        task.result()
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.servers``."""
    parser = argparse.ArgumentParser(prog="python -m bench.servers", description=__doc__)
    parser.add_argument("kind", choices=("raw", "http", "grpc", "chat", "proxy"))
    parser.add_argument("--target", help="HOST:PORT the proxy forwards to")
    parser.add_argument("--delay", type=float, default=0.0125, help="proxy delay each way (s)")
    parser.add_argument("--scratch", help="directory for the raw server's file uploads")
    parser.add_argument("--tls-dir", help="chat: serve HTTPS with cert.pem and key.pem from here")
    args = parser.parse_args(argv)
    if args.kind == "proxy" and not args.target:
        parser.error("proxy needs --target HOST:PORT")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(args))
    return 0


@dataclass
class ServerProcess:
    """A running baseline server: its ports and pid."""

    kind: str
    ports: dict[str, int]
    pid: int


@contextlib.asynccontextmanager
async def start_server(
    kind: str, *args: str, timeout: float = 60.0
) -> AsyncIterator[ServerProcess]:
    """Run ``python -m bench.servers KIND ARGS`` until the block exits."""
    with tempfile.TemporaryFile() as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.servers",
            kind,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )
        try:
            event = await first_event(proc, timeout)
            if event.get("event") != "listening":
                log.seek(0)
                tail = log.read()[-4000:].decode("utf-8", "replace")
                raise RuntimeError(f"bench server {kind!r} did not start:\n{tail}")
            ports = {str(k): int(v) for k, v in event["ports"].items()}
            yield ServerProcess(kind=kind, ports=ports, pid=proc.pid)
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            await stop_process(proc, 10.0)


if __name__ == "__main__":
    sys.exit(main())
