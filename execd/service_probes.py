"""Readiness probes: how ``services.start`` learns that a service is ready.

A probe is validated once, when the service is started (:meth:`Readiness.of`),
and run for every fresh start by :func:`wait_ready`, which returns once the
probe succeeds and otherwise runs until its caller cancels it (the caller
races it against the process's exit and the probe's timeout):

* ``tcp``: a connection to ``host:port`` succeeds; each attempt is bounded
  and failures are retried every ``interval``;
* ``log``: a line the service wrote since this start matches the pattern;
  an unfinished line is tried once everything written so far has been read,
  and one longer than :data:`_LINE_CAP` is tried and dropped;
* ``command``: a command, run with the service's environment and working
  directory, exits 0 within ``attempt_timeout``; a slower attempt is killed
  and the next one starts after ``interval``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from execd import pipes
from execd import spawn as spawning
from execd.commands import command_argv
from execd.errors import InvalidParams
from execd.service_log import FOLLOW_CHUNK, FOLLOW_POLL, LogFile
from protocol.rpc import services as rpc

_LINE_CAP = 64 * 1024
Counted = Callable[[Callable[[], spawning.Child]], spawning.Child]
"""Starts a process within execd's process budget (``CommandCapability._counted``)."""
_MAX_ATTEMPT_CONNECT = 2.0


@dataclass(frozen=True, slots=True)
class Readiness:
    """A validated probe: the log pattern compiled, the command's argv built."""

    probe: rpc.Probe
    pattern: re.Pattern[str] | None = None
    argv: list[str] | None = None

    @classmethod
    def of(cls, probe: rpc.Probe | None) -> Readiness | None:
        """Validate ``probe`` (raises InvalidParams); ``None`` for no probe."""
        if isinstance(probe, rpc.LogProbe):
            try:
                return cls(probe, pattern=re.compile(probe.pattern))
            except re.error as exc:
                raise InvalidParams(f"invalid log probe pattern: {exc}") from None
        if isinstance(probe, rpc.CommandProbe):
            return cls(probe, argv=command_argv(probe.argv, probe.command, "a command probe"))
        return None if probe is None else cls(probe)

    @property
    def timeout(self) -> float:
        """Seconds the service has to become ready."""
        return self.probe.timeout


async def wait_ready(
    readiness: Readiness,
    log_file: LogFile,
    log_offset: int,
    env: Mapping[str, str],
    cwd: str | None,
    counted: Counted,
) -> None:
    """Return once the probe succeeds (runs until cancelled otherwise).

    ``log_offset`` is where this start's output begins in ``log_file``;
    ``env`` and ``cwd`` are the service's, for a command probe, which
    ``counted`` starts within the process budget (its failure to find room,
    PROCESS_LIMIT, fails the probe).
    """
    probe = readiness.probe
    if isinstance(probe, rpc.TcpProbe):
        await _probe_tcp(probe)
    elif isinstance(probe, rpc.LogProbe):
        assert readiness.pattern is not None
        await _probe_log(log_file, log_offset, readiness.pattern)
    else:
        assert isinstance(probe, rpc.CommandProbe) and readiness.argv is not None
        await _probe_command(readiness.argv, probe, env, cwd, counted)


async def _probe_tcp(probe: rpc.TcpProbe) -> None:
    attempt = min(_MAX_ATTEMPT_CONNECT, max(probe.interval, 0.5))
    while True:
        try:
            async with asyncio.timeout(attempt):
                _, writer = await asyncio.open_connection(probe.host, probe.port)
        except (OSError, TimeoutError):
            await asyncio.sleep(probe.interval)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


async def _probe_log(log_file: LogFile, offset: int, pattern: re.Pattern[str]) -> None:
    partial = b""
    while True:
        waiter = log_file.changed()
        size = log_file.size()
        while offset < size:
            chunk = log_file.pread(offset, min(size - offset, FOLLOW_CHUNK))
            if not chunk:
                break
            offset += len(chunk)
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            for line in lines:
                if pattern.search(line.decode("utf-8", "replace")):
                    return
            if len(partial) > _LINE_CAP:
                if pattern.search(partial.decode("utf-8", "replace")):
                    return
                partial = b""
        if partial and pattern.search(partial.decode("utf-8", "replace")):
            return
        await asyncio.wait({waiter}, timeout=FOLLOW_POLL)


def _discard(_: bytes) -> None:
    """Sink of a probe command's output."""


async def _probe_command(
    argv: list[str],
    probe: rpc.CommandProbe,
    env: Mapping[str, str],
    cwd: str | None,
    counted: Counted,
) -> None:
    while True:
        child = counted(lambda: spawning.spawn(argv, env=env, cwd=cwd))
        readers = (
            pipes.PipeReader(child.stdout, sink=_discard),
            pipes.PipeReader(child.stderr, sink=_discard),
        )
        try:
            await asyncio.wait({child.exited}, timeout=probe.attempt_timeout)
            if child.exited.done() and spawning.decode_status(child.exited.result()) == (0, None):
                return
        finally:
            if child.running:
                child.signal(signal.SIGKILL)
                await asyncio.wait({child.exited})
            for reader in readers:
                reader.close()
        await asyncio.sleep(probe.interval)
