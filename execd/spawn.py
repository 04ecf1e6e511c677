"""Spawning processes and watching their exit.

This module is the one place where execd creates processes.

Spawning
    :func:`spawn` starts every command with ``setsid`` (it leads its own
    session and process group), stdin on ``/dev/null`` or a pipe, and
    stdout/stderr on pipes:

    * without a working directory, through ``os.posix_spawnp`` (or
      ``os.posix_spawn`` after a ``PATH`` search in the command's
      environment when its ``PATH`` differs from execd's):
      glibc clones with ``CLONE_VM|CLONE_VFORK``, applies the three stdio
      actions, resets every signal to its default and execs; exec
      failures come back as the call's errno. It closes nothing else in the
      child, so descriptors execd inherited are made close-on-exec once
      (everything Python opens already is);
    * with a working directory, the same through glibc's ``posix_spawn``
      called with :mod:`ctypes` (:mod:`execd.spawn_at`), which adds a
      ``chdir`` action (``os.posix_spawn`` has none) and keeps what it can
      between calls (the environment vector, the attributes, the file
      actions), so asking for a directory costs no ``getcwd()`` and stays
      within about 20 us of ``os.posix_spawnp``; where the C library lacks
      the action, through :class:`subprocess.Popen` when the directory is
      not execd's own (the ``posix_spawnp`` path when it is), which also
      uses ``vfork``, changes directory in the child, closes stray
      descriptors and reports ``chdir``/exec failures with their errno.

    Measured with ``python -m bench.spawn`` (spawn ``true``, wait, read its
    output to EOF): the posix_spawn path costs about what a blocking
    ``subprocess.run`` does and well under the event loops' own
    ``create_subprocess_exec``, which add transports, protocols and a child
    watcher per process; the Popen path costs a Python-level Popen more
    (about 0.2 ms for the constructor alone). Inside the ``vfork`` window,
    glibc's child resets every signal's disposition: one ``rt_sigaction``
    per signal, as every one is named in ``setsigdef`` (else two for most,
    about 120 calls; CPython's own ``fork_exec`` makes about 60), paid while
    execd waits.

Exit watching
    The parent holds a pidfd of the child (``os.pidfd_open``, Linux 5.3) and
    watches it with :class:`execd.pipes.Readiness` (as the child's pipes):
    the pidfd becomes readable when the child exits, and the callback reaps
    exactly that pid with ``waitpid(pid, WNOHANG)``. No SIGCHLD handler, no watcher thread, and the
    same code runs on uvloop and on asyncio's own loops. A child that
    :func:`spawn` started is tracked (:func:`execd.reaper.track`) until it is
    reaped, so the orphan reaper never takes its status; its exit asks the
    reaper for a scan soon, as its orphans are likely to die with it.

The parent ends of the child's pipes are read and written with
:mod:`execd.pipes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from execd import pipes, procfs, reaper, spawn_at
from execd.commands import SHELL
from execd.errors import InvalidParams, SpawnFailed

if TYPE_CHECKING:
    from execd.limits import Plan

_DEFAULT_SIGNALS = tuple(
    sorted(
        signum
        for signum in signal.valid_signals()
        if signum not in (signal.SIGKILL, signal.SIGSTOP)
    )
)
"""Signals a command starts with at their default: every one whose disposition can be set.

Among them those Python ignores (SIGPIPE, SIGXFSZ) and those an ignoring
parent would pass on (SIGINT, SIGQUIT, SIGHUP under ``nohup``). Naming them
all also halves what glibc's child does in the ``vfork`` window: a signal in
this set gets one ``rt_sigaction``, any other a query first (62 calls per
spawn instead of 118 with four signals named). The ``Popen`` fallback (a C
library without the chdir action, with a ``cwd``) resets SIGPIPE, SIGXFSZ,
SIGINT and SIGQUIT only (:func:`_make_interrupts_inheritable_as_default`).
"""
_STOP_SIGNALS = frozenset(
    {signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGCONT}
)


# -- exit statuses ---------------------------------------------------------------


def decode_status(status: int) -> tuple[int | None, int | None]:
    """``(exit_code, signal)`` of a ``waitpid`` status; exactly one is not None."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status), None


# -- spawning --------------------------------------------------------------------


@dataclass(eq=False, repr=False, slots=True)
class Child:
    """A running (or finished) spawned process and the parent ends of its pipes.

    ``stdin`` is the nonblocking write end of the child's stdin pipe, or
    ``None`` when stdin is ``/dev/null``; ``stdout`` and ``stderr`` are the
    nonblocking read ends. The caller owns those descriptors (hand them to a
    :class:`PipeReader` or close them). The child leads its own process
    group, whose id is its pid.

    ``exited`` resolves to the raw wait status once the child has been
    reaped. Await :meth:`wait` rather than ``exited`` itself: cancelling a
    task cancels the future it awaits. ``started`` and ``ended`` are the
    ``time.monotonic()`` of the spawn and of the reaping.
    """

    _loop: asyncio.AbstractEventLoop
    started: float
    pid: int
    _popen: subprocess.Popen[bytes] | None
    _pidfd: int
    stdin: int | None
    stdout: int
    stderr: int
    ended: float = field(init=False)
    exited: asyncio.Future[int] = field(init=False)
    limits: Plan | None = field(init=False, default=None)
    _waiters: list[asyncio.Future[int]] = field(init=False, default_factory=list)
    _readiness: pipes.Readiness = field(init=False)

    def __post_init__(self) -> None:
        self.ended = self.started
        self.exited = self._loop.create_future()
        self._readiness = pipes.readiness(self._loop)
        self._readiness.add(self._pidfd, self._on_pidfd)

    def wait(self) -> asyncio.Future[int]:
        """A new future of the wait status; cancelling it concerns no one else."""
        waiter: asyncio.Future[int] = self._loop.create_future()
        if self.exited.done():
            waiter.set_result(self.exited.result())
        else:
            self._waiters.append(waiter)
        return waiter

    @property
    def running(self) -> bool:
        """Whether the child has not been reaped yet."""
        return not self.exited.done()

    def _on_pidfd(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            # Reaped behind our back: report it as killed rather than hang.
            pid, status = self.pid, int(signal.SIGKILL)
        if pid == 0:
            return
        self._finish(status)

    def _finish(self, status: int) -> None:
        self.ended = time.monotonic()
        self._readiness.remove(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        reaper.untrack(self.pid)
        if self._popen is not None:
            # Keeps Popen.__del__ from queueing the pid for its own waitpid.
            self._popen.returncode = os.waitstatus_to_exitcode(status)
        if not self.exited.done():
            self.exited.set_result(status)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(status)
        reaper.poke_reapers()

    def signal(self, sig: int, *, group: bool = True) -> bool:
        """Send ``sig`` to the child's process group (or the child alone).

        Returns False when there is no one left to receive it. A lone child
        is only signalled while it is unreaped, so its pid cannot have been
        reused.
        """
        try:
            if group:
                os.killpg(self.pid, sig)
            elif self.running:
                os.kill(self.pid, sig)
            else:
                return False
        except ProcessLookupError:
            return False
        return True

    def signal_and_continue(self, sig: int, *, group: bool = True) -> bool:
        """Send ``sig`` then SIGCONT, so a stopped target wakes up to receive it."""
        delivered = self.signal(sig, group=group)
        if delivered and sig not in _STOP_SIGNALS and sig != 0:
            self.signal(signal.SIGCONT, group=group)
        return delivered

    def group_alive(self) -> bool:
        """Whether any live (not zombie) process is left in the child's group."""
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return next(procfs.live_group_members(self.pid), None) is not None

    def close_stdin(self) -> None:
        """Close the parent's end of the stdin pipe, if open."""
        if self.stdin is not None:
            os.close(self.stdin)
            self.stdin = None


def _spawn_error(exc: OSError, argv0: str, cwd: str | None) -> SpawnFailed:
    name = errno.errorcode.get(exc.errno or 0, "EIO")
    reason = exc.strerror or name
    if _blames_cwd(exc, argv0, cwd):
        assert cwd is not None
        where, what = cwd, "working directory"
    else:
        where, what = argv0, "command"
    if exc.errno == errno.ENOENT:
        message = f"{what} not found: {where}"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        message = f"{what} not permitted: {where}"
    elif what == "working directory" and exc.errno == errno.ENOTDIR:
        message = f"the working directory is not a directory: {where}"
    elif what == "working directory":
        message = f"cannot enter the working directory {where}: {reason}"
    else:
        message = f"cannot start {where}: {reason}"
    return SpawnFailed(message, {"errno": name, "path": where, "what": what})


def _blames_cwd(exc: OSError, argv0: str, cwd: str | None) -> bool:
    """Whether a failed start is the working directory's fault rather than the command's."""
    if cwd is None or cwd == argv0:
        return False
    if exc.filename == cwd:
        return True
    pathless = exc.filename is None or exc.filename == argv0
    lookup = exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES)
    return pathless and lookup and not (os.path.isdir(cwd) and os.access(cwd, os.X_OK))


def resolve_program(name: str, env: Mapping[str, str]) -> str:
    """The file ``execvp`` would run for ``name`` with ``env``'s ``PATH``.

    A name containing a slash is returned as is. Raises :class:`SpawnFailed`
    (ENOENT, or EACCES when only non-executable candidates exist), or
    :class:`InvalidParams` for a name with a NUL.
    """
    if "\0" in name:
        raise InvalidParams("the program name contains a NUL")
    if "/" in name:
        return name
    denied = False
    for directory in os.get_exec_path(env):
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and os.access(path, os.X_OK):
            return path
        denied = True
    code = errno.EACCES if denied else errno.ENOENT
    raise _spawn_error(OSError(code, os.strerror(code), name), name, None)


def check_program(name: str, env: Mapping[str, str], cwd: str | None) -> None:
    """Refuse a program file that does not exist or cannot be executed.

    For a start through a shell prelude, which would only report a missing
    program as exit status 127; raises :class:`SpawnFailed` as a direct
    spawn would.
    """
    path = os.path.join(cwd or "", resolve_program(name, env))
    if not os.access(path, os.X_OK):
        code = errno.ENOENT if not os.path.exists(path) else errno.EACCES
        raise _spawn_error(OSError(code, os.strerror(code), name), name, None)


def _high_fd(fd: int) -> int:
    """``fd`` itself, or a close-on-exec duplicate of it above 2."""
    if fd > 2:
        return fd
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return high


def _pipe() -> tuple[int, int]:
    """A close-on-exec pipe whose ends are both above 2 (stdio is remapped)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        r = _high_fd(r)
        w = _high_fd(w)
    except OSError:
        for fd in (r, w):
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
    return r, w


_swept = False


def _sweep_inherited_fds() -> None:
    """Make every descriptor above 2 close-on-exec (once per process).

    ``os.posix_spawn`` closes nothing in the child: descriptors execd
    inherited from whoever started it, if left inheritable, would leak into
    every command. Descriptors Python creates are close-on-exec already.
    """
    global _swept
    if _swept:
        return
    _swept = True
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd > 2:
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    os.set_inheritable(fd, False)


_INTERRUPTS = (signal.SIGINT, signal.SIGQUIT)


def _ignore_in_parent(signum: int, frame: object) -> None:
    """Stands in for SIG_IGN: caught signals revert to their default at exec."""


def _make_interrupts_inheritable_as_default() -> None:
    """Keep an ignored SIGINT/SIGQUIT from reaching the commands execd starts.

    A process started in the background by a shell begins with SIGINT and
    SIGQUIT ignored, and an ignored disposition survives exec: every command
    would then be deaf to interrupts. A caught one does not survive exec, so
    an ignored disposition here is replaced by a handler that does nothing
    (this process still ignores them; its children start at the default).
    ``posix_spawn`` resets them itself through ``setsigdef``; this covers the
    ``Popen`` path, which cannot.
    """
    for signum in _INTERRUPTS:
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signum) == signal.SIG_IGN:
                signal.signal(signum, _ignore_in_parent)


def shell_available() -> bool:
    """Whether :data:`execd.commands.SHELL` can run here (a bare image may have none)."""
    return os.access(SHELL, os.X_OK)


def popen_with_prelude(
    argv: list[str],
    *,
    env: Mapping[str, str],
    cwd: str | None,
    stdin: int,
    stdout: int,
    stderr: int,
    prelude: Callable[[], None],
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session after ``prelude`` ran in the child (between fork and exec).

    What a shell prelude does where there is no shell. The child only makes
    system calls (no lock another thread of execd may hold is needed), and
    C library and interpreter state are made safe across ``fork`` by both.
    Raises OSError as a spawn would, and :class:`SpawnFailed` when ``prelude``
    failed.
    """
    _make_interrupts_inheritable_as_default()
    try:
        return subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
            env=env,
            start_new_session=True,
            preexec_fn=prelude,
        )
    except subprocess.SubprocessError as exc:
        raise SpawnFailed(f"cannot prepare the process: {exc}") from None


def _start(
    argv: list[str],
    env: Mapping[str, str],
    cwd: str | None,
    stdin_fd: int,
    stdout_fd: int,
    stderr_fd: int,
    prelude: Callable[[], None] | None = None,
) -> tuple[int, subprocess.Popen[bytes] | None]:
    """Start the process; ``(pid, popen or None)``. ``stdin_fd < 0``: /dev/null."""
    if prelude is not None:
        popen = popen_with_prelude(
            argv,
            env=env,
            cwd=cwd,
            stdin=stdin_fd if stdin_fd >= 0 else subprocess.DEVNULL,
            stdout=stdout_fd,
            stderr=stderr_fd,
            prelude=prelude,
        )
        return popen.pid, popen
    # With the chdir action, a cwd (even execd's own) costs no getcwd() here.
    at = cwd is not None and spawn_at.available()
    if cwd is not None and not at and cwd != os.getcwd():
        _make_interrupts_inheritable_as_default()
        popen = subprocess.Popen(
            argv,
            stdin=stdin_fd if stdin_fd >= 0 else subprocess.DEVNULL,
            stdout=stdout_fd,
            stderr=stderr_fd,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        return popen.pid, popen
    stdin_action: tuple[Any, ...] = (
        (os.POSIX_SPAWN_DUP2, stdin_fd, 0)
        if stdin_fd >= 0
        else (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)
    )
    actions = [
        stdin_action,
        (os.POSIX_SPAWN_DUP2, stdout_fd, 1),
        (os.POSIX_SPAWN_DUP2, stderr_fd, 2),
    ]
    _sweep_inherited_fds()
    if at:
        assert cwd is not None
        return _spawn_in(argv, env, cwd, actions), None
    if env.get("PATH") == os.environ.get("PATH"):
        # posix_spawnp searches execd's own PATH, which is the command's too.
        return os.posix_spawnp(
            argv[0], argv, env, file_actions=actions, setsid=True, setsigdef=_DEFAULT_SIGNALS
        ), None
    program = resolve_program(argv[0], env)
    return os.posix_spawn(
        program, argv, env, file_actions=actions, setsid=True, setsigdef=_DEFAULT_SIGNALS
    ), None


def _spawn_in(argv: list[str], env: Mapping[str, str], cwd: str, actions: list[Any]) -> int:
    """posix_spawn with a working directory (:mod:`execd.spawn_at`); errors name what failed."""
    search = env.get("PATH") == os.environ.get("PATH")
    program = argv[0] if search else resolve_program(argv[0], env)
    try:
        return spawn_at.spawn_in(
            program,
            argv,
            env,
            cwd=cwd,
            file_actions=actions,
            search=search,
            setsid=True,
            setsigdef=_DEFAULT_SIGNALS,
        )
    except OSError as exc:
        # One errno for a failed chdir or exec: blame the directory if it cannot be entered.
        usable = os.path.isdir(cwd) and os.access(cwd, os.X_OK)
        raise OSError(exc.errno, exc.strerror, program if usable else cwd) from None


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | None = None,
    stdin_pipe: bool = False,
    limits: Plan | None = None,
) -> Child:
    """Start ``argv`` in a new session with piped stdout/stderr.

    With ``limits`` the command starts behind their prelude (:mod:`execd.limits`),
    or, where there is no shell, through :func:`popen_with_prelude`.

    ``argv[0]`` is searched in the ``PATH`` of ``env``. stdin is a pipe when
    ``stdin_pipe`` is true, otherwise ``/dev/null``. Must be called from a
    running event loop. Raises :class:`SpawnFailed` (errno in ``data``) when
    the program or the working directory cannot be used, and
    :class:`InvalidParams` for arguments no process can receive (NUL bytes,
    ``=`` in a variable name).
    """
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    if not argv:
        raise InvalidParams("argv must not be empty")
    argv = list(argv)
    if "\0" in argv[0]:
        raise InvalidParams("the program name contains a NUL")
    prelude: Callable[[], None] | None = None
    if limits is not None:
        check_program(argv[0], env, cwd)
        if shell_available():
            argv = limits.wrap(argv)
        else:
            prelude = limits.apply_in_child
    fds: list[int] = []
    try:
        out_r, out_w = _pipe()
        fds += (out_r, out_w)
        err_r, err_w = _pipe()
        fds += (err_r, err_w)
        in_r, in_w = _pipe() if stdin_pipe else (-1, -1)
        fds += (in_r, in_w)
    except OSError as exc:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        name = errno.errorcode.get(exc.errno or 0, "EIO")
        raise SpawnFailed(f"cannot create pipes: {exc.strerror}", {"errno": name}) from None
    try:
        pid, popen = _start(argv, env, cwd, in_r, out_w, err_w, prelude)
    except BaseException as exc:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        if isinstance(exc, SpawnFailed):
            raise
        if isinstance(exc, OSError):
            if exc.errno == errno.EACCES and "/" not in argv[0]:
                # execvp says EACCES when any PATH entry could not be searched;
                # a shell says "not found" unless a candidate file exists.
                resolve_program(argv[0], env)
            raise _spawn_error(exc, argv[0], cwd) from None
        if isinstance(exc, ValueError | TypeError):
            raise InvalidParams(f"cannot pass arguments to a process: {exc}") from None
        raise
    reaper.track(pid)
    for fd in (out_w, err_w, in_r):
        if fd >= 0:
            os.close(fd)
    for fd in (out_r, err_r, in_w):
        if fd >= 0:
            os.set_blocking(fd, False)
    pidfd = _open_pidfd(pid, popen, (out_r, err_r, in_w))
    child = Child(loop, started, pid, popen, pidfd, in_w if stdin_pipe else None, out_r, err_r)
    if limits is not None:
        limits.attach(child)
    return child


def _open_pidfd(pid: int, popen: subprocess.Popen[bytes] | None, fds: tuple[int, ...]) -> int:
    """A pidfd for the tracked group leader ``pid`` just started.

    Without one the child cannot be watched: its group is killed and reaped,
    ``fds`` (our ends of its pipes, -1 for none) are closed and SpawnFailed raised.
    """
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if popen is not None:
            popen.returncode = -signal.SIGKILL
        reaper.untrack(pid)
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        raise SpawnFailed(f"cannot watch the process: {exc.strerror}") from None


async def terminate_group(child: Child, grace: float, sig: int = signal.SIGTERM) -> None:
    """``sig`` (SIGTERM) to the child's whole group, SIGKILL whatever outlives ``grace``.

    Each signal is followed by SIGCONT so stopped members wake up to die.
    Returns once the child itself has been reaped.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    if not child.signal_and_continue(sig):
        await child.wait()
        return
    if grace > 0:
        await asyncio.wait({child.exited}, timeout=grace)
    delay = 0.005
    while child.group_alive() and loop.time() < deadline:
        reaper.reap_orphans()
        await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
        delay = min(delay * 2, 0.05)
    if child.group_alive():
        child.signal(signal.SIGKILL)
    if child.limits is not None:
        # Whatever left the group (a double fork, setsid) but not the command's cgroup.
        child.limits.kill()
    await child.wait()


# -- for other spawners (terminals) ------------------------------------------------

DEFAULT_SIGNALS = _DEFAULT_SIGNALS
spawn_error = _spawn_error
make_inherited_fds_close_on_exec = _sweep_inherited_fds


def watch(pid: int, started: float, popen: subprocess.Popen[bytes] | None = None) -> Child:
    """A :class:`Child` for a process spawned elsewhere (no pipes), already tracked."""
    pidfd = _open_pidfd(pid, popen, ())
    return Child(asyncio.get_running_loop(), started, pid, popen, pidfd, None, -1, -1)
