"""The ``shell`` capability: run commands, stream or collect output, detach them.

Life of one command (:class:`_Command`)::

    spawn ──► RUNNING ──exit──────────────────────────────► DRAINING ──► DONE
                 │                                              ▲
                 └─timeout / idle─► TERMINATING (SIGTERM, ──────┘
                                    kill_grace, SIGKILL)

* RUNNING: wait for the child's exit, the hard deadline (``timeout`` after
  spawn) or the idle deadline (``idle_timeout`` after the latest output; a
  stream blocked on the client's flow control does not count as idle).
* TERMINATING: the whole process group gets SIGTERM (and SIGCONT), then
  SIGKILL if anything in it outlives ``kill_grace``; ends when the child is
  reaped.
* DRAINING: output keeps flowing until both pipes reach EOF. If that takes
  longer than ``drain_grace``, a pipe whose write ends are all closed is
  still read to its end (the client is merely slow to take it); a pipe
  something else still holds open is closed and the result says
  ``pipes_held_open``.
* DONE: every byte read has been delivered (streamed, or in the collected
  buffers); the result is built.

At any point, cancellation of the handler task or the close of the call's
connection *aborts*: SIGTERM to the group right away, SIGKILL after
``kill_grace`` in a background task the capability keeps (and awaits on
:meth:`ShellCapability.close`).

Detached commands run the same machine in a background task with their
output going to bounded rings (:class:`~execd.output.ByteRing`) that
``shell.attach`` replays and follows. A finished record is dropped when a
client reads its final status (``status``, ``wait`` or a completed
``attach``) or ``detached_retention`` seconds after it finished.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from execd import commands, pipes
from execd import spawn as spawning
from execd.budget import Budget
from execd.commands import CommandCapability, command_argv, command_environment, title_of
from execd.config import Config
from execd.context import CallContext, ConnectionLost
from execd.errors import (
    AlreadyAttached,
    AlreadyExited,
    InvalidParams,
    LimitExceeded,
    NoSuchProcess,
)
from execd.fit import CAPTURE_FIELDS, encoded_size, ensure_fits, fit_list, result_budget
from execd.output import ByteRing, HeadTailBuffer, fit_pair
from protocol.rpc import shell as rpc
from protocol.rpc.resources import LimitName, Mechanism

log = logging.getLogger(__name__)

_ATTACH_READ = 1024 * 1024
#: Room for what a command's info gains once it has exited, and for the attach result around it.
_ATTACH_SPARE = 160
#: Room for the fields of a list result beside its items.
_LIST_FIELDS = 32
_VALID_SIGNALS = frozenset(int(s) for s in signal.valid_signals()) | {0}


@dataclass(frozen=True, slots=True)
class _Options:
    timeout: float | None
    idle_timeout: float | None
    drain_grace: float
    kill_grace: float


@dataclass(frozen=True, slots=True)
class _Outcome:
    status: int
    duration: float
    timed_out: bool
    idle_out: bool
    pipes_held_open: bool
    limit_exceeded: LimitName | None = None
    limits: dict[LimitName, Mechanism] | None = None

    def exit(self) -> tuple[int | None, int | None]:
        return spawning.decode_status(self.status)

    def report(self, result: rpc.RunResult | rpc.CommandInfo) -> None:
        """Say how the command ended in ``result``: a run's result, a detached command's info."""
        result.exit_code, result.signal = self.exit()
        result.duration = self.duration
        result.timed_out = self.timed_out
        result.idle_out = self.idle_out
        result.pipes_held_open = self.pipes_held_open
        result.limit_exceeded = self.limit_exceeded
        result.limits = self.limits


Spawner = Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]
#: Finds a running call by its request id: the connection id and call id its handler was
#: given (:meth:`execd.requests.RequestTable.locate`), None when no such call runs.
CallLocator = Callable[[bytes], tuple[int, int] | None]


def _locate_nothing(rid: bytes) -> tuple[int, int] | None:
    return None


class _Command:
    """One spawned command under supervision; see the module docstring."""

    def __init__(
        self,
        child: spawning.Child,
        opts: _Options,
        background: Spawner,
        *,
        sinks: tuple[Callable[[bytes], None], Callable[[bytes], None]] | None,
        stream_ctx: CallContext | None,
    ) -> None:
        self.child = child
        self.opts = opts
        self._background = background
        self._ctx = stream_ctx
        self._killer: asyncio.Task[None] | None = None
        self._stdin_task: asyncio.Task[None] | None = None
        self._sending = 0
        self._sent_at = 0.0
        self._send_error: BaseException | None = None
        self._spawned_at = asyncio.get_running_loop().time()
        if sinks is None:
            self.readers = (
                pipes.PipeReader(child.stdout),
                pipes.PipeReader(child.stderr),
            )
            self._pumps: list[asyncio.Task[None]] = [
                asyncio.ensure_future(self._pump(self.readers[0], rpc.STDOUT_STREAM)),
                asyncio.ensure_future(self._pump(self.readers[1], rpc.STDERR_STREAM)),
            ]
        else:
            self.readers = (
                pipes.PipeReader(child.stdout, sink=sinks[0]),
                pipes.PipeReader(child.stderr, sink=sinks[1]),
            )
            self._pumps = []

    # -- stdin -----------------------------------------------------------------

    def feed_stdin(self, data: bytes | None, ctx: CallContext | None) -> None:
        """Start writing ``data``, or the client's stdin stream, to the child."""
        fd = self.child.stdin
        if fd is None:
            return
        if ctx is not None:
            self._stdin_task = asyncio.ensure_future(self._feed_stream(ctx))
            return
        view = memoryview(data or b"")
        try:
            view = view[os.write(fd, view) :] if view else view
        except BlockingIOError:
            pass
        except OSError:
            view = view[:0]
        if not view:
            self.child.close_stdin()
            return
        self._stdin_task = asyncio.ensure_future(self._feed_bytes(view))

    async def _feed_bytes(self, view: memoryview) -> None:
        fd = self.child.stdin
        try:
            if fd is not None:
                await pipes.write_all(fd, view)
        finally:
            self.child.close_stdin()

    async def _feed_stream(self, ctx: CallContext) -> None:
        try:
            async for chunk in ctx.receive(rpc.STDIN_STREAM):
                fd = self.child.stdin
                if fd is None or not await pipes.write_all(fd, chunk):
                    break
        except (ConnectionLost, OSError) as exc:
            log.debug("stdin stream of pid %d ended: %r", self.child.pid, exc)
        finally:
            self.child.close_stdin()

    # -- output ----------------------------------------------------------------

    async def _pump(self, reader: pipes.PipeReader, stream: str) -> None:
        assert self._ctx is not None
        loop = asyncio.get_running_loop()
        while True:
            data = await reader.read()
            if not data:
                return
            if self._send_error is not None:
                continue
            self._sending += 1
            try:
                await self._ctx.send(stream, data)
            except Exception as exc:
                # The client cannot take output any more: stop the command.
                self._send_error = exc
                self.abort()
                for r in self.readers:
                    r.close()
            finally:
                self._sending -= 1
                self._sent_at = loop.time()

    def _last_activity(self) -> float:
        return max(self.readers[0].last_data, self.readers[1].last_data, self._sent_at)

    # -- supervision -----------------------------------------------------------

    async def supervise(self) -> _Outcome:
        """Run the command to DONE (module docstring) and describe how it ended."""
        reason = await self._wait_exit()
        if reason is not None:
            await self._terminate()
        held = await self._drain()
        if self._pumps:
            await asyncio.gather(*self._pumps)
            if self._send_error is not None:
                raise self._send_error
            assert self._ctx is not None
            await self._ctx.send(rpc.STDOUT_STREAM, b"", end=True)
            await self._ctx.send(rpc.STDERR_STREAM, b"", end=True)
        child = self.child
        plan = child.limits
        return _Outcome(
            status=child.exited.result(),
            duration=max(0.0, child.ended - child.started),
            timed_out=reason == "timeout",
            idle_out=reason == "idle",
            pipes_held_open=held,
            limit_exceeded=plan.exceeded if plan is not None else None,
            limits=plan.mechanisms if plan is not None else None,
        )

    async def _wait_exit(self) -> str | None:
        exited = self.child.exited
        timeout, idle = self.opts.timeout, self.opts.idle_timeout
        if timeout is None and idle is None:
            await self.child.wait()
            return None
        loop = asyncio.get_running_loop()
        deadline = self._spawned_at + timeout if timeout is not None else math.inf
        while not exited.done():
            now = loop.time()
            if now >= deadline:
                return "timeout"
            wake = deadline
            if idle is not None:
                if self._sending:
                    wake = min(wake, now + idle)
                else:
                    idle_at = self._last_activity() + idle
                    if now >= idle_at:
                        return "idle"
                    wake = min(wake, idle_at)
            await asyncio.wait({exited}, timeout=wake - now)
        return None

    async def _terminate(self) -> None:
        self.abort()
        if self._killer is not None:
            await asyncio.shield(self._killer)
        else:
            await self.child.wait()

    async def _drain(self) -> bool:
        pending = [r for r in self.readers if not r.eof.done()]
        if not pending:
            return False
        await asyncio.wait([r.eof for r in pending], timeout=self.opts.drain_grace)
        held = False
        for reader in pending:
            if not reader.eof.done() and not reader.writer_gone():
                held = True
                reader.close()
        rest = [r.eof for r in pending if not r.eof.done()]
        if rest:
            await asyncio.wait(rest)
        return held

    def abort(self) -> None:
        """Stop the command: SIGTERM its group now, SIGKILL after the grace."""
        if self._killer is None and self.child.running:
            self._killer = self._background(
                spawning.terminate_group(self.child, self.opts.kill_grace)
            )

    def cleanup(self) -> None:
        """Release pipes and helper tasks (the process itself is not touched)."""
        for task in (self._stdin_task, *self._pumps):
            if task is not None and not task.done():
                task.cancel()
        for reader in self.readers:
            reader.close()
        self.child.close_stdin()


@dataclass(eq=False)
class _Detached:
    """A detached command and what clients can learn about it."""

    command_id: str
    title: str
    cwd: str | None
    started: float
    command: _Command
    out: ByteRing
    err: ByteRing
    changed: asyncio.Event
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: _Outcome | None = None
    finished: float | None = None
    attached: bool = False
    task: asyncio.Task[None] | None = None
    expiry: asyncio.TimerHandle | None = None

    def info(self) -> rpc.CommandInfo:
        info = rpc.CommandInfo(
            command_id=self.command_id,
            pid=self.command.child.pid,
            title=self.title,
            state="running" if self.outcome is None else "exited",
            started=self.started,
            cwd=self.cwd,
            stdout_bytes=self.out.total,
            stderr_bytes=self.err.total,
            attached=self.attached,
        )
        if self.outcome is not None:
            self.outcome.report(info)
            info.finished = self.finished
        return info


class ShellCapability(CommandCapability):
    """``shell.*`` methods over one process-wide table of commands."""

    rpcs = rpc.RPCS

    def __init__(
        self,
        config: Config,
        base_env: dict[str, str],
        processes: Budget | None = None,
        locate: CallLocator | None = None,
    ) -> None:
        """``locate`` finds a running call by its request id (``shell.signal``'s ``rid``)."""
        super().__init__(config, base_env, "shell", processes)
        self._locate: CallLocator = locate if locate is not None else _locate_nothing
        self._live = 0
        self._calls: dict[tuple[int, int], _Command] = {}
        self._hooked: set[int] = set()
        self._detached: dict[str, _Detached] = {}

    # -- public ----------------------------------------------------------------

    @property
    def live_processes(self) -> int:
        """Commands spawned and not yet reaped."""
        return self._live

    def abort_connection(self, connection_id: int) -> int:
        """Stop every non-detached command of a closed connection; returns how many."""
        self._hooked.discard(connection_id)
        doomed = [cmd for (conn, _), cmd in self._calls.items() if conn == connection_id]
        for cmd in doomed:
            cmd.abort()
        return len(doomed)

    async def close(self) -> None:
        """Kill every command this capability started and forget them all."""
        self._closed = True
        for cmd in list(self._calls.values()):
            cmd.abort()
        for rec in self._detached.values():
            rec.command.abort()
        await self._background.join()
        tasks = [rec.task for rec in self._detached.values() if rec.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rec in self._detached.values():
            if rec.expiry is not None:
                rec.expiry.cancel()
        self._detached.clear()

    # -- helpers ---------------------------------------------------------------

    def _options(self, params: rpc.RunParams) -> _Options:
        limits = self._limits
        return _Options(
            timeout=params.timeout,
            idle_timeout=params.idle_timeout,
            drain_grace=limits.drain_grace if params.drain_grace is None else params.drain_grace,
            kill_grace=limits.kill_grace if params.kill_grace is None else params.kill_grace,
        )

    def _spawn(
        self, params: rpc.RunParams, argv: list[str], connection: int | None
    ) -> spawning.Child:
        """Start the command, counted against the process budget (``connection``'s share
        too, for a command that runs for its call)."""
        self._check_open()
        env = command_environment(self._base_env, (self._marker_var,), params.env, params.unset)
        plan = self._resources.plan(params.limits)
        try:
            child = self._counted(
                lambda: spawning.spawn(
                    argv,
                    env=env,
                    cwd=params.cwd,
                    stdin_pipe=params.stdin is not None or params.stdin_stream,
                    limits=plan,
                ),
                connection,
            )
        except BaseException:
            if plan is not None:
                plan.release()
            raise
        self._live += 1
        child.exited.add_done_callback(self._reaped)
        return child

    def _reaped(self, _: asyncio.Future[int]) -> None:
        self._live -= 1

    def _hook_connection(self, ctx: CallContext) -> None:
        conn = ctx.connection_id
        if conn not in self._hooked:
            self._hooked.add(conn)
            ctx.on_close(lambda: self._on_connection_closed(conn))

    def _on_connection_closed(self, connection_id: int) -> None:
        self.abort_connection(connection_id)

    # -- shell.run -------------------------------------------------------------

    async def shell_run(self, params: rpc.RunParams, ctx: CallContext) -> rpc.RunResult:
        """``shell.run``: run a command to its end, or start it detached."""
        argv = command_argv(params.argv, params.command)
        if params.stdin is not None and params.stdin_stream:
            raise InvalidParams("stdin and stdin_stream are exclusive")
        opts = self._options(params)
        if params.detached:
            return self._start_detached(params, argv, opts)
        cap = self._limits.output_cap
        if params.output_cap is not None:
            cap = min(cap, params.output_cap)
        # A call with a request id runs on its connection's virtual one: the same share.
        child = self._spawn(params, argv, abs(ctx.connection_id))
        buffers: tuple[HeadTailBuffer, HeadTailBuffer] | None = None
        if params.stream:
            cmd = _Command(child, opts, self._background.spawn, sinks=None, stream_ctx=ctx)
        else:
            buffers = (HeadTailBuffer(cap), HeadTailBuffer(cap))
            sinks = (buffers[0].write, buffers[1].write)
            cmd = _Command(child, opts, self._background.spawn, sinks=sinks, stream_ctx=None)
        key = (ctx.connection_id, ctx.call_id)
        self._calls[key] = cmd
        try:
            self._hook_connection(ctx)
            cmd.feed_stdin(params.stdin, ctx if params.stdin_stream else None)
            outcome = await cmd.supervise()
        except BaseException:
            cmd.abort()
            raise
        finally:
            if self._calls.get(key) is cmd:
                del self._calls[key]
            cmd.cleanup()
        result = rpc.RunResult(pid=child.pid)
        outcome.report(result)
        if buffers is not None:
            # Both captures share what the reply frame leaves beside the other fields.
            budget = result_budget(ctx) - encoded_size(result) - CAPTURE_FIELDS
            (result.stdout, result.stdout_dropped), (result.stderr, result.stderr_dropped) = (
                fit_pair(buffers[0].take(), buffers[1].take(), budget)
            )
        return result

    def _start_detached(
        self, params: rpc.RunParams, argv: list[str], opts: _Options
    ) -> rpc.RunResult:
        if params.stream or params.stdin_stream:
            raise InvalidParams("a detached command cannot use the call's streams")
        full = len(self._detached) >= self._limits.max_detached
        finished = [r for r in self._detached.values() if r.outcome is not None] if full else []
        if full and not finished:
            raise LimitExceeded(
                f"too many detached commands (limit {self._limits.max_detached})",
                {"limit": self._limits.max_detached},
            )
        child = self._spawn(params, argv, None)
        if finished:
            # The oldest finished record whose status nobody read makes room.
            self._forget(finished[0])
        out, err = ByteRing(self._limits.detached_ring), ByteRing(self._limits.detached_ring)
        changed = asyncio.Event()

        def sink(ring: ByteRing) -> Callable[[bytes], None]:
            def write(data: bytes) -> None:
                ring.write(data)
                changed.set()

            return write

        cmd = _Command(
            child, opts, self._background.spawn, sinks=(sink(out), sink(err)), stream_ctx=None
        )
        command_id = secrets.token_hex(8)
        rec = _Detached(
            command_id=command_id,
            title=title_of(argv),
            cwd=params.cwd,
            started=time.time(),
            command=cmd,
            out=out,
            err=err,
            changed=changed,
        )
        cmd.feed_stdin(params.stdin, None)
        self._detached[command_id] = rec
        rec.task = asyncio.ensure_future(self._supervise_detached(rec))
        return rpc.RunResult(pid=child.pid, command_id=command_id)

    async def _supervise_detached(self, rec: _Detached) -> None:
        try:
            rec.outcome = await rec.command.supervise()
        finally:
            rec.command.cleanup()
        rec.finished = time.time()
        rec.changed.set()
        rec.done.set()
        if rec.command_id in self._detached:
            loop = asyncio.get_running_loop()
            rec.expiry = loop.call_later(self._limits.detached_retention, self._forget, rec)

    def _forget(self, rec: _Detached) -> None:
        if self._detached.get(rec.command_id) is rec:
            del self._detached[rec.command_id]
        if rec.expiry is not None:
            rec.expiry.cancel()
            rec.expiry = None

    def _record(self, command_id: str) -> _Detached:
        rec = self._detached.get(command_id)
        if rec is None:
            raise NoSuchProcess(f"no detached command {command_id[:64]!r}")
        return rec

    def _read_status(self, rec: _Detached, ctx: CallContext, *, spare: int = 0) -> rpc.CommandInfo:
        """The command's info; a final one is consumed, once it surely fits the reply."""
        info = rec.info()
        ensure_fits(info, ctx, f"the status of command {rec.command_id}", spare=spare)
        if rec.outcome is not None:
            self._forget(rec)
        return info

    # -- shell.signal ----------------------------------------------------------

    async def shell_signal(self, params: rpc.SignalParams, ctx: CallContext) -> rpc.SignalResult:
        """``shell.signal``: signal a running command (then SIGCONT it)."""
        named = (params.call_id, params.command_id, params.rid)
        if sum(name is not None for name in named) != 1:
            raise InvalidParams("exactly one of call_id, command_id and rid is required")
        if params.signal not in _VALID_SIGNALS:
            raise InvalidParams(f"invalid signal {params.signal}")
        if params.command_id is not None:
            cmd = self._record(params.command_id).command
        else:
            cmd = self._running_call(params, ctx)
        child = cmd.child
        if not child.running or not child.signal_and_continue(params.signal, group=params.group):
            raise AlreadyExited(f"command {child.pid} has already exited", {"pid": child.pid})
        return rpc.SignalResult(pid=child.pid)

    def _running_call(self, params: rpc.SignalParams, ctx: CallContext) -> _Command:
        """The running ``shell.run`` call named by ``call_id`` (on ``ctx``'s connection) or
        by ``rid`` (on whichever connection, through the request table)."""
        key: tuple[int, int] | None
        if params.rid is None:
            assert params.call_id is not None
            key, what = (ctx.connection_id, params.call_id), f"call {params.call_id}"
        else:
            key = self._locate(params.rid)
            what = f"request {params.rid.hex()}"
        found = self._calls.get(key) if key is not None else None
        if found is None:
            raise NoSuchProcess(f"no running command for {what}")
        return found

    # -- detached: list / status / wait / attach -------------------------------

    async def shell_list(self, params: rpc.ListParams, ctx: CallContext) -> rpc.ListResult:
        """``shell.list``: every remembered detached command (as many as fit the reply)."""
        infos = [rec.info() for rec in self._detached.values()]
        commands, truncated = fit_list(infos, result_budget(ctx) - _LIST_FIELDS)
        return rpc.ListResult(commands=commands, truncated=truncated)

    async def shell_status(self, params: rpc.StatusParams, ctx: CallContext) -> rpc.CommandInfo:
        """``shell.status``: one detached command's state (a final one is consumed)."""
        return self._read_status(self._record(params.command_id), ctx)

    async def shell_wait(self, params: rpc.WaitParams, ctx: CallContext) -> rpc.CommandInfo:
        """``shell.wait``: wait for a detached command's exit, up to ``timeout``."""
        rec = self._record(params.command_id)
        await commands.wait_done(rec.done, params.timeout)
        return self._read_status(rec, ctx)

    async def shell_attach(self, params: rpc.AttachParams, ctx: CallContext) -> rpc.AttachResult:
        """``shell.attach``: replay retained output, follow it, report the exit."""
        rec = self._record(params.command_id)
        if rec.attached:
            raise AlreadyAttached(f"command {params.command_id[:64]!r} already has a client")
        # Refused now if the final answer could not carry the command's info.
        ensure_fits(rec.info(), ctx, f"the status of command {rec.command_id}", spare=_ATTACH_SPARE)
        rec.attached = True
        offsets = [0, 0]
        lost = [0, 0]
        rings = ((rec.out, rpc.STDOUT_STREAM), (rec.err, rpc.STDERR_STREAM))
        try:
            while True:
                rec.changed.clear()
                moved = False
                for i, (ring, stream) in enumerate(rings):
                    data, skipped = ring.read_from(offsets[i], _ATTACH_READ)
                    lost[i] += skipped
                    offsets[i] += skipped + len(data)
                    if data:
                        moved = True
                        await ctx.send(stream, data)
                if moved:
                    continue
                if rec.outcome is not None or not params.follow:
                    break
                await rec.changed.wait()
            await ctx.send(rpc.STDOUT_STREAM, b"", end=True)
            await ctx.send(rpc.STDERR_STREAM, b"", end=True)
        finally:
            rec.attached = False
        return rpc.AttachResult(
            info=self._read_status(rec, ctx, spare=_ATTACH_SPARE),
            stdout_lost=lost[0],
            stderr_lost=lost[1],
        )
