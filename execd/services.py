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

* STARTING: spawned; ``services.start`` waits for the readiness probe
  (:mod:`execd.service_probes`), racing it against the process's exit and
  the probe's timeout. Exit first: EXITED and the start fails with
  ServiceFailed (log tail, exit status). Timeout: the service is stopped and
  the start fails with NotReady.
* RUNNING: ready. When the process exits, the restart policy decides:
  EXITED, or BACKOFF for ``backoff_initial * 2**restarts`` seconds (capped)
  and then a new instance (``restarts`` + 1), RUNNING again.
* ``services.stop`` (any state): no more restarts; the process group gets
  the signal, SIGKILL after the grace, and a sweep by the service's
  sub-marker kills descendants that left the group. A service that was
  live becomes STOPPED; an EXITED one stays EXITED.

Output: execd owns the read ends of the service's stdout and stderr pipes
(:class:`~execd.pipes.PipeReader` with a sink) and appends every chunk to the
service's :class:`~execd.service_log.LogFile` as it arrives, then wakes
whoever follows the log. ``services.logs`` reads the file itself, so memory
stays bounded whatever the service prints.

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
import secrets
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from execd import marker, pipes
from execd import spawn as spawning
from execd.budget import Budget
from execd.commands import (
    CommandCapability,
    close_each,
    command_argv,
    command_environment,
    title_of,
)
from execd.config import Config
from execd.context import CallContext
from execd.errors import (
    ExecdError,
    InvalidParams,
    LimitExceeded,
    NoSuchService,
    NotReady,
    ServiceExists,
    ServiceFailed,
    from_oserror,
)
from execd.fit import encoded_size, ensure_fits, fit_list, result_budget
from execd.service_log import FOLLOW_CHUNK, FOLLOW_POLL, LogFile, tail_start, tail_text
from execd.service_probes import Readiness, wait_ready
from protocol.rpc import services as rpc
from protocol.rpc.resources import Limits

log = logging.getLogger(__name__)

SERVICE_MARKER_VAR = "EXECD_SERVICE_MARKER"
"""Environment variable whose per-service value tags everything a service starts."""

_DIR_MODE = 0o700
_SWEEP_TIMEOUT = 5.0
_LIVE = frozenset({"starting", "running", "backoff"})
#: Room for what a service's info may gain while it runs (pid, times, exit, an error).
_INFO_SPARE = 512
#: Room for the fields of a result beside its list or its data.
_RESULT_FIELDS = 64


def _decode(status: int | None) -> tuple[int | None, int | None]:
    return (None, None) if status is None else spawning.decode_status(status)


def _describe(exit_code: int | None, sig: int | None) -> str:
    if sig is not None:
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit status {exit_code}"


# -- records ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Spec:
    """Everything needed to (re)start a service, validated."""

    argv: list[str]
    cwd: str | None
    env: Mapping[str, str]
    log_path: str
    readiness: Readiness | None
    restart: rpc.RestartPolicy
    title: str
    limits: Limits | None = None


@dataclass(eq=False, slots=True)
class _Instance:
    """One spawned process of a service."""

    child: spawning.Child
    readers: tuple[pipes.PipeReader, pipes.PipeReader]
    log_offset: int
    started: float


@dataclass(eq=False)
class _Service:
    """A service and its supervision state; see the module docstring."""

    name: str
    spec: _Spec
    log: LogFile
    sub_marker: str
    state: rpc.ServiceState = "starting"
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
    readers: set[pipes.PipeReader] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def live(self) -> bool:
        """Starting, running or waiting to restart."""
        return self.state in _LIVE

    def drained(self) -> bool:
        """Ended for good, and every pipe of every instance read to its end."""
        return not self.live and not self.readers

    def info(self) -> rpc.ServiceInfo:
        inst = self.instance
        info = rpc.ServiceInfo(
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
            if inst.child.limits is not None:
                info.limits = inst.child.limits.mechanisms
                info.limit_exceeded = inst.child.limits.exceeded
            if inst.child.running:
                info.uptime = max(0.0, time.monotonic() - inst.child.started)
        if self.finished is not None and not (inst is not None and inst.child.running):
            info.finished = self.finished
            info.exit_code, info.signal = self.exit_code, self.exit_signal
        return info


# -- the capability -----------------------------------------------------------------------


class ServicesCapability(CommandCapability):
    """``services.*`` methods over one process-wide table of named services."""

    rpcs = rpc.RPCS

    def __init__(
        self, config: Config, base_env: dict[str, str], processes: Budget | None = None
    ) -> None:
        super().__init__(config, base_env, "services", processes)
        self._services: dict[str, _Service] = {}

    async def close(self) -> None:
        """Stop every service (SIGTERM, grace, SIGKILL, sweep) and forget them all."""
        self._closed = True
        records = list(self._services.values())
        grace = self._limits.kill_grace
        await close_each(
            records,
            lambda rec: self._stop(rec, signal.SIGTERM, grace),
            lambda rec: f"stopping service {rec.name}",
        )
        await self._background.join()
        for rec in records:
            if rec.supervisor is not None and not rec.supervisor.done():
                rec.supervisor.cancel()
                await asyncio.gather(rec.supervisor, return_exceptions=True)
            for reader in list(rec.readers):
                reader.close()
            rec.log.close()
        self._services.clear()

    # -- helpers ---------------------------------------------------------------

    def _get(self, name: str) -> _Service:
        rec = self._services.get(name)
        if rec is None:
            raise NoSuchService(f"no service named {name!r}", {"name": name})
        return rec

    def _default_log(self, name: str) -> str:
        try:
            root = self._private_root()
        except OSError as exc:
            raise from_oserror(exc) from None
        return os.path.join(root, f"{name}.log")

    def _spec(self, params: rpc.StartParams, sub_marker: str) -> _Spec:
        argv = command_argv(params.argv, params.command)
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
        return _Spec(
            argv=argv,
            cwd=params.cwd,
            env=env,
            log_path=log_path,
            readiness=Readiness.of(params.probe),
            restart=params.restart or rpc.RestartPolicy(),
            title=title_of(argv),
            limits=params.limits,
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
        plan = self._resources.plan(spec.limits)
        try:
            child = self._counted(
                lambda: spawning.spawn(spec.argv, env=spec.env, cwd=spec.cwd, limits=plan)
            )
        except BaseException:
            if plan is not None:
                plan.release()
            raise
        readers = (
            pipes.PipeReader(child.stdout, sink=rec.log.write),
            pipes.PipeReader(child.stderr, sink=rec.log.write),
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
        self, rec: _Service, reader: pipes.PipeReader, _: asyncio.Future[None]
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

    async def _stop(self, rec: _Service, sig: int, grace: float) -> rpc.ServiceInfo:
        """Stop ``rec`` for good; see the module docstring."""
        async with rec.lock:
            rec.stopping = True
            inst = rec.instance
            was_live = rec.state == "backoff" or (inst is not None and inst.child.running)
            rec.wake.set()
            if inst is not None:
                await spawning.terminate_group(inst.child, grace, sig)
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

    async def _await_ready(self, rec: _Service, inst: _Instance) -> rpc.ServiceInfo:
        """Wait for the probe of a fresh start; fail and clean up as documented."""
        readiness = rec.spec.readiness
        generation = rec.generation
        if readiness is None:
            rec.ready = True
            rec.state = "running"
            rec.log.notify()
            return rec.info()
        exited = inst.child.exited
        spec = rec.spec
        task: asyncio.Task[None] = asyncio.ensure_future(
            wait_ready(readiness, rec.log, inst.log_offset, spec.env, spec.cwd, self._counted)
        )
        racing: set[asyncio.Future[Any]] = {task, exited}
        try:
            await asyncio.wait(racing, timeout=readiness.timeout, return_when="FIRST_COMPLETED")
        except asyncio.CancelledError:
            if rec.generation == generation:
                self._background.spawn(self._stop(rec, signal.SIGTERM, self._limits.kill_grace))
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
        timeout = readiness.timeout
        raise NotReady(
            f"service {rec.name!r} was not ready within {timeout:g} s; it was stopped",
            {"name": rec.name, "log_tail": tail_text(rec.log, inst.log_offset), "timeout": timeout},
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
                "log_tail": tail_text(rec.log, inst.log_offset),
                "exit_code": exit_code,
                "signal": sig,
            },
        )

    # -- services.start / restart ---------------------------------------------------

    async def services_start(self, params: rpc.StartParams, ctx: CallContext) -> rpc.ServiceInfo:
        """``services.start``: spawn a service and wait until it is ready."""
        self._check_open()
        sub_marker = secrets.token_hex(16)
        spec = self._spec(params, sub_marker)
        # Refused before anything starts if the reply could not carry the service's info.
        provisional = rpc.ServiceInfo(
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
            log_file = LogFile(spec.log_path)
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
        self, params: rpc.RestartParams, ctx: CallContext
    ) -> rpc.ServiceInfo:
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

    async def services_status(self, params: rpc.StatusParams, ctx: CallContext) -> rpc.ServiceInfo:
        """``services.status``: one service's state."""
        return self._get(params.name).info()

    async def services_list(self, params: rpc.ListParams, ctx: CallContext) -> rpc.ListResult:
        """``services.list``: every remembered service (as many as fit the reply)."""
        infos = [rec.info() for rec in self._services.values()]
        services, truncated = fit_list(infos, result_budget(ctx) - _RESULT_FIELDS)
        return rpc.ListResult(services=services, truncated=truncated)

    async def services_stop(self, params: rpc.StopParams, ctx: CallContext) -> rpc.ServiceInfo:
        """``services.stop``: signal, grace, SIGKILL of the group, sweep; the final state."""
        rec = self._get(params.name)
        ensure_fits(rec.info(), ctx, f"the info of service {rec.name!r}", spare=_INFO_SPARE)
        grace = self._limits.kill_grace if params.grace is None else params.grace
        return await self._stop(rec, params.signal, grace)

    # -- logs -----------------------------------------------------------------------------

    async def services_logs(self, params: rpc.LogsParams, ctx: CallContext) -> rpc.LogsResult:
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
                lines = rpc.DEFAULT_LOG_LINES
            start = floor if lines is None else tail_start(log_file, size, lines, floor)
            end = size
        if params.follow:
            return await self._follow(rec, start, ctx)
        # At most what fits the reply: the newest bytes of a tail, the first of a range.
        room = result_budget(ctx) - encoded_size(rpc.LogsResult(start=start, end=end, size=size))
        room -= _RESULT_FIELDS
        if end - start > room:
            if params.offset is None:
                start = end - max(room, 0)
            else:
                end = start + max(room, 0)
        data = log_file.pread(start, end - start)
        return rpc.LogsResult(start=start, end=start + len(data), size=size, data=data)

    async def _follow(self, rec: _Service, offset: int, ctx: CallContext) -> rpc.LogsResult:
        log_file = rec.log
        first = offset
        while not log_file.closed:
            waiter = log_file.changed()
            size = log_file.size()
            if size < offset:
                offset = 0
            if offset < size:
                data = log_file.pread(offset, min(size - offset, FOLLOW_CHUNK))
                if data:
                    await ctx.send(rpc.LOG_STREAM, data)
                    offset += len(data)
                    continue
            if rec.drained():
                if log_file.size() <= offset:
                    break
                continue
            await asyncio.wait({waiter}, timeout=FOLLOW_POLL)
        await ctx.send(rpc.LOG_STREAM, b"", end=True)
        return rpc.LogsResult(start=first, end=offset, size=log_file.size())


def _cap(nbytes: int | None) -> int:
    return rpc.MAX_LOG_READ if nbytes is None else min(nbytes, rpc.MAX_LOG_READ)


__all__ = ["SERVICE_MARKER_VAR", "ServicesCapability"]
