"""Where the launcher's commands run: the workspace runtime interface and two built-ins.

The launcher (:mod:`harnessd.launcher`) never touches the workspace directly.
Everything it does there -- make a private directory, drop the token file,
start execd in the background, read execd's log, run ``execd cleanup`` -- goes
through an object implementing :class:`Runtime`. Two implementations ship:

* :class:`LocalRuntime`: processes on this machine (the embedded default).
* :class:`CommandPrefixRuntime`: every argv is wrapped in a fixed prefix, e.g.
  ``["ssh", "host"]``, ``["docker", "exec", "-i", "box"]`` or
  ``["ip", "netns", "exec", "ws", "setpriv", "--reuid", "agent", ...]``. The
  workspace only needs ``/bin/sh`` and the POSIX utilities ``cat``, ``chmod``
  and ``mkdir`` (``setsid`` is used when present).

An embedding framework can pass its own object instead; it only has to
provide the four coroutines of :class:`Runtime`. A runtime whose
``start_background`` itself appends execd's ``exited`` line when the command
ends, and enters a working directory it is given, is a
:class:`SupervisingRuntime` and says so with a true ``supervises`` attribute;
the launcher then starts execd without its ``/bin/sh`` supervisor
(:class:`harnessd.worker_runtime.WorkerToolRuntime`, for workspaces without a
shell). Secrets travel as file
content (``write_file`` data, on stdin for wrapped commands), never in argv or
in the environment.

Both built-ins run their commands with a scrubbed copy of harnessd's
environment (:func:`workspace_environment`): the token variable and every
variable whose name looks like a credential (``*API_KEY*``, ``*TOKEN*``,
``*SECRET*``, ``*PASSWORD*``, ...) are dropped, so a prefix that keeps the
environment (``ip netns exec``, ``setpriv``, ``sudo -E``) does not hand the
model's credentials to the workspace. Pass ``env=`` for full control and
``scrub=`` to drop more names.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import re
import shlex
import subprocess
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from harnessd import processes
from harnessd.errors import HarnessError
from protocol.values import TOKEN_VAR

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024
"""Default cap on the bytes kept from each output stream of :meth:`Runtime.run`."""

DEFAULT_MAX_READ = 16 * 1024 * 1024
"""Default largest file :meth:`Runtime.read_file` returns."""

_CHUNK = 64 * 1024
_SH = "/bin/sh"


class WorkspaceError(HarnessError):
    """A runtime operation failed: a command could not start or timed out, a file op failed."""


@dataclass(frozen=True, slots=True)
class CommandResult:
    """Outcome of :meth:`Runtime.run`.

    ``exit_code`` follows :attr:`subprocess.Popen.returncode`: negative ``-N``
    when signal ``N`` ended the command. ``truncated`` says output beyond the
    cap of one stream was dropped.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool = False


@runtime_checkable
class Runtime(Protocol):
    """What the launcher needs from a workspace: four coroutines.

    Secrets travel as file content (``write_file`` data, ``run``'s stdin),
    never in argv or in the environment.
    """

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run ``argv`` to completion and return its exit code and output.

        ``stdin`` bytes are fed to it (else it reads an empty stdin).
        ``timeout`` bounds the whole run; past it the command is killed and
        WorkspaceError raised. A command that cannot be started raises
        WorkspaceError; a non-zero exit is returned, not raised.
        """
        ...

    async def start_background(self, argv: Sequence[str], *, log_path: str) -> None:
        """Start ``argv`` detached from the caller, and return once it is started.

        It runs in its own session with stdin from ``/dev/null``, stdout and
        stderr appended to ``log_path`` (created with mode 0600 when missing).
        No PID comes back, because nothing the launcher does may depend on one.
        """
        ...

    async def read_file(self, path: str, *, max_bytes: int = DEFAULT_MAX_READ) -> bytes:
        """The whole content of ``path``.

        WorkspaceError when it cannot be read or is larger than ``max_bytes``.
        """
        ...

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o600, make_parents: bool = False
    ) -> None:
        """Create ``path`` holding ``data`` with permission bits ``mode``.

        The file must not exist yet (WorkspaceError otherwise), and is never
        accessible with wider permissions than 0600 while it is written, so a
        token written with the default mode is not readable by anyone else at
        any instant. With ``make_parents`` the missing parent directories are
        created first with mode 0700.
        """
        ...


@runtime_checkable
class SupervisingRuntime(Runtime, Protocol):
    """A :class:`Runtime` that supervises what it starts in the background (``supervises``).

    Its ``start_background`` appends ``{"event": "exited", "code": N,
    "source": "supervisor"}`` to the log once the command ends (``N`` as a
    shell reports it), and with ``cwd`` starts the command in that directory;
    when the directory cannot be entered the command is not started and the
    line has code 126 (and an ``error``), as a shell's ``cd DIR || exit 126``.
    """

    supervises: bool

    async def start_background(
        self, argv: Sequence[str], *, log_path: str, cwd: str | None = None
    ) -> None:
        """Start ``argv`` detached and supervised, in ``cwd`` when given; see :class:`Runtime`."""
        ...


CREDENTIAL_NAME = re.compile(
    r"API_?KEY|TOKEN|SECRET|PASSW(OR)?D|CREDENTIAL|PRIVATE_?KEY|ACCESS_?KEY|AUTH", re.IGNORECASE
)
"""Variable names that look like credentials; dropped from the workspace environment."""


def workspace_environment(
    base: Mapping[str, str] | None = None, *, scrub: Iterable[str] = ()
) -> dict[str, str]:
    """``base`` (default: this process's environment) without anything secret.

    Drops the token variable, every name in ``scrub``, and every name matching
    :data:`CREDENTIAL_NAME`.
    """
    source = os.environ if base is None else base
    drop = {TOKEN_VAR, *scrub}
    return {
        name: value
        for name, value in source.items()
        if name not in drop and not CREDENTIAL_NAME.search(name)
    }


def _describe(argv: Sequence[str]) -> str:
    return shlex.quote(argv[0]) if argv else "(empty argv)"


async def _collect(stream: asyncio.StreamReader | None, cap: int) -> tuple[bytes, bool]:
    if stream is None:
        return b"", False
    kept = bytearray()
    dropped = False
    while chunk := await stream.read(_CHUNK):
        room = cap - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > room:
            dropped = True
    return bytes(kept), dropped


async def _feed(writer: asyncio.StreamWriter | None, data: bytes) -> None:
    if writer is None:
        return
    try:
        writer.write(data)
        await writer.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await writer.wait_closed()


async def run_process(
    argv: Sequence[str],
    *,
    stdin: bytes | None = None,
    timeout: float | None = None,
    max_output: int = DEFAULT_MAX_OUTPUT,
    env: Mapping[str, str] | None = None,
) -> CommandResult:
    """Run ``argv`` on this machine to completion (the body of ``run`` in :class:`LocalRuntime`).

    The command leads its own session; on timeout or cancellation its whole
    process group is killed. The environment is ``env``, by default
    :func:`workspace_environment`. It inherits no descriptor of this process
    but its standard streams, on any event loop (:mod:`harnessd.processes`).
    """
    if not argv:
        raise WorkspaceError("cannot run an empty argv")
    try:
        child = await processes.start(
            argv,
            feed=stdin is not None,
            env=env if env is not None else workspace_environment(),
        )
    except OSError as exc:
        raise WorkspaceError(f"cannot start {_describe(argv)}: {exc.strerror or exc}") from None
    try:
        async with asyncio.timeout(timeout):
            (out, out_cut), (err, err_cut), _ = await asyncio.gather(
                _collect(child.stdout, max_output),
                _collect(child.stderr, max_output),
                _feed(child.stdin, stdin or b""),
            )
            code = await child.wait()
    except TimeoutError:
        child.kill_group()
        await child.wait()
        raise WorkspaceError(f"{_describe(argv)} timed out after {timeout} s") from None
    except BaseException:
        child.kill_group()
        with contextlib.suppress(BaseException):
            await asyncio.shield(child.wait())
        raise
    finally:
        child.close()
    return CommandResult(exit_code=code, stdout=out, stderr=err, truncated=out_cut or err_cut)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    proc.wait()


def _spawn_detached(argv: Sequence[str], log_path: str, env: Mapping[str, str]) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    log_fd = os.open(log_path, flags, 0o600)
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            start_new_session=True,
            close_fds=True,
            env=dict(env),
        )
    finally:
        os.close(log_fd)
    threading.Thread(target=_reap, args=(proc,), name=f"reap-{proc.pid}", daemon=True).start()


def _make_private_dirs(directory: str) -> None:
    """``mkdir -p`` where every directory created gets mode 0700 (not only the last)."""
    if not directory or os.path.isdir(directory):
        return
    _make_private_dirs(os.path.dirname(directory))
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)


def _write_new_file(path: str, data: bytes, mode: int, make_parents: bool) -> None:
    if make_parents:
        _make_private_dirs(os.path.dirname(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def _read_capped(path: str, max_bytes: int) -> bytes:
    with open(path, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise WorkspaceError(f"{path} is larger than {max_bytes} bytes")
    return data


def _os_failure(action: str, path: str, exc: OSError) -> WorkspaceError:
    return WorkspaceError(f"cannot {action} {path}: {exc.strerror or exc}")


class _ProcessRuntime:
    """What both runtimes on this machine share: commands run through :func:`run_process`."""

    max_output: int
    env: dict[str, str]

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The argv actually run on this machine for ``argv`` in the workspace."""
        return list(argv)

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run ``wrap(argv)`` here to completion; see :class:`Runtime`."""
        if not argv:
            raise WorkspaceError("cannot run an empty argv")
        return await run_process(
            self.wrap(argv), stdin=stdin, timeout=timeout, max_output=self.max_output, env=self.env
        )


class LocalRuntime(_ProcessRuntime):
    """Processes and files on this machine, as this process's user.

    ``start_background`` makes the process a direct child in a session of its
    own (so a terminal's Ctrl-C or a hangup of the harness does not reach it),
    with stdin from ``/dev/null``; a daemon thread reaps it whenever it exits,
    independent of any event loop. Files are written with
    ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 from the first instant.
    """

    def __init__(
        self,
        *,
        max_output: int = DEFAULT_MAX_OUTPUT,
        env: Mapping[str, str] | None = None,
        scrub: Iterable[str] = (),
    ) -> None:
        self.max_output = max_output
        self.env = workspace_environment(env, scrub=scrub)

    def __repr__(self) -> str:
        return "LocalRuntime()"

    async def start_background(self, argv: Sequence[str], *, log_path: str) -> None:
        """Start ``argv`` detached, output appended to ``log_path``; see :class:`Runtime`."""
        if not argv:
            raise WorkspaceError("cannot start an empty argv")
        try:
            await asyncio.to_thread(_spawn_detached, argv, log_path, self.env)
        except OSError as exc:
            raise WorkspaceError(f"cannot start {_describe(argv)}: {exc.strerror or exc}") from None

    async def read_file(self, path: str, *, max_bytes: int = DEFAULT_MAX_READ) -> bytes:
        """The content of ``path``; see :class:`Runtime`."""
        try:
            return await asyncio.to_thread(_read_capped, path, max_bytes)
        except OSError as exc:
            raise _os_failure("read", path, exc) from None

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o600, make_parents: bool = False
    ) -> None:
        """Create ``path`` with ``data`` and ``mode``; see :class:`Runtime`."""
        try:
            await asyncio.to_thread(_write_new_file, path, data, mode & 0o7777, make_parents)
        except OSError as exc:
            raise _os_failure("write", path, exc) from None


# Runs as: sh -c SCRIPT sh LOG ARGV...  Creates the log 0600 without changing the
# umask the command inherits, then starts the command in the background in a
# session of its own (when setsid exists) and returns at once.
_BACKGROUND_SCRIPT = """\
log=$1; shift
saved=$(umask)
umask 077
: >>"$log" || exit 1
umask "$saved"
if command -v setsid >/dev/null 2>&1; then set -- setsid "$@"; fi
"$@" </dev/null >>"$log" 2>&1 &
"""

# Runs as: sh -c SCRIPT sh PATH MODE PARENT, data on stdin.  noclobber makes
# the redirection fail on an existing file (O_EXCL); umask 077 keeps the file
# 0600 until the final chmod.
_WRITE_SCRIPT = """\
umask 077
if [ -n "$3" ]; then mkdir -p -m 700 -- "$3" || exit 1; fi
set -C
cat >"$1" || exit 1
chmod "$2" -- "$1"
"""


class CommandPrefixRuntime(_ProcessRuntime):
    """Every command runs as ``prefix + argv``: ssh, docker exec, ip netns exec, setpriv, ...

    ``run(argv)`` runs ``prefix + argv``. ``start_background`` runs a short
    ``/bin/sh`` script through the prefix that starts the command in the
    background (under ``setsid`` when available) with output appended to the
    log, and returns immediately. ``read_file`` runs ``cat``; ``write_file``
    runs ``/bin/sh`` with ``umask 077`` and noclobber, the data on stdin.
    Paths and arguments are passed as separate argv items, never spliced into
    shell text. A prefix that goes through a remote shell (``ssh``) joins its
    arguments into one command line: every argument after the prefix is then
    shell-quoted with :func:`shlex.quote` when ``quote_for_remote_shell`` is set.
    """

    def __init__(
        self,
        prefix: Sequence[str],
        *,
        quote_for_remote_shell: bool = False,
        max_output: int = DEFAULT_MAX_OUTPUT,
        env: Mapping[str, str] | None = None,
        scrub: Iterable[str] = (),
    ) -> None:
        if isinstance(prefix, str) or not all(isinstance(part, str) for part in prefix):
            raise TypeError("prefix must be a sequence of strings")
        self.prefix = list(prefix)
        self.quote_for_remote_shell = quote_for_remote_shell
        self.max_output = max_output
        self.env = workspace_environment(env, scrub=scrub)

    def __repr__(self) -> str:
        return f"CommandPrefixRuntime({self.prefix!r})"

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The argv actually run on this machine for ``argv`` in the workspace."""
        tail = [shlex.quote(arg) for arg in argv] if self.quote_for_remote_shell else list(argv)
        return [*self.prefix, *tail]

    async def start_background(self, argv: Sequence[str], *, log_path: str) -> None:
        """Start ``argv`` detached in the workspace; see :class:`Runtime`."""
        if not argv:
            raise WorkspaceError("cannot start an empty argv")
        result = await self.run([_SH, "-c", _BACKGROUND_SCRIPT, "sh", log_path, *argv])
        if result.exit_code != 0:
            raise WorkspaceError(
                f"cannot start {_describe(argv)} in the background "
                f"(status {result.exit_code}): {stderr_text(result)}"
            )

    async def read_file(self, path: str, *, max_bytes: int = DEFAULT_MAX_READ) -> bytes:
        """The content of ``path`` via ``cat``; see :class:`Runtime`."""
        result = await run_process(
            self.wrap(["cat", "--", path]), max_output=max_bytes, timeout=None, env=self.env
        )
        if result.exit_code != 0:
            raise WorkspaceError(f"cannot read {path}: {stderr_text(result)}")
        if result.truncated:
            raise WorkspaceError(f"{path} is larger than {max_bytes} bytes")
        return result.stdout

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o600, make_parents: bool = False
    ) -> None:
        """Create ``path`` with ``data`` and ``mode`` via ``/bin/sh``; see :class:`Runtime`."""
        parent = posixpath.dirname(path) if make_parents else ""
        argv = [_SH, "-c", _WRITE_SCRIPT, "sh", path, format(mode & 0o7777, "o"), parent]
        result = await self.run(argv, stdin=data)
        if result.exit_code != 0:
            raise WorkspaceError(f"cannot write {path}: {stderr_text(result)}")


def stderr_text(result: CommandResult, limit: int = 2000) -> str:
    """The tail of a command's stderr for an error message (its status when it printed nothing)."""
    text = result.stderr.decode("utf-8", "replace").strip()
    if len(text) > limit:
        text = "..." + text[-limit:]
    return text or f"exit status {result.exit_code}"


async def remove_workdir(runtime: Runtime, path: str) -> None:
    """Remove a launcher working directory and everything in it (``rm -rf``) via ``runtime``.

    :meth:`~harnessd.launcher.Session.close` calls this when it does not keep the log and
    :func:`~harnessd.launcher.serve` created the directory. Refuses relative paths, ``/`` and paths with ``..``.
    Raises WorkspaceError when removal fails.
    """
    normal = posixpath.normpath(path)
    if not posixpath.isabs(path) or not normal.strip("/") or ".." in path.split("/"):
        raise ValueError(f"refusing to remove {path!r}")
    result = await runtime.run(["rm", "-rf", "--", normal], timeout=30.0)
    if result.exit_code != 0:
        detail = result.stderr.decode("utf-8", "replace").strip()[:500]
        raise WorkspaceError(f"cannot remove {normal}: {detail}")
