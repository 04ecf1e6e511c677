"""The ``sessions`` capability: persistent shells that run one command at a time.

The shell and its channels
--------------------------

Each session is one long-lived ``/bin/sh`` (its own session and process
group, started by :func:`execd.spawn.spawn`) running :data:`_DRIVER`, with
stdin on ``/dev/null`` and stdout/stderr on pipes execd reads. Beside it, in
a private directory (mode 0700), are two FIFOs that execd keeps open
read-write, so neither end ever sees EOF or blocks on open:

* ``ctl``: execd writes one line per command, a random 128-bit *nonce*;
* ``status``: the driver writes ``<nonce> <exit status>`` after the command.

For each command execd writes the text to ``c-<nonce>`` (and stdin bytes to
``i-<nonce>``), then the nonce to ``ctl``. The driver reads it and runs
``command . c-<nonce> < i-<nonce>`` (or ``< /dev/null``) in the shell itself,
so ``cd``, ``export`` and the rest persist, and ``command`` keeps a syntax
error from ending the shell. The command's output goes to the shell's
stdout/stderr pipes; its status goes to the ``status`` FIFO, which output
never reaches: nothing a command prints can be taken for a status, and a
status line only counts when it carries the nonce of the running command.
Output that arrives while no command runs (background jobs) is discarded.

When the status arrives, everything the command wrote is already in the
pipes (it finished writing before the shell could report), so execd drains
them without waiting for EOF, which background jobs may hold off forever.

One command (:class:`_Run`)::

    files, nonce ─► RUNNING ──status line with the nonce──────────────────► DONE
                      │  └──the shell exits─────────────────────► DONE (session ended)
                      └──timeout, or the caller went away──► SIGINT to the group
                            ──status──► DONE; kill_grace later: SIGKILL the
                            command's processes ──status──► DONE; kill_grace
                            later: SIGKILL the shell ──► DONE (session ended)

Interrupts: the session's process group gets SIGINT, as a terminal sends
Ctrl-C to its foreground group. A shell without a terminal has no job
control (dash refuses ``set -m``), so background jobs share that group; it
starts them with SIGINT ignored, so they survive. Foreground processes die;
the driver's trap ``return 130`` ends the sourced command text; between
commands a no-op trap keeps the shell alive. The escalation after a timeout
kills the group members (other than the shell) that started after the
command did, so background jobs of earlier commands survive. Closing a
session kills every process carrying the session's sub-marker
(:data:`SESSION_MARKER_VAR`, read-only in the shell), whatever group it
moved to, then the process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from execd import marker, pipes, procfs
from execd import spawn as spawning
from execd.budget import Budget
from execd.commands import (
    SHELL,
    CommandCapability,
    close_each,
    command_environment,
)
from execd.config import Config
from execd.context import CallContext
from execd.errors import (
    LimitExceeded,
    NoSuchSession,
    SessionBusy,
    SessionDead,
    SessionExists,
    SpawnFailed,
    from_oserror,
)
from execd.fit import CAPTURE_FIELDS, encoded_size, ensure_fits, fit_list, result_budget
from execd.output import HeadTailBuffer, fit_pair
from protocol.rpc import sessions as rpc

log = logging.getLogger(__name__)

SESSION_MARKER_VAR = "EXECD_SESSION_MARKER"
"""Environment variable whose per-session value tags everything a session starts."""

#: Room for what a session's info may gain (a longer cwd is checked separately).
_INFO_SPARE = 128
#: Room for the fields of a result beside its list.
_RESULT_FIELDS = 64
_FILE_MODE = 0o600
_STATUS_LINE_MAX = 256
_DRAIN_CAP = 8 * 1024 * 1024
_READY_TIMEOUT = 15.0
_HANDSHAKE_CAP = 64 * 1024
_SWEEP_TIMEOUT = 5.0
_EXIT_WAIT = 5.0

_DRIVER = f"""
readonly __execd_dir="$1"
readonly {SESSION_MARKER_VAR}
__execd_id=
__execd_s=0
__execd_in=/dev/null
__execd_int=
__execd_step() {{
  __execd_s=130
  __execd_int=
  trap '__execd_int=1; return 130' INT
  command . "$__execd_dir/c-$__execd_id" <"$__execd_in"
  __execd_s=$?
  if [ -n "$__execd_int" ]; then __execd_s=130; fi
}}
__execd_main() {{
  while :; do
    trap : INT
    if [ -n "$__execd_id" ]; then
      printf '%s %s\\n' "$__execd_id" "$__execd_s" >"$__execd_dir/status"
      __execd_id=
    fi
    if IFS= read -r __execd_id <"$__execd_dir/ctl"; then :; else
      __execd_id=
      if [ -p "$__execd_dir/ctl" ]; then continue; fi
      exit 70
    fi
    __execd_in=/dev/null
    if [ -f "$__execd_dir/i-$__execd_id" ]; then __execd_in="$__execd_dir/i-$__execd_id"; fi
    __execd_step
  done
}}
while :; do __execd_main; done
"""
"""The session shell's program (``$1`` is the private directory).

The status is written at the top of the loop in a function that the outer
``while`` re-enters, so a SIGINT landing between the end of a command and
the reset of the trap (its ``return 130`` then leaves ``__execd_main``, not
the shell) still gets the status written on the next pass. A failed ``read``
is an interrupted one while the FIFO exists (execd holds it open, so it
never reaches EOF). The trap also sets ``__execd_int``: some shells (dash)
let the command that follows a trap's ``return`` overwrite its status, so
the flag, not ``$?``, says the command was interrupted.
"""


class _OutputPipe:
    """The read end of the shell's stdout or stderr, handed chunk by chunk to a sink."""

    def __init__(self, fd: int, sink: Callable[[bytes], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = fd
        self._sink = sink
        self._loop.add_reader(fd, self._read_once)

    def _read_once(self) -> bool:
        if self._fd < 0:
            return False
        try:
            data = os.read(self._fd, pipes.READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self.close()
            return False
        self._sink(data)
        return True

    def drain(self) -> None:
        """Read whatever is in the pipe now (bounded), without waiting for more."""
        taken = 0
        while taken < _DRAIN_CAP and self._read_once():
            taken += pipes.READ_SIZE

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


@dataclass(eq=False)
class _Run:
    """One command in flight; see the module docstring."""

    nonce: str
    out: HeadTailBuffer
    err: HeadTailBuffer
    done: asyncio.Future[int]
    abort: asyncio.Future[None]
    started: float
    start_ticks: int
    files: list[str]
    limit_mark: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False
    timed_out: bool = False


@dataclass(eq=False)
class _Session:
    """A session shell and its channels."""

    name: str
    directory: str
    child: spawning.Child
    sub_marker: str
    ctl_fd: int
    status_fd: int
    created: float
    pipes: list[_OutputPipe] = field(default_factory=list)
    status_buf: bytearray = field(default_factory=bytearray)
    current: _Run | None = None
    task: asyncio.Task[rpc.RunResult] | None = None
    commands: int = 0

    @property
    def alive(self) -> bool:
        return self.child.running

    def cwd(self) -> str | None:
        if not self.alive:
            return None
        try:
            return os.readlink(f"/proc/{self.child.pid}/cwd")
        except OSError:
            return None

    def info(self) -> rpc.SessionInfo:
        state: rpc.SessionState = (
            "dead" if not self.alive else "busy" if self.current is not None else "idle"
        )
        info = rpc.SessionInfo(
            name=self.name,
            pid=self.child.pid,
            state=state,
            created=self.created,
            cwd=self.cwd(),
            commands=self.commands,
        )
        if not self.alive:
            info.exit_code, info.signal = spawning.decode_status(self.child.exited.result())
        if self.child.limits is not None:
            info.limits = self.child.limits.mechanisms
            info.limit_exceeded = self.child.limits.exceeded
        return info


def _provisional_info(params: rpc.OpenParams) -> rpc.SessionInfo:
    """The info of a session about to open, as large as it will be."""
    where = os.path.abspath(params.cwd or os.getcwd())
    return rpc.SessionInfo(name=params.name, pid=2**31, state="idle", created=0.0, cwd=where)


class SessionsCapability(CommandCapability):
    """``sessions.*`` methods over one process-wide table of named shells.

    ``base_env`` is the environment the shells start from; it carries the
    daemon's marker variable, which calls may neither override nor unset.
    """

    rpcs = rpc.RPCS

    def __init__(
        self, config: Config, base_env: dict[str, str], processes: Budget | None = None
    ) -> None:
        super().__init__(config, base_env, "sessions", processes)
        self._sessions: dict[str, _Session] = {}

    async def close(self) -> None:
        """Kill every session and everything it started."""
        self._closed = True
        sessions = list(self._sessions.values())
        await close_each(sessions, self._destroy, lambda sess: f"closing session {sess.name}")
        await self._background.join()

    # -- helpers ---------------------------------------------------------------

    def _get(self, name: str) -> _Session:
        sess = self._sessions.get(name)
        if sess is None:
            raise NoSuchSession(f"no session named {name!r}", {"name": name})
        return sess

    def _live(self, name: str) -> _Session:
        sess = self._get(name)
        if not sess.alive:
            exit_code, sig = spawning.decode_status(sess.child.exited.result())
            raise SessionDead(
                f"the shell of session {name!r} has ended",
                {"name": name, "exit_code": exit_code, "signal": sig},
            )
        return sess

    def _private_dir(self, name: str) -> str:
        return tempfile.mkdtemp(prefix=f"{name}-", dir=self._private_root())

    def _write_private(self, path: str, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    # -- the channels ------------------------------------------------------------

    def _on_output(self, sess: _Session, index: int, data: bytes) -> None:
        run = sess.current
        if run is not None:
            (run.out if index == 0 else run.err).write(data)

    def _on_status(self, sess: _Session) -> None:
        try:
            data = os.read(sess.status_fd, 4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        buf = sess.status_buf
        buf += data
        while True:
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) > _STATUS_LINE_MAX:
                    buf.clear()
                return
            line = bytes(buf[:end])
            del buf[: end + 1]
            parts = line.split()
            run = sess.current
            if (
                run is not None
                and len(parts) == 2
                and parts[0] == run.nonce.encode()
                and parts[1].isdigit()
                and not run.done.done()
            ):
                run.done.set_result(int(parts[1]))

    def _release_channels(self, sess: _Session) -> None:
        for pipe in sess.pipes:
            pipe.close()
        if sess.status_fd >= 0:
            asyncio.get_running_loop().remove_reader(sess.status_fd)
            os.close(sess.status_fd)
        if sess.ctl_fd >= 0:
            os.close(sess.ctl_fd)
        sess.ctl_fd = sess.status_fd = -1
        shutil.rmtree(sess.directory, ignore_errors=True)

    # -- sessions.open ---------------------------------------------------------

    async def sessions_open(self, params: rpc.OpenParams, ctx: CallContext) -> rpc.SessionInfo:
        """``sessions.open``: start a named shell."""
        self._check_open()
        existing = self._sessions.get(params.name)
        if existing is not None:
            if existing.alive:
                raise SessionExists(f"session {params.name!r} exists", {"name": params.name})
            await self._destroy(existing)
        sub_marker = secrets.token_hex(16)
        env = command_environment(
            self._base_env,
            (self._marker_var, SESSION_MARKER_VAR),
            params.env,
            params.unset,
            {SESSION_MARKER_VAR: sub_marker},
        )
        limit = self._limits.max_sessions
        if len(self._sessions) >= limit:
            dead = [sess for sess in self._sessions.values() if not sess.alive]
            if not dead:
                raise LimitExceeded(f"too many sessions (limit {limit})", {"limit": limit})
            await self._destroy(dead[0])
        # Checked again: another call may have changed the table while this one waited.
        self._check_open()
        if params.name in self._sessions:
            raise SessionExists(f"session {params.name!r} exists", {"name": params.name})
        if len(self._sessions) >= limit:
            raise LimitExceeded(f"too many sessions (limit {limit})", {"limit": limit})
        # Refused before the shell starts if the reply could not carry the session's info.
        ensure_fits(
            _provisional_info(params),
            ctx,
            f"the info of session {params.name!r}",
            spare=_INFO_SPARE,
        )
        sess = self._start_shell(params, env, sub_marker)
        self._sessions[params.name] = sess
        try:
            await self._handshake(sess)
        except BaseException:
            if self._sessions.get(params.name) is sess:
                del self._sessions[params.name]
            await asyncio.shield(self._background.spawn(self._kill(sess)))
            raise
        return sess.info()

    def _start_shell(self, params: rpc.OpenParams, env: Mapping[str, str], sub: str) -> _Session:
        fds: list[int] = []
        directory = ""
        try:
            directory = self._private_dir(params.name)
            for fifo in ("ctl", "status"):
                path = os.path.join(directory, fifo)
                os.mkfifo(path, _FILE_MODE)
                fds.append(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            if directory:
                shutil.rmtree(directory, ignore_errors=True)
            raise from_oserror(exc) from None
        plan = None
        try:
            plan = self._resources.plan(params.limits)
            child = self._counted(
                lambda: spawning.spawn(
                    [SHELL, "-c", _DRIVER, "execd-session", directory],
                    env=env,
                    cwd=params.cwd,
                    limits=plan,
                )
            )
        except BaseException:
            if plan is not None:
                plan.release()
            for fd in fds:
                os.close(fd)
            shutil.rmtree(directory, ignore_errors=True)
            raise
        sess = _Session(
            name=params.name,
            directory=directory,
            child=child,
            sub_marker=sub,
            ctl_fd=fds[0],
            status_fd=fds[1],
            created=time.time(),
        )
        sess.pipes = [
            _OutputPipe(child.stdout, functools.partial(self._on_output, sess, 0)),
            _OutputPipe(child.stderr, functools.partial(self._on_output, sess, 1)),
        ]
        asyncio.get_running_loop().add_reader(sess.status_fd, self._on_status, sess)
        return sess

    async def _handshake(self, sess: _Session) -> None:
        """Run a no-op through the whole pipeline, so a broken shell fails the open."""
        run = self._begin(sess, ":", None, _HANDSHAKE_CAP)
        try:
            async with asyncio.timeout(_READY_TIMEOUT):
                await asyncio.wait({run.done, sess.child.exited}, return_when="FIRST_COMPLETED")
        except TimeoutError:
            pass
        finally:
            self._end(sess, run)
        if not run.done.done() or run.done.result() != 0:
            err = run.err.getvalue().decode("utf-8", "replace")[-2000:]
            raise SpawnFailed(f"the shell of session {sess.name!r} did not start", {"stderr": err})

    # -- sessions.run ----------------------------------------------------------

    def _begin(self, sess: _Session, command: str, stdin: bytes | None, cap: int) -> _Run:
        """Write the command's files and hand its nonce to the shell."""
        loop = asyncio.get_running_loop()
        nonce = secrets.token_hex(16)
        script = os.path.join(sess.directory, f"c-{nonce}")
        files = [script]
        try:
            self._write_private(script, command.encode("utf-8", "surrogateescape") + b"\n")
            if stdin is not None:
                files.append(os.path.join(sess.directory, f"i-{nonce}"))
                self._write_private(files[1], stdin)
        except OSError as exc:
            for path in files:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise from_oserror(exc) from None
        for pipe in sess.pipes:
            pipe.drain()
        run = _Run(
            nonce=nonce,
            out=HeadTailBuffer(cap),
            err=HeadTailBuffer(cap),
            done=loop.create_future(),
            abort=loop.create_future(),
            started=loop.time(),
            start_ticks=procfs.boot_ticks(),
            files=files,
            limit_mark=sess.child.limits.command_started() if sess.child.limits else {},
        )
        sess.current = run
        try:
            os.write(sess.ctl_fd, f"{nonce}\n".encode())
        except OSError as exc:
            self._end(sess, run)
            raise SessionDead(
                f"cannot reach the shell of session {sess.name!r}: {exc.strerror}",
                {"name": sess.name},
            ) from None
        return run

    def _end(self, sess: _Session, run: _Run) -> None:
        if sess.current is run:
            sess.current = None
        for path in run.files:
            with contextlib.suppress(OSError):
                os.unlink(path)

    async def sessions_run(self, params: rpc.RunParams, ctx: CallContext) -> rpc.RunResult:
        """``sessions.run``: run one command in the session's shell."""
        sess = self._live(params.name)
        if sess.current is not None:
            raise SessionBusy(f"session {params.name!r} is running a command", {"name": sess.name})
        limit = self._limits.output_cap
        cap = limit if params.output_cap is None else min(limit, params.output_cap)
        grace = self._limits.kill_grace if params.kill_grace is None else params.kill_grace
        run = self._begin(sess, params.command, params.stdin, cap)
        task = self._background.spawn(self._supervise(sess, run, params.timeout, grace))
        sess.task = task
        try:
            result: rpc.RunResult = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not run.abort.done():
                run.abort.set_result(None)
            raise
        # Both captures share what the reply frame leaves beside the other fields.
        bare = msgspec.structs.replace(result, stdout=b"", stderr=b"")
        budget = result_budget(ctx) - encoded_size(bare) - CAPTURE_FIELDS
        (result.stdout, result.stdout_dropped), (result.stderr, result.stderr_dropped) = fit_pair(
            (result.stdout, result.stdout_dropped), (result.stderr, result.stderr_dropped), budget
        )
        return result

    async def _supervise(
        self, sess: _Session, run: _Run, timeout: float | None, grace: float
    ) -> rpc.RunResult:
        try:
            waiting: set[asyncio.Future[Any]] = {run.done, sess.child.exited, run.abort}
            await asyncio.wait(waiting, timeout=timeout, return_when="FIRST_COMPLETED")
            if not (run.done.done() or sess.child.exited.done()):
                run.timed_out = not run.abort.done()
                await self._escalate(sess, run, grace)
            return self._result(sess, run)
        finally:
            self._end(sess, run)
            sess.commands += 1

    async def _escalate(self, sess: _Session, run: _Run, grace: float) -> None:
        """SIGINT; then SIGKILL the command's processes; then kill the session."""
        finished: set[asyncio.Future[Any]] = {run.done, sess.child.exited}
        run.interrupted = True
        sess.child.signal(signal.SIGINT)
        await asyncio.wait(finished, timeout=grace, return_when="FIRST_COMPLETED")
        if any(f.done() for f in finished):
            return
        shell = sess.child.pid
        started = procfs.live_group_members(shell, since=run.start_ticks)
        for pid in [pid for pid in started if pid != shell]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        await asyncio.wait(finished, timeout=grace, return_when="FIRST_COMPLETED")
        if any(f.done() for f in finished):
            return
        log.warning("session %s did not recover from a stopped command; killing it", sess.name)
        sess.child.signal(signal.SIGKILL)
        await asyncio.wait({sess.child.exited}, timeout=_EXIT_WAIT)

    def _result(self, sess: _Session, run: _Run) -> rpc.RunResult:
        for pipe in sess.pipes:
            pipe.drain()
        loop = asyncio.get_running_loop()
        result = rpc.RunResult(
            stdout=run.out.getvalue(),
            stderr=run.err.getvalue(),
            stdout_dropped=run.out.dropped,
            stderr_dropped=run.err.dropped,
            timed_out=run.timed_out,
            interrupted=run.interrupted,
            duration=max(0.0, loop.time() - run.started),
        )
        plan = sess.child.limits
        if run.done.done():
            result.exit_code = run.done.result()
            result.cwd = sess.cwd()
            if plan is not None:
                result.limit_exceeded = plan.command_verdict(run.limit_mark, result.exit_code)
        elif sess.child.exited.done():
            result.exit_code, result.signal = spawning.decode_status(sess.child.exited.result())
            result.session_ended = True
            if plan is not None:
                # Recorded when the shell was reaped (before anyone waiting on it woke up).
                result.limit_exceeded = plan.exceeded
        else:
            result.session_ended = True
        if plan is not None:
            result.limits = plan.mechanisms
        return result

    # -- sessions.interrupt / close / list ---------------------------------------

    async def sessions_interrupt(
        self, params: rpc.InterruptParams, ctx: CallContext
    ) -> rpc.InterruptResult:
        """``sessions.interrupt``: SIGINT to the running command, if any."""
        sess = self._live(params.name)
        run = sess.current
        if run is None or run.done.done():
            return rpc.InterruptResult(sent=False)
        run.interrupted = True
        return rpc.InterruptResult(sent=sess.child.signal(signal.SIGINT))

    async def sessions_close(self, params: rpc.CloseParams, ctx: CallContext) -> rpc.CloseResult:
        """``sessions.close``: kill the session and everything it started."""
        result = await self._destroy(self._get(params.name))
        # Survivors are listed as far as the reply has room for them.
        bare = msgspec.structs.replace(result, remaining=[])
        room = result_budget(ctx) - encoded_size(bare) - _RESULT_FIELDS
        result.remaining, _ = fit_list(result.remaining, room)
        return result

    async def sessions_list(self, params: rpc.ListParams, ctx: CallContext) -> rpc.ListResult:
        """``sessions.list``: every session, in open order (as many as fit the reply)."""
        infos = [sess.info() for sess in self._sessions.values()]
        sessions, truncated = fit_list(infos, result_budget(ctx) - _RESULT_FIELDS)
        return rpc.ListResult(sessions=sessions, truncated=truncated)

    async def _destroy(self, sess: _Session) -> rpc.CloseResult:
        if self._sessions.get(sess.name) is sess:
            del self._sessions[sess.name]
        return await asyncio.shield(self._background.spawn(self._kill(sess)))

    async def _kill(self, sess: _Session) -> rpc.CloseResult:
        """Kill the shell and every process carrying the sub-marker; release the channels."""
        killed = 0
        remaining: list[int] = []
        try:
            report = await marker.cleanup_async(
                SESSION_MARKER_VAR, sess.sub_marker, timeout=_SWEEP_TIMEOUT
            )
            killed, remaining = report.killed, list(report.remaining)
        except (OSError, RuntimeError) as exc:
            log.warning("sweeping session %s failed: %s", sess.name, exc)
        sess.child.signal(signal.SIGKILL)
        if sess.child.limits is not None:
            sess.child.limits.kill()
        await asyncio.wait({sess.child.exited}, timeout=_EXIT_WAIT)
        if sess.task is not None and not sess.task.done():
            await asyncio.wait({sess.task}, timeout=_EXIT_WAIT)
        info = sess.info()
        self._release_channels(sess)
        return rpc.CloseResult(info=info, killed=killed, remaining=remaining)


__all__ = ["SESSION_MARKER_VAR", "SessionsCapability"]
