"""Run execd for the bench: start it with a token file, time its start, read its memory.

:func:`start_execd` launches ``python -m execd`` exactly as a launcher would
(a fresh 256-bit token in a new 0600 file that execd reads and deletes, a
fresh marker, a private state directory, a lease so a bench killed midway
leaves nothing running) and returns once the ``listening`` line has been read.
The time from just before the spawn to that line is the cold start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from harnessd.api import ExecdClient, connect

LEASE_SECONDS = 60.0


@dataclass
class ExecdProcess:
    """A running execd: where it listens, how to authenticate, how long it took to start."""

    host: str
    port: int
    token: str
    pid: int
    marker: str
    startup_seconds: float
    state_dir: str
    process: asyncio.subprocess.Process

    async def connect(self, *, encrypt: bool | str = False) -> ExecdClient:
        """A new authenticated client connection (no keepalive: the bench measures)."""
        return await connect(self.host, self.port, self.token, encrypt=encrypt, keepalive=None)


def read_status_kib(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` field in KiB (``VmRSS``, ``VmHWM``); 0 when unavailable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


@contextlib.asynccontextmanager
async def sampling_rss(pid: int, interval: float) -> AsyncIterator[list[float]]:
    """Sample a process's VmRSS (MiB) every ``interval`` seconds while the block runs."""
    samples: list[float] = []
    stop = asyncio.Event()

    async def sampler() -> None:
        while not stop.is_set():
            samples.append(read_status_kib(pid, "VmRSS") / 1024)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    task = asyncio.get_running_loop().create_task(sampler())
    try:
        yield samples
    finally:
        stop.set()
        await task


@contextlib.asynccontextmanager
async def start_execd(
    workdir: str, *extra: str, timeout: float = 30.0, wrapper: Sequence[str] = ()
) -> AsyncIterator[ExecdProcess]:
    """Run execd (cwd ``workdir``) until the block exits; then stop it and its marker.

    ``wrapper``: a command line execd's own runs under (a profiler, valgrind).
    """
    private = tempfile.mkdtemp(prefix="execd-bench-")
    token = secrets.token_hex(32)
    token_file = os.path.join(private, "token")
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    marker = secrets.token_hex(16)
    state_dir = os.path.join(private, "state")
    env = {k: v for k, v in os.environ.items() if k != "EXECD_TOKEN"}
    log_path = os.path.join(private, "execd.log")
    argv = [
        *wrapper,
        sys.executable,
        "-m",
        "execd",
        "--token-file",
        token_file,
        "--marker",
        marker,
        "--state-dir",
        state_dir,
        "--lease",
        str(LEASE_SECONDS),
        "--log-level",
        "WARNING",
        *extra,
    ]
    with _open_log(log_path) as log:
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            cwd=workdir,
            env=env,
        )
    try:
        event = await first_event(proc, timeout)
        elapsed = time.perf_counter() - started
        if event.get("event") != "listening":
            tail = _log_tail(log_path)
            raise RuntimeError(f"execd did not start ({event or 'no line'}):\n{tail}")
        yield ExecdProcess(
            host=str(event["host"]),
            port=int(event["port"]),
            token=token,
            pid=proc.pid,
            marker=marker,
            startup_seconds=elapsed,
            state_dir=state_dir,
            process=proc,
        )
    finally:
        await stop_process(proc, 20.0)
        with contextlib.suppress(OSError):
            os.unlink(token_file)
        _remove_tree(private)


async def first_event(proc: asyncio.subprocess.Process, timeout: float) -> dict[str, Any]:
    """The JSON line a child prints first on stdout (``listening``); {} when none comes in time."""
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    except TimeoutError:
        line = b""
    event: dict[str, Any] = json.loads(line) if line.strip() else {}
    return event


def _open_log(path: str) -> BinaryIO:
    return open(path, "wb")


def _log_tail(path: str) -> str:
    with open(path, "rb") as handle:
        return handle.read()[-4000:].decode("utf-8", "replace")


async def stop_process(proc: asyncio.subprocess.Process, grace: float) -> None:
    """SIGTERM ``proc`` unless it has exited, and SIGKILL it after ``grace`` seconds."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def _remove_tree(path: str) -> None:
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, name))
        for name in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)


async def time_interpreter_start(imports: str = "", timeout: float = 30.0) -> float:
    """Seconds from spawning ``python -c`` (importing ``imports``, then printing a line) to it."""
    script = (f"import {imports}; " if imports else "") + "print('{}', flush=True)"
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    await asyncio.wait_for(proc.stdout.readline(), timeout)
    elapsed = time.perf_counter() - started
    await proc.wait()
    return elapsed
