"""The ``services`` capability: named long-lived processes under supervision.

Life of one service (:class:`_Service`)::

    services.start ─spawn─► STARTING ──probe succeeds──► RUNNING ◄──spawn again──┐
                              │  │                          │ exits               │
                              │  │                          ▼                     │
                              │  │          a failure, restarts left? ─yes─► BACKOFF
                              │  │                          │ no           (delay)
                              │  └──exits first──────────► EXITED
                              └──probe times out──► stop ─► STOPPED
    services.stop, from any live state ──────────────────► STOPPED

* STARTING: spawned; ``services.start`` waits for the readiness probe,
  racing it against the process's exit and the probe's timeout. Exit first:
  EXITED and the start fails with ServiceFailed (log tail, exit status).
  Timeout: the service is stopped and the start fails with NotReady.
* RUNNING: ready. When the process exits, the restart policy decides:
  EXITED, or BACKOFF for ``backoff_initial * 2**restarts`` seconds (capped)
  and then a new instance (``restarts`` + 1), RUNNING again.
* ``services.stop`` (any state): no more restarts; the process group gets
  the signal, SIGKILL after the grace, and a sweep by the service's
  sub-marker kills descendants that left the group. A service that was
  live becomes STOPPED; an EXITED one stays EXITED.

Output: execd owns the read ends of the service's stdout and stderr pipes
(:class:`~execd.spawn.PipeReader` with a sink) and appends every chunk to the
log file as it arrives, then wakes whoever follows the log. ``services.logs``
reads the file itself (tails by reading backwards from the end), so memory
stays bounded whatever the service prints. Followers also poll the file size
every :data:`_FOLLOW_POLL` seconds, so bytes written to the log by other
means are seen too.

Every service process (and its probe commands) carries the daemon's marker
and :data:`SERVICE_MARKER_VAR` set to a value of its own, so the capability's
``close()`` and the daemon's marker cleanup both reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import secrets
import shlex
import signal
import stat
import tempfile
import time
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from execd import marker
from execd import spawn as spawning
from execd.config import Config
from execd.context import CallContext, Method
from execd.errors import (
    ExecdError,
    InvalidParams,
    LimitExceeded,
    NoSuchService,
    NotReady,
    NotSupported,
    ServiceExists,
    ServiceFailed,
    ShuttingDown,
    from_oserror,
)
from execd.fit import encoded_size, ensure_fits, fit_list, result_budget
from protocol.api import services as api

log = logging.getLogger(__name__)

SERVICE_MARKER_VAR = "EXECD_SERVICE_MARKER"
"""Environment variable whose per-service value tags everything a service starts."""

_SHELL = "/bin/sh"
_LOG_MODE = 0o600
_DIR_MODE = 0o700
_TITLE_MAX = 1024
_TAIL_LINES = 20
_TAIL_BYTES = 8192
_READ_BLOCK = 64 * 1024
_FOLLOW_CHUNK = 256 * 1024
_FOLLOW_POLL = 0.25
_LINE_CAP = 64 * 1024
_SWEEP_TIMEOUT = 5.0
_MAX_ATTEMPT_CONNECT = 2.0
_LIVE = frozenset({"starting", "running", "backoff"})
#: Room for what a service's info may gain while it runs (pid, times, exit, an error).
_INFO_SPARE = 512
#: Room for the fields of a result beside its list or its data.
_RESULT_FIELDS = 64


# -- helpers shared with the sessions capability ----------------------------------


def command_environment(
    base: Mapping[str, str],
    protected: Iterable[str],
    env: Mapping[str, str] | None,
    unset: Iterable[str] | None,
    extra: Mapping[str, str],
) -> dict[str, str]:
    """``base`` with ``unset`` removed and ``env`` then ``extra`` applied.

    Names in ``protected`` (the marker variables) may be neither set nor
    unset by the caller. Protected and ``extra`` names come first in the
    result, so a bounded read of ``/proc/PID/environ`` always reaches them.
    """
    guarded = list(protected)
    result = dict(base)
    for name in unset or ():
        if name in guarded:
            raise InvalidParams(f"{name} cannot be unset")
        result.pop(name, None)
    for name, value in (env or {}).items():
        if name in guarded:
            raise InvalidParams(f"{name[:64]} cannot be overridden")
        if "=" in name or "\0" in name:
            raise InvalidParams(f"invalid environment variable name: {name[:64]!r}")
        if "\0" in value:
            raise InvalidParams(f"environment variable {name[:64]} contains a NUL")
        result[name] = value
    result.update(extra)
    first = [name for name in dict.fromkeys((*guarded, *extra)) if name in result]
    ordered = {name: result.pop(name) for name in first}
    ordered.update(result)
    return ordered


def private_root(config: Config, kind: str) -> str:
    """A directory only this user can enter: ``<state_dir>/<kind>``, or a fresh temporary one."""
    if config.state_dir:
        path = os.path.join(config.state_dir, kind)
        os.makedirs(path, mode=_DIR_MODE, exist_ok=True)
        return path
    return tempfile.mkdtemp(prefix=f"execd-{kind}-")


def title_of(argv: list[str]) -> str:
    """A one-line description of a command, bounded in length."""
    text = argv[2] if argv[:2] == [_SHELL, "-c"] and len(argv) == 3 else shlex.join(argv)
    return text if len(text) <= _TITLE_MAX else text[: _TITLE_MAX - 1] + "…"


def _discard(_: bytes) -> None:
    """Sink of a probe command's output."""


def _decode(status: int | None) -> tuple[int | None, int | None]:
    return (None, None) if status is None else spawning.decode_status(status)


def _describe(exit_code: int | None, sig: int | None) -> str:
    if sig is not None:
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit status {exit_code}"


# -- the log file -----------------------------------------------------------------------


class _LogFile:
    """A service's log: appended to from its pipes, read back by offset.

    One descriptor, opened ``O_RDWR | O_APPEND``, serves both: writes always
    land at the end, reads use ``pread``. ``changed()`` is a future resolved
    at the next :meth:`notify` (every write, and every change of the
    service's state), shared by every waiter.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
        fd = os.open(path, flags, _LOG_MODE)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotSupported(f"a service log must be a regular file: {path}", {"path": path})
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self.error: str | None = None

    @property
    def closed(self) -> bool:
        """Whether the descriptor is closed (reads return nothing)."""
        return self._fd < 0

    def write(self, data: bytes) -> None:
        """Append ``data``; a failing write (disk full) drops it and is remembered."""
        if self._fd < 0:
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            if self.error is None:
                log.warning("cannot write the service log %s: %s", self.path, exc.strerror)
            self.error = exc.strerror or "write failed"
        self.notify()

    def size(self) -> int:
        """The file's current size (0 once closed)."""
        if self._fd < 0:
            return 0
        try:
            return os.fstat(self._fd).st_size
        except OSError:
            return 0

    def pread(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (fewer at the end of the file)."""
        if self._fd < 0 or length <= 0:
            return b""
        try:
            return os.pread(self._fd, length, offset)
        except OSError:
            return b""

    def changed(self) -> asyncio.Future[None]:
        """A future resolved at the next :meth:`notify`."""
        if self._waiter is None:
            self._waiter = self._loop.create_future()
        return self._waiter

    def notify(self) -> None:
        """Wake every waiter of :meth:`changed`."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Close the descriptor and wake waiters."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.notify()


def tail_start(log_file: _LogFile, size: int, lines: int, floor: int) -> int:
    """Offset where the last ``lines`` lines of the bytes ``[floor, size)`` begin.

    Reads backwards from ``size`` a block at a time. A newline that is the
    very last byte ends the last line rather than starting an empty one.
    Returns ``floor`` when fewer lines fit between ``floor`` and ``size``.
    """
    if lines <= 0 or size <= floor:
        return size
    found = 0
    pos = size
    while pos > floor:
        low = max(floor, pos - _READ_BLOCK)
        block = log_file.pread(low, pos - low)
        end = len(block)
        while True:
            index = block.rfind(b"\n", 0, end)
            if index < 0:
                break
            end = index
            if low + index == size - 1:
                continue
            found += 1
            if found == lines:
                return low + index + 1
        pos = low
    return floor


# -- records ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Spec:
    """Everything needed to (re)start a service, validated."""

    argv: list[str]
    cwd: str | None
    env: dict[str, str]
    log_path: str
    probe: api.Probe | None
    pattern: re.Pattern[str] | None
    probe_argv: list[str] | None
    restart: api.RestartPolicy
    title: str


@dataclass(eq=False, slots=True)
class _Instance:
    """One spawned process of a service."""

    child: spawning.Child
    readers: tuple[spawning.PipeReader, spawning.PipeReader]
    log_offset: int
    started: float


@dataclass(eq=False)
class _Service:
    """A service and its supervision state; see the module docstring."""

    name: str
    spec: _Spec
    log: _LogFile
    sub_marker: str
    state: api.ServiceState = "starting"
    instance: _Instance | None = None
    restarts: int = 0
    ready: bool = False
    stopping: bool = False
    generation: int = 0
    exit_code: int | None = None
    exit_signal: int | None = None
    finished: float | None = None
    error: str | None = None
    supervisor: asyncio.Task[None] | None = None
    readers: set[spawning.PipeReader] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def live(self) -> bool:
        """Starting, running or waiting to restart."""
        return self.state in _LIVE

    def drained(self) -> bool:
        """Ended for good, and every pipe of every instance read to its end."""
        return not self.live and not self.readers

    def info(self) -> api.ServiceInfo:
        inst = self.instance
        info = api.ServiceInfo(
            name=self.name,
            state=self.state,
            title=self.spec.title,
            log_path=self.log.path,
            restarts=self.restarts,
            ready=self.ready,
            log_size=self.log.size(),
            error=self.error or self.log.error,
        )
        if inst is not None:
            info.pid = inst.child.pid
            info.started = inst.started
            if inst.child.running:
                info.uptime = max(0.0, time.monotonic() - inst.child.started)
        if self.finished is not None and not (inst is not None and inst.child.running):
            info.finished = self.finished
            info.exit_code, info.signal = self.exit_code, self.exit_signal
        return info


# -- the capability -----------------------------------------------------------------------


class ServicesCapability:
    """``services.*`` methods over one process-wide table of named services.

    ``base_env`` is the environment services start from; it carries the
    daemon's marker variable, which calls may neither override nor unset.
    """

    def __init__(self, config: Config, base_env: dict[str, str]) -> None:
        self._config = config
        self._limits = config.limits
        self._marker_var = config.marker_var
        self._base_env = dict(base_env)
        self._services: dict[str, _Service] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._log_dir: str | None = None
        self._closed = False

    def methods(self) -> list[Method]:
        """The dispatch table entries of this capability."""
        return [
            Method(api.START, api.StartParams, self.services_start),
            Method(api.STATUS, api.StatusParams, self.services_status),
            Method(api.LOGS, api.LogsParams, self.services_logs),
            Method(api.STOP, api.StopParams, self.services_stop),
            Method(api.RESTART, api.RestartParams, self.services_restart),
            Method(api.LIST, api.ListParams, self.services_list),
        ]

    async def close(self) -> None:
        """Stop every service (SIGTERM, grace, SIGKILL, sweep) and forget them all."""
        self._closed = True
        records = list(self._services.values())
        grace = self._limits.kill_grace
        results = await asyncio.gather(
            *(self._stop(rec, signal.SIGTERM, grace) for rec in records), return_exceptions=True
        )
        for rec, result in zip(records, results, strict=True):
            if isinstance(result, BaseException):
                log.error("stopping service %s failed", rec.name, exc_info=result)
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for rec in records:
            if rec.supervisor is not None and not rec.supervisor.done():
                rec.supervisor.cancel()
                await asyncio.gather(rec.supervisor, return_exceptions=True)
            for reader in list(rec.readers):
                reader.close()
            rec.log.close()
        self._services.clear()

    # -- helpers ---------------------------------------------------------------

    def _spawn_background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("services background task failed", exc_info=task.exception())

    def _check_open(self) -> None:
        if self._closed:
            raise ShuttingDown("the services capability is closed")

    def _get(self, name: str) -> _Service:
        rec = self._services.get(name)
        if rec is None:
            raise NoSuchService(f"no service named {name!r}", {"name": name})
        return rec

    def _default_log(self, name: str) -> str:
        if self._log_dir is None:
            try:
                self._log_dir = private_root(self._config, "services")
            except OSError as exc:
                raise from_oserror(exc) from None
        return os.path.join(self._log_dir, f"{name}.log")

    def _spec(self, params: api.StartParams, sub_marker: str) -> _Spec:
        if (params.argv is None) == (params.command is None):
            raise InvalidParams("exactly one of argv and command is required")
        argv = [_SHELL, "-c", params.command] if params.command is not None else params.argv
        assert argv is not None
        if not argv[0]:
            raise InvalidParams("argv[0] must not be empty")
        env = command_environment(
            self._base_env,
            (self._marker_var, SERVICE_MARKER_VAR),
            params.env,
            params.unset,
            {SERVICE_MARKER_VAR: sub_marker},
        )
        if params.log is not None:
            base = params.cwd or os.getcwd()
            log_path = os.path.abspath(os.path.join(base, params.log))
        else:
            log_path = self._default_log(params.name)
        pattern: re.Pattern[str] | None = None
        probe_argv: list[str] | None = None
        probe = params.probe
        if isinstance(probe, api.LogProbe):
            try:
                pattern = re.compile(probe.pattern)
            except re.error as exc:
                raise InvalidParams(f"invalid log probe pattern: {exc}") from None
        elif isinstance(probe, api.CommandProbe):
            if (probe.argv is None) == (probe.command is None):
                raise InvalidParams("a command probe needs exactly one of argv and command")
            probe_argv = [_SHELL, "-c", probe.command] if probe.command is not None else probe.argv
            assert probe_argv is not None
            if not probe_argv[0]:
                raise InvalidParams("the probe's argv[0] must not be empty")
        return _Spec(
            argv=list(argv),
            cwd=params.cwd,
            env=env,
            log_path=log_path,
            probe=probe,
            pattern=pattern,
            probe_argv=probe_argv,
            restart=params.restart or api.RestartPolicy(),
            title=title_of(list(argv)),
        )

    def _make_room(self) -> None:
        limit = self._limits.max_services
        if len(self._services) < limit:
            return
        for rec in self._services.values():
            if not rec.live and not rec.lock.locked():
                self._forget(rec)
                return
        raise LimitExceeded(f"too many services (limit {limit})", {"limit": limit})

    def _forget(self, rec: _Service) -> None:
        if self._services.get(rec.name) is rec:
            del self._services[rec.name]
        rec.generation += 1
        for reader in list(rec.readers):
            reader.close()
        rec.log.close()

    # -- spawning and supervision ------------------------------------------------

    def _spawn_instance(self, rec: _Service) -> _Instance:
        spec = rec.spec
        offset = rec.log.size()
        child = spawning.spawn(spec.argv, env=spec.env, cwd=spec.cwd)
        readers = (
            spawning.PipeReader(child.stdout, sink=rec.log.write),
            spawning.PipeReader(child.stderr, sink=rec.log.write),
        )
        for reader in readers:
            rec.readers.add(reader)
            reader.eof.add_done_callback(functools.partial(self._reader_done, rec, reader))
        inst = _Instance(child=child, readers=readers, log_offset=offset, started=time.time())
        rec.instance = inst
        rec.state = "running" if rec.ready else "starting"
        rec.log.notify()
        return inst

    def _reader_done(
        self, rec: _Service, reader: spawning.PipeReader, _: asyncio.Future[None]
    ) -> None:
        rec.readers.discard(reader)
        rec.log.notify()

    def _launch(self, rec: _Service) -> _Instance:
        """Spawn a fresh start of ``rec`` and its supervisor (raises SpawnFailed)."""
        rec.generation += 1
        rec.stopping = False
        rec.ready = False
        rec.restarts = 0
        rec.error = None
        rec.exit_code = rec.exit_signal = None
        rec.finished = None
        rec.wake.clear()
        inst = self._spawn_instance(rec)
        rec.supervisor = asyncio.ensure_future(self._supervise(rec, rec.generation))
        return inst

    async def _supervise(self, rec: _Service, generation: int) -> None:
        """Watch the instances of one start of ``rec``; restart them per the policy."""
        policy = rec.spec.restart
        while True:
            inst = rec.instance
            assert inst is not None
            status = await asyncio.shield(inst.child.exited)
            if rec.generation != generation:
                return
            rec.exit_code, rec.exit_signal = spawning.decode_status(status)
            rec.finished = time.time()
            failed = rec.exit_signal is not None or rec.exit_code != 0
            if (
                rec.stopping
                or not rec.ready
                or not failed
                or policy.policy != "on-failure"
                or rec.restarts >= policy.max_restarts
            ):
                rec.state = "exited"
                rec.log.notify()
                await self._settle(rec)
                return
            delay = min(policy.backoff_max, policy.backoff_initial * 2 ** min(rec.restarts, 60))
            rec.state = "backoff"
            rec.log.notify()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rec.wake.wait(), delay)
            if rec.generation != generation:
                return
            if rec.stopping:
                rec.state = "stopped"
                rec.log.notify()
                return
            rec.restarts += 1
            try:
                self._spawn_instance(rec)
            except ExecdError as exc:
                rec.error = f"restart failed: {exc.message}"
                rec.state = "exited"
                rec.log.notify()
                return

    async def _settle(self, rec: _Service) -> None:
        """Let the pipes drain; close those still held open after the drain grace."""
        grace = self._limits.drain_grace
        pending = [r.eof for r in rec.readers if not r.eof.done()]
        if pending:
            await asyncio.wait(pending, timeout=grace)
        for reader in list(rec.readers):
            if not reader.eof.done() and not reader.writer_gone():
                reader.close()
        rest = [r.eof for r in rec.readers if not r.eof.done()]
        if rest:
            await asyncio.wait(rest, timeout=grace)
        for reader in list(rec.readers):
            reader.close()

    async def _kill_group(self, child: spawning.Child, sig: int, grace: float) -> None:
        """``sig`` to the group, SIGKILL whatever outlives ``grace``; wait for the reaping."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if (child.running or child.group_alive()) and child.signal_and_continue(sig):
            if child.running and grace > 0:
                await asyncio.wait({child.exited}, timeout=grace)
            delay = 0.01
            while loop.time() < deadline and child.group_alive():
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(delay * 2, 0.1)
            if child.group_alive():
                child.signal(signal.SIGKILL)
        await asyncio.wait({child.exited})

    async def _sweep(self, rec: _Service) -> None:
        """Kill every process still carrying the service's sub-marker."""
        try:
            report = await marker.cleanup_async(
                SERVICE_MARKER_VAR, rec.sub_marker, timeout=_SWEEP_TIMEOUT
            )
        except (OSError, RuntimeError) as exc:
            log.warning("sweeping service %s failed: %s", rec.name, exc)
            return
        if report.remaining:
            log.warning("service %s: processes %s survived the sweep", rec.name, report.remaining)

    async def _stop(self, rec: _Service, sig: int, grace: float) -> api.ServiceInfo:
        """Stop ``rec`` for good; see the module docstring."""
        async with rec.lock:
            rec.stopping = True
            inst = rec.instance
            was_live = rec.state == "backoff" or (inst is not None and inst.child.running)
            rec.wake.set()
            if inst is not None:
                await self._kill_group(inst.child, sig, grace)
            await self._sweep(rec)
            supervisor = rec.supervisor
            if supervisor is not None and not supervisor.done():
                await asyncio.wait({supervisor})
            await self._settle(rec)
            if was_live:
                rec.state = "stopped"
            rec.log.notify()
            return rec.info()

    # -- readiness -----------------------------------------------------------------

    async def _await_ready(self, rec: _Service, inst: _Instance) -> api.ServiceInfo:
        """Wait for the probe of a fresh start; fail and clean up as documented."""
        probe = rec.spec.probe
        generation = rec.generation
        if probe is None:
            rec.ready = True
            rec.state = "running"
            rec.log.notify()
            return rec.info()
        exited = inst.child.exited
        task: asyncio.Task[None] = asyncio.ensure_future(self._probe(rec, inst, probe))
        racing: set[asyncio.Future[Any]] = {task, exited}
        try:
            await asyncio.wait(racing, timeout=probe.timeout, return_when="FIRST_COMPLETED")
        except asyncio.CancelledError:
            if rec.generation == generation:
                self._spawn_background(self._stop(rec, signal.SIGTERM, self._limits.kill_grace))
            raise
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if rec.generation != generation:
            raise ServiceFailed(f"service {rec.name!r} was replaced while starting")
        if exited.done() or rec.stopping:
            stopped = rec.stopping
            await self._stop(rec, signal.SIGTERM, self._limits.kill_grace)
            raise self._failure(rec, inst, stopped)
        if not task.cancelled() and task.exception() is None:
            rec.ready = True
            rec.state = "running"
            rec.log.notify()
            return rec.info()
        await self._stop(rec, signal.SIGTERM, self._limits.kill_grace)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
        raise NotReady(
            f"service {rec.name!r} was not ready within {probe.timeout:g} s; it was stopped",
            {"name": rec.name, "log_tail": self._tail_text(rec, inst), "timeout": probe.timeout},
        )

    def _failure(self, rec: _Service, inst: _Instance, stopped: bool) -> ServiceFailed:
        exit_code, sig = _decode(inst.child.exited.result() if inst.child.exited.done() else None)
        if stopped:
            what = "was stopped before it became ready"
        else:
            what = f"exited before it became ready ({_describe(exit_code, sig)})"
        return ServiceFailed(
            f"service {rec.name!r} {what}",
            {
                "name": rec.name,
                "log_tail": self._tail_text(rec, inst),
                "exit_code": exit_code,
                "signal": sig,
            },
        )

    def _tail_text(self, rec: _Service, inst: _Instance) -> str:
        """The last lines this start wrote to the log, as text."""
        size = rec.log.size()
        floor = max(inst.log_offset, size - _TAIL_BYTES)
        start = tail_start(rec.log, size, _TAIL_LINES, floor)
        return rec.log.pread(start, size - start).decode("utf-8", "replace")

    async def _probe(self, rec: _Service, inst: _Instance, probe: api.Probe) -> None:
        """Return once the probe succeeds (runs until cancelled otherwise)."""
        if isinstance(probe, api.TcpProbe):
            await self._probe_tcp(probe)
        elif isinstance(probe, api.LogProbe):
            assert rec.spec.pattern is not None
            await self._probe_log(rec.log, inst.log_offset, rec.spec.pattern)
        else:
            assert rec.spec.probe_argv is not None
            await self._probe_command(rec.spec, rec.spec.probe_argv, probe)

    async def _probe_tcp(self, probe: api.TcpProbe) -> None:
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

    async def _probe_log(self, log_file: _LogFile, offset: int, pattern: re.Pattern[str]) -> None:
        partial = b""
        while True:
            waiter = log_file.changed()
            size = log_file.size()
            while offset < size:
                chunk = log_file.pread(offset, min(size - offset, _FOLLOW_CHUNK))
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
            await asyncio.wait({waiter}, timeout=_FOLLOW_POLL)

    async def _probe_command(self, spec: _Spec, argv: list[str], probe: api.CommandProbe) -> None:
        while True:
            child = spawning.spawn(argv, env=spec.env, cwd=spec.cwd)
            readers = (
                spawning.PipeReader(child.stdout, sink=_discard),
                spawning.PipeReader(child.stderr, sink=_discard),
            )
            try:
                await asyncio.wait({child.exited}, timeout=probe.attempt_timeout)
                if child.exited.done() and _decode(child.exited.result()) == (0, None):
                    return
            finally:
                if child.running:
                    child.signal(signal.SIGKILL)
                    await asyncio.wait({child.exited})
                for reader in readers:
                    reader.close()
            await asyncio.sleep(probe.interval)

    # -- services.start / restart ---------------------------------------------------

    async def services_start(self, params: api.StartParams, ctx: CallContext) -> api.ServiceInfo:
        """``services.start``: spawn a service and wait until it is ready."""
        self._check_open()
        sub_marker = secrets.token_hex(16)
        spec = self._spec(params, sub_marker)
        # Refused before anything starts if the reply could not carry the service's info.
        provisional = api.ServiceInfo(
            name=params.name, state="starting", title=spec.title, log_path=spec.log_path
        )
        ensure_fits(provisional, ctx, f"the info of service {params.name!r}", spare=_INFO_SPARE)
        existing = self._services.get(params.name)
        if existing is not None:
            if existing.live or existing.lock.locked():
                raise ServiceExists(
                    f"service {params.name!r} is {existing.state}", {"name": params.name}
                )
            self._forget(existing)
        self._make_room()
        try:
            os.makedirs(os.path.dirname(spec.log_path), mode=_DIR_MODE, exist_ok=True)
            log_file = _LogFile(spec.log_path)
        except OSError as exc:
            raise from_oserror(exc, spec.log_path) from None
        rec = _Service(name=params.name, spec=spec, log=log_file, sub_marker=sub_marker)
        try:
            inst = self._launch(rec)
        except BaseException:
            log_file.close()
            raise
        self._services[params.name] = rec
        return await self._await_ready(rec, inst)

    async def services_restart(
        self, params: api.RestartParams, ctx: CallContext
    ) -> api.ServiceInfo:
        """``services.restart``: stop, then start again with the same parameters."""
        self._check_open()
        rec = self._get(params.name)
        ensure_fits(rec.info(), ctx, f"the info of service {rec.name!r}", spare=_INFO_SPARE)
        await self._stop(rec, signal.SIGTERM, self._limits.kill_grace)
        async with rec.lock:
            if self._services.get(params.name) is not rec or rec.live:
                raise ServiceExists(
                    f"service {params.name!r} was started again meanwhile", {"name": params.name}
                )
            self._check_open()
            inst = self._launch(rec)
        return await self._await_ready(rec, inst)

    # -- status / list / stop -----------------------------------------------------------

    async def services_status(self, params: api.StatusParams, ctx: CallContext) -> api.ServiceInfo:
        """``services.status``: one service's state."""
        return self._get(params.name).info()

    async def services_list(self, params: api.ListParams, ctx: CallContext) -> api.ListResult:
        """``services.list``: every remembered service (as many as fit the reply)."""
        infos = [rec.info() for rec in self._services.values()]
        services, truncated = fit_list(infos, result_budget(ctx) - _RESULT_FIELDS)
        return api.ListResult(services=services, truncated=truncated)

    async def services_stop(self, params: api.StopParams, ctx: CallContext) -> api.ServiceInfo:
        """``services.stop``: signal, grace, SIGKILL of the group, sweep; the final state."""
        rec = self._get(params.name)
        ensure_fits(rec.info(), ctx, f"the info of service {rec.name!r}", spare=_INFO_SPARE)
        grace = self._limits.kill_grace if params.grace is None else params.grace
        return await self._stop(rec, params.signal, grace)

    # -- logs -----------------------------------------------------------------------------

    async def services_logs(self, params: api.LogsParams, ctx: CallContext) -> api.LogsResult:
        """``services.logs``: a tail or range of the log, or a live follow."""
        rec = self._get(params.name)
        if params.offset is not None and params.lines is not None:
            raise InvalidParams("offset and lines are exclusive")
        log_file = rec.log
        size = log_file.size()
        if params.offset is not None:
            start = min(params.offset, size)
            end = size if params.follow else min(size, start + _cap(params.nbytes))
        elif params.lines is None and params.nbytes is None and params.follow:
            start = end = size
        else:
            floor = max(0, size - _cap(params.nbytes))
            lines = params.lines
            if lines is None and params.nbytes is None:
                lines = api.DEFAULT_LOG_LINES
            start = floor if lines is None else tail_start(log_file, size, lines, floor)
            end = size
        if params.follow:
            return await self._follow(rec, start, ctx)
        # At most what fits the reply: the newest bytes of a tail, the first of a range.
        room = result_budget(ctx) - encoded_size(api.LogsResult(start=start, end=end, size=size))
        room -= _RESULT_FIELDS
        if end - start > room:
            if params.offset is None:
                start = end - max(room, 0)
            else:
                end = start + max(room, 0)
        data = log_file.pread(start, end - start)
        return api.LogsResult(start=start, end=start + len(data), size=size, data=data)

    async def _follow(self, rec: _Service, offset: int, ctx: CallContext) -> api.LogsResult:
        log_file = rec.log
        first = offset
        while not log_file.closed:
            waiter = log_file.changed()
            size = log_file.size()
            if size < offset:
                offset = 0
            if offset < size:
                data = log_file.pread(offset, min(size - offset, _FOLLOW_CHUNK))
                if data:
                    await ctx.send(api.LOG_STREAM, data)
                    offset += len(data)
                    continue
            if rec.drained():
                if log_file.size() <= offset:
                    break
                continue
            await asyncio.wait({waiter}, timeout=_FOLLOW_POLL)
        await ctx.send(api.LOG_STREAM, b"", end=True)
        return api.LogsResult(start=first, end=offset, size=log_file.size())


def _cap(nbytes: int | None) -> int:
    return api.MAX_LOG_READ if nbytes is None else min(nbytes, api.MAX_LOG_READ)


__all__ = [
    "SERVICE_MARKER_VAR",
    "ServicesCapability",
    "command_environment",
    "private_root",
    "tail_start",
    "title_of",
]
