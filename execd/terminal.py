"""The ``terminal`` capability: programs on a pseudo-terminal (``protocol.rpc.terminal``).

Starting
    ``os.openpty`` gives the master (kept by execd) and the slave. The
    program is spawned with ``posix_spawn``: ``setsid`` makes it the leader
    of a new session, then the file actions *open* the slave by its path as
    stdin — a session leader without a controlling terminal that opens a
    terminal device acquires it as its controlling terminal (what
    ``TIOCSCTTY`` does explicitly) — and duplicate it to stdout and stderr.
    A working directory other than execd's is entered by a ``/bin/sh``
    prelude that then execs the program; limits add their own prelude
    (:mod:`execd.limits`). Where there is no shell, the child does both
    itself between fork and exec, and takes the terminal with
    ``TIOCSCTTY``. The child carries the marker through its
    environment like every command.

Output
    :class:`~execd.pipes.PipeReader` reads the master into a bounded ring
    (:class:`~execd.output.ByteRing`) that ``terminal.attach`` replays and
    follows. While a client is attached and more than half a ring behind,
    the reader waits for it, so the program blocks on its writes instead of
    its output being lost; detached, the ring keeps only the recent output.

Ending
    When the program exits, output already written is read until the slave
    is closed everywhere or ``drain_grace`` passes. ``terminal.close``, the
    capability's close (session end) and the daemon's shutdown hang up the
    terminal's whole session — every process whose session is the
    program's, whatever process group job control moved it to — with SIGHUP
    and SIGCONT, then SIGKILL after the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import secrets
import signal
import struct
import subprocess
import termios
import time
from dataclasses import dataclass, field

from execd import commands, pipes, procfs, reaper
from execd import spawn as spawning
from execd.budget import Budget
from execd.commands import SHELL, CommandCapability, command_argv, command_environment, title_of
from execd.config import Config
from execd.context import CallContext
from execd.errors import (
    AlreadyAttached,
    AlreadyExited,
    LimitExceeded,
    NoSuchProcess,
)
from execd.fit import ensure_fits
from execd.limits import Plan
from execd.output import ByteRing
from protocol.rpc import terminal as rpc
from protocol.rpc.resources import LIMIT_NAMES

log = logging.getLogger(__name__)

_ATTACH_READ = 256 * 1024
_ATTACH_SPARE = 96
"""Room for what a final info adds (exit status, verdict) and the attach result around it."""
_TERM = "xterm-256color"
_CD_PRELUDE = 'cd -- "$0" || exit 126\nexec "$@"'


def set_window(fd: int, rows: int, cols: int) -> None:
    """Set the window size of the terminal behind ``fd`` (its foreground group gets SIGWINCH)."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _start(argv: list[str], env: dict[str, str], tty: str) -> int:
    """Spawn ``argv`` as a session leader whose controlling terminal is ``tty``."""
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, tty, os.O_RDWR, 0),
        (os.POSIX_SPAWN_DUP2, 0, 1),
        (os.POSIX_SPAWN_DUP2, 0, 2),
    ]
    spawning.make_inherited_fds_close_on_exec()
    program = spawning.resolve_program(argv[0], env)
    try:
        return os.posix_spawn(
            program,
            argv,
            env,
            file_actions=actions,
            setsid=True,
            setsigdef=spawning.DEFAULT_SIGNALS,
        )
    except OSError as exc:
        raise spawning.spawn_error(exc, argv[0], None) from None


def _take_terminal() -> None:
    """In the child: make stdin, the terminal, the controlling terminal of the new session."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _start_without_shell(
    argv: list[str], env: dict[str, str], cwd: str | None, slave: int, plan: Plan | None
) -> subprocess.Popen[bytes]:
    """Spawn as :func:`_start` does where no shell can run the working-directory or limits prelude.

    The child enters ``cwd``, takes the terminal and applies ``plan`` itself
    between fork and exec (:func:`execd.spawn.popen_with_prelude`).
    """

    def prelude() -> None:
        _take_terminal()
        if plan is not None:
            plan.apply_in_child()

    spawning.make_inherited_fds_close_on_exec()
    try:
        return spawning.popen_with_prelude(
            argv, env=env, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, prelude=prelude
        )
    except OSError as exc:
        raise spawning.spawn_error(exc, argv[0], cwd) from None


def session_members(leader: int, since: int) -> list[int]:
    """Live processes of the session ``leader`` leads (started at ``since`` or later)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.getsid(int(entry)) != leader:
                continue
            stat = procfs.read_stat(entry)
            if stat is not None and stat.alive and stat.start >= since:
                found.append(int(entry))
    return found


@dataclass(eq=False)
class _Terminal:
    """One terminal: its program, the master's reader and writer, the output ring."""

    terminal_id: str
    title: str
    tty: str
    child: spawning.Child
    master: int
    reader: pipes.PipeReader
    ring: ByteRing
    rows: int
    cols: int
    started_ticks: int
    plan: Plan | None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    attached: bool = False
    sent: int = 0
    task: asyncio.Task[None] | None = None
    closing: asyncio.Task[None] | None = None

    @property
    def exited(self) -> asyncio.Future[int]:
        """The program's exit status, once reaped."""
        return self.child.exited

    def info(self) -> rpc.TerminalInfo:
        info = rpc.TerminalInfo(
            terminal_id=self.terminal_id,
            pid=self.child.pid,
            tty=self.tty,
            title=self.title,
            state="exited" if self.done.is_set() else "running",
            rows=self.rows,
            cols=self.cols,
            output_bytes=self.ring.total,
            attached=self.attached,
        )
        if self.done.is_set():
            info.exit_code, info.signal = spawning.decode_status(self.child.exited.result())
        if self.plan is not None:
            info.limit_exceeded = self.plan.exceeded
            info.limits = self.plan.mechanisms
        return info


class TerminalCapability(CommandCapability):
    """``terminal.*`` methods over one process-wide table of terminals."""

    rpcs = rpc.RPCS

    def __init__(
        self, config: Config, base_env: dict[str, str], processes: Budget | None = None
    ) -> None:
        super().__init__(config, base_env, "terminal", processes)
        self._terminals: dict[str, _Terminal] = {}

    async def close(self) -> None:
        """Hang up every terminal and forget them all."""
        self._closed = True
        terminals = list(self._terminals.values())
        await asyncio.gather(
            *(self._hang_up(t, self._limits.kill_grace) for t in terminals), return_exceptions=True
        )
        await self._background.join()
        self._terminals.clear()

    # -- terminal.open -----------------------------------------------------------

    async def terminal_open(self, params: rpc.OpenParams, ctx: CallContext) -> rpc.TerminalInfo:
        """``terminal.open``: start a program on a new terminal."""
        self._check_open()
        if len(self._terminals) >= self._limits.max_detached:
            raise LimitExceeded(
                f"too many terminals (limit {self._limits.max_detached})",
                {"limit": self._limits.max_detached},
            )
        argv = command_argv(params.argv, params.command)
        env = dict(
            command_environment(self._base_env, (self._marker_var,), params.env, params.unset)
        )
        env.setdefault("TERM", _TERM)
        # Refused before the program starts if its final info could not reach this client.
        provisional = rpc.TerminalInfo(
            terminal_id="0" * 16,
            pid=2**31,
            tty="/dev/pts/" + "9" * 10,
            title=title_of(argv),
            state="running",
            rows=params.rows,
            cols=params.cols,
            output_bytes=2**62,
            limits=dict.fromkeys(LIMIT_NAMES, "unavailable") if params.limits else None,
        )
        ensure_fits(provisional, ctx, "the info of the terminal", spare=_ATTACH_SPARE)
        # The plan is made once the process budget has room (_start releases it on failure).
        term = self._counted(
            lambda: self._start(params, argv, env, self._resources.plan(params.limits))
        )
        self._terminals[term.terminal_id] = term
        term.task = asyncio.ensure_future(self._supervise(term))
        return term.info()

    def _start(
        self, params: rpc.OpenParams, argv: list[str], env: dict[str, str], plan: Plan | None
    ) -> _Terminal:
        if params.cwd is not None and not os.path.isdir(params.cwd):
            if plan is not None:
                plan.release()
            code = errno.ENOTDIR if os.path.exists(params.cwd) else errno.ENOENT
            failure = OSError(code, os.strerror(code), params.cwd)
            raise spawning.spawn_error(failure, argv[0], params.cwd)
        master, slave = os.openpty()
        try:
            set_window(master, params.rows, params.cols)
            tty = os.ttyname(slave)
            spawned = argv
            if plan is not None:
                spawning.check_program(argv[0], env, params.cwd)
            cwd = params.cwd
            elsewhere = cwd is not None and cwd != os.getcwd()
            popen: subprocess.Popen[bytes] | None = None
            started = time.monotonic()
            ticks = procfs.boot_ticks()
            if (plan is not None or elsewhere) and not spawning.shell_available():
                popen = _start_without_shell(argv, env, cwd, slave, plan)
                pid = popen.pid
            else:
                if plan is not None:
                    spawned = plan.wrap(spawned)
                if cwd is not None and elsewhere:
                    spawned = [SHELL, "-c", _CD_PRELUDE, cwd, *spawned]
                pid = _start(spawned, env, tty)
        except BaseException:
            os.close(master)
            if plan is not None:
                plan.release()
            raise
        finally:
            os.close(slave)
        reaper.track(pid)
        child = spawning.watch(pid, started, popen)
        if plan is not None:
            plan.attach(child)
        os.set_blocking(master, False)
        writer = os.dup(master)
        return _Terminal(
            terminal_id=secrets.token_hex(8),
            title=title_of(argv),
            tty=tty,
            child=child,
            master=writer,
            reader=pipes.PipeReader(master),
            ring=ByteRing(self._limits.detached_ring),
            rows=params.rows,
            cols=params.cols,
            started_ticks=ticks,
            plan=plan,
        )

    async def _supervise(self, term: _Terminal) -> None:
        pump = asyncio.ensure_future(self._pump(term))
        try:
            await term.child.wait()
            await asyncio.wait({pump}, timeout=self._limits.drain_grace)
            if not pump.done():
                # Something still holds the terminal open, or an attached client takes
                # the output slowly: what was read goes to the ring, the rest is dropped.
                term.reader.close()
                await asyncio.wait({pump}, timeout=self._limits.drain_grace)
        finally:
            pump.cancel()
            term.reader.close()
            with contextlib.suppress(OSError):
                os.close(term.master)
            term.done.set()
            term.changed.set()

    async def _pump(self, term: _Terminal) -> None:
        half = max(1, term.ring.capacity // 2)
        while True:
            data = await term.reader.read()
            if not data:
                return
            term.ring.write(data)
            term.changed.set()
            while term.attached and term.ring.total - term.sent > half:
                term.progress.clear()
                await term.progress.wait()

    def _terminal(self, terminal_id: str) -> _Terminal:
        term = self._terminals.get(terminal_id)
        if term is None:
            raise NoSuchProcess(f"no terminal {terminal_id[:64]!r}")
        return term

    def _final(self, term: _Terminal, ctx: CallContext, spare: int = 0) -> rpc.TerminalInfo:
        """The terminal's info; once it has exited, the terminal is forgotten."""
        info = term.info()
        ensure_fits(info, ctx, f"the status of terminal {term.terminal_id}", spare=spare)
        if term.done.is_set() and self._terminals.get(term.terminal_id) is term:
            del self._terminals[term.terminal_id]
        return info

    # -- attach / send / resize / wait / close -------------------------------------

    async def terminal_attach(self, params: rpc.AttachParams, ctx: CallContext) -> rpc.AttachResult:
        """``terminal.attach``: replay the ring, follow the live output, report the exit."""
        term = self._terminal(params.terminal_id)
        if term.attached:
            raise AlreadyAttached(f"terminal {params.terminal_id[:64]!r} already has a client")
        # Refused now if the final answer could not carry the terminal's info.
        ensure_fits(
            term.info(), ctx, f"the status of terminal {term.terminal_id}", spare=_ATTACH_SPARE
        )
        term.attached = True
        offset = lost = 0
        try:
            while True:
                term.changed.clear()
                data, skipped = term.ring.read_from(offset, _ATTACH_READ)
                lost += skipped
                offset += skipped + len(data)
                if data:
                    await ctx.send(rpc.OUTPUT_STREAM, data)
                    term.sent = offset
                    term.progress.set()
                    continue
                term.sent = offset
                term.progress.set()
                if term.done.is_set() or not params.follow:
                    break
                await term.changed.wait()
            await ctx.send(rpc.OUTPUT_STREAM, b"", end=True)
        finally:
            term.attached = False
            term.progress.set()
        return rpc.AttachResult(info=self._final(term, ctx, _ATTACH_SPARE), lost=lost)

    async def terminal_send(self, params: rpc.SendParams, ctx: CallContext) -> None:
        """``terminal.send``: write keystrokes to the terminal."""
        term = self._terminal(params.terminal_id)
        if term.done.is_set() or not await pipes.write_all(term.master, params.data):
            raise AlreadyExited(f"terminal {params.terminal_id[:64]!r} has ended")

    async def terminal_resize(self, params: rpc.ResizeParams, ctx: CallContext) -> None:
        """``terminal.resize``: set the window size."""
        term = self._terminal(params.terminal_id)
        if term.done.is_set():
            raise AlreadyExited(f"terminal {params.terminal_id[:64]!r} has ended")
        set_window(term.master, params.rows, params.cols)
        term.rows, term.cols = params.rows, params.cols

    async def terminal_wait(self, params: rpc.WaitParams, ctx: CallContext) -> rpc.TerminalInfo:
        """``terminal.wait``: wait for the program's exit, up to ``timeout``."""
        term = self._terminal(params.terminal_id)
        await commands.wait_done(term.done, params.timeout)
        return self._final(term, ctx)

    async def terminal_close(self, params: rpc.CloseParams, ctx: CallContext) -> rpc.TerminalInfo:
        """``terminal.close``: hang up the terminal's session and report how it ended."""
        term = self._terminal(params.terminal_id)
        ensure_fits(
            term.info(), ctx, f"the status of terminal {term.terminal_id}", spare=_ATTACH_SPARE
        )
        grace = self._limits.kill_grace if params.grace is None else params.grace
        await self._hang_up(term, grace)
        return self._final(term, ctx)

    async def _hang_up(self, term: _Terminal, grace: float) -> None:
        if term.closing is None:
            term.closing = self._background.spawn(_hang_up_session(term, grace))
        await asyncio.shield(term.closing)
        if term.task is not None:
            await asyncio.shield(term.task)


async def _hang_up_session(term: _Terminal, grace: float) -> None:
    """SIGHUP+SIGCONT to the terminal's session, SIGKILL to what outlives ``grace``."""
    leader, since = term.child.pid, term.started_ticks
    for sig in (signal.SIGHUP, signal.SIGCONT):
        for pid in session_members(leader, since):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    delay = 0.005
    while session_members(leader, since) and loop.time() < deadline:
        reaper.reap_orphans()
        await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
        delay = min(delay * 2, 0.05)
    for pid in session_members(leader, since):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if term.child.limits is not None:
        # Whatever left the session but not the terminal's cgroup.
        term.child.limits.kill()
    await term.child.wait()
