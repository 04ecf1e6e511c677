"""``execd tool ...``: the few workspace utilities harnessd needs, built into execd.

Starting execd in a workspace takes a handful of small steps there: make a
private directory, write the token file, start execd in the background with
its output in a log and a line added when it ends, read the log, remove what
was made. Where the workspace has ``/bin/sh`` and the POSIX utilities, harnessd
uses those (:class:`harnessd.runtime.CommandPrefixRuntime`). A workspace made
from a bare image may have neither; there the self-contained worker is its own
toolbox, and harnessd runs ``WORKER tool NAME ...`` instead
(:class:`harnessd.worker_runtime.WorkerToolRuntime`).

Commands (a failure prints one line on stderr and exits 1; a usage error exits 2):

``probe``
    One JSON line: machine architecture, kernel release, uid, ``HOME``,
    whether ``/bin/sh`` can be run, and -- from the worker file -- its own path
    and SHA-256.
``sha256 PATH``
    The hex SHA-256 of the file.
``mkdir [-p] [-m MODE] [--] DIR...``
    As POSIX ``mkdir``: ``-m`` sets the exact mode of each directory named.
``rm [-f] [-r] [--] PATH...``
    As POSIX ``rm``; ``-r`` never follows a symbolic link.
``rmdir [--] DIR...``
    As POSIX ``rmdir``: only empty directories.
``cat [--] PATH``
    The file on stdout.
``write [-m MODE] [-p] [--] PATH``
    stdin into a *new* file (never an existing one, never through a symbolic
    link), mode 0600 until the whole content is written, then ``MODE``
    (default 0600); ``-p`` first makes the missing parents with mode 0700.
``start [--settle SECONDS] [--cwd DIR] LOG [--] ARGV...``
    Start ``ARGV`` detached (a session of its own, stdin on ``/dev/null``,
    stdout and stderr appended to ``LOG``, created 0600) under a supervisor
    that appends ``{"event": "exited", "code": N, "source": "supervisor"}``
    once it ends (``N`` as a shell reports it: 128 + the signal's number after
    a signal). With ``--cwd`` the supervisor enters ``DIR`` first, so ``ARGV``
    runs there; when it cannot, ``ARGV`` is not started and the supervisor's
    line says so with code 126, as ``cd DIR || exit 126`` in a shell would.
    Returns once ``ARGV`` has been started (or the supervisor has reported),
    or fails with the reason it could not be; with ``--settle``, not before
    the log has grown (the command said something, or ended) or that many
    seconds have passed, which spares a caller that polls the log its first
    empty reads.
``hold``
    Wait for SIGTERM, SIGINT or SIGHUP, reaping any child that ends: a
    container's long-running first process when the image has nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

from execd import frozen

SHELL = "/bin/sh"
_CHUNK = 1024 * 1024
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
_HOLD_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
_SETTLE_POLL = 0.01
_CANNOT_ENTER = "cannot enter the directory given as cwd"


class ToolFailed(Exception):
    """A tool could not do what it was asked; the message is its one line on stderr."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def _mode(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode") from None
    if not 0 <= value <= 0o7777:
        raise argparse.ArgumentTypeError(f"{text!r} is not a file mode")
    return value


def _failure(action: str, path: str, exc: OSError) -> ToolFailed:
    return ToolFailed(f"cannot {action} {path}: {exc.strerror or exc}")


# -- the commands --------------------------------------------------------------------


def file_sha256(path: str) -> str:
    """The hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def probe() -> dict[str, object]:
    """What harnessd asks of a workspace before installing or starting the worker."""
    uname = os.uname()
    worker = frozen.worker_path()
    facts: dict[str, object] = {
        "arch": uname.machine,
        "kernel": uname.release,
        "uid": os.getuid(),
        "home": os.environ.get("HOME"),
        "shell": os.access(SHELL, os.X_OK),
        "worker": worker,
        "sha256": None,
    }
    if worker is not None:
        facts["sha256"] = file_sha256(worker)
    return facts


def make_directories(paths: Sequence[str], *, parents: bool, mode: int | None) -> None:
    """``mkdir [-p] [-m MODE] PATH...``."""
    for path in paths:
        try:
            if parents:
                head = os.path.dirname(path.rstrip("/"))
                if head:
                    os.makedirs(head, exist_ok=True)
                if os.path.isdir(path):
                    continue
            os.mkdir(path, 0o777 if mode is None else mode & 0o777)
            if mode is not None:
                os.chmod(path, mode)
        except OSError as exc:
            raise _failure("create the directory", path, exc) from None


def remove(paths: Sequence[str], *, force: bool, recursive: bool) -> None:
    """``rm [-f] [-r] PATH...``; ``-r`` removes a symbolic link, never what it points to."""
    for path in paths:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            if force:
                continue
            raise ToolFailed(f"cannot remove {path}: No such file or directory") from None
        except OSError as exc:
            raise _failure("remove", path, exc) from None
        try:
            if stat.S_ISDIR(info.st_mode):
                if not recursive:
                    raise ToolFailed(f"cannot remove {path}: Is a directory")
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError as exc:
            raise _failure("remove", path, exc) from None


def remove_directories(paths: Sequence[str]) -> None:
    """``rmdir DIR...``: each must be empty."""
    for path in paths:
        try:
            os.rmdir(path)
        except OSError as exc:
            raise _failure("remove the directory", path, exc) from None


def copy_out(path: str) -> None:
    """``cat PATH``: the file's bytes on stdout."""
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                sys.stdout.buffer.write(chunk)
    except OSError as exc:
        raise _failure("read", path, exc) from None
    sys.stdout.buffer.flush()


def write_new(path: str, *, mode: int, parents: bool) -> None:
    """stdin into a new file at ``path``; 0600 until it is whole, then ``mode``."""
    try:
        if parents:
            _private_parents(os.path.dirname(path))
        fd = os.open(path, _NEW_FILE, 0o600)
    except OSError as exc:
        raise _failure("write", path, exc) from None
    try:
        source = sys.stdin.buffer
        while chunk := source.read(_CHUNK):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
    except BaseException as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        if isinstance(exc, OSError):
            raise _failure("write", path, exc) from None
        raise
    os.close(fd)


def _private_parents(directory: str) -> None:
    if not directory or os.path.isdir(directory):
        return
    _private_parents(os.path.dirname(directory))
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)


def _status_of(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.waitstatus_to_exitcode(wait_status)


def start_detached(
    log_path: str, argv: Sequence[str], *, settle: float = 0.0, cwd: str | None = None
) -> None:
    """``start LOG ARGV...``: see the module's description.

    The supervisor is a fork of this process: it leads a new session, spawns
    ``argv`` and reports to this process through a pipe whether that worked;
    this process returns as soon as it knows. The supervisor then only waits
    and writes (nothing it does needs a module it has not imported yet, as a
    worker file's unpacked modules go away with this process).
    """
    if not argv:
        raise ToolFailed("start: nothing to start")
    try:
        log_fd = os.open(log_path, _LOG_FLAGS, 0o600)
        before = os.fstat(log_fd).st_size
    except OSError as exc:
        raise _failure("open the log", log_path, exc) from None
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        _supervise(log_fd, ready_w, argv, cwd)
    os.close(ready_w)
    os.close(log_fd)
    with os.fdopen(ready_r, "rb") as ready:
        answer = ready.read(4096)
    if answer != b"ok":
        raise ToolFailed(answer.decode("utf-8", "replace") or "start: the supervisor died")
    _await_growth(log_path, before, settle)


def _await_growth(path: str, size: int, limit: float) -> None:
    """Return once the file at ``path`` is larger than ``size``, or after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if os.stat(path).st_size > size:
                return
        except OSError:
            return
        time.sleep(_SETTLE_POLL)


def _supervise(log_fd: int, ready_w: int, argv: Sequence[str], cwd: str | None) -> NoReturn:
    """The supervisor's whole life (in the forked child)."""
    code = 1
    error = ""
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        try:
            if cwd is not None:
                os.chdir(cwd)
        except OSError as exc:
            # Said in the log, as a shell supervisor's ``cd`` would say it; the start worked.
            os.write(2, f"execd tool start: cannot enter {cwd}: {exc.strerror or exc}\n".encode())
            os.write(ready_w, b"ok")
            code, error = 126, _CANNOT_ENTER
        else:
            code = _run_supervised(argv, ready_w)
        why = f', "error": "{error}"' if error else ""
        line = f'{{"event": "exited", "code": {code}, "source": "supervisor"{why}}}\n'
        os.write(1, line.encode())
    finally:
        os._exit(code)


def _run_supervised(argv: Sequence[str], ready_w: int) -> int:
    """Spawn ``argv``, say on ``ready_w`` whether that worked, and wait for it; its status."""
    try:
        child = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, close_fds=True)
    except OSError as exc:
        os.write(ready_w, f"cannot start {argv[0]}: {exc.strerror or exc}".encode())
        return 127
    os.write(ready_w, b"ok")
    os.close(ready_w)
    while True:
        try:
            _, status = os.waitpid(child.pid, 0)
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        return _status_of(status)


def hold() -> None:
    """Wait for SIGTERM, SIGINT or SIGHUP; reap every child that ends meanwhile."""
    waited = {*_HOLD_SIGNALS, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    while True:
        info = signal.sigwaitinfo(waited)
        if info.si_signo in _HOLD_SIGNALS:
            return
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


# -- the command line ----------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="execd tool", description="Workspace utilities built into execd.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    commands.add_parser("probe", help="describe this workspace as one JSON line")
    digest = commands.add_parser("sha256", help="the SHA-256 of a file")
    digest.add_argument("path")
    mkdir = commands.add_parser("mkdir", help="make directories")
    mkdir.add_argument("-p", dest="parents", action="store_true")
    mkdir.add_argument("-m", dest="mode", type=_mode)
    mkdir.add_argument("paths", nargs="+")
    rm = commands.add_parser("rm", help="remove files and directories")
    rm.add_argument("-f", dest="force", action="store_true")
    rm.add_argument("-r", "-R", dest="recursive", action="store_true")
    rm.add_argument("paths", nargs="*")
    rmdir = commands.add_parser("rmdir", help="remove empty directories")
    rmdir.add_argument("paths", nargs="+")
    cat = commands.add_parser("cat", help="a file on stdout")
    cat.add_argument("path")
    write = commands.add_parser("write", help="stdin into a new file")
    write.add_argument("-m", dest="mode", type=_mode, default=0o600)
    write.add_argument("-p", dest="parents", action="store_true")
    write.add_argument("path")
    start = commands.add_parser("start", help="start a command detached and supervised")
    start.add_argument("--settle", type=float, default=0.0)
    start.add_argument("--cwd", default=None)
    start.add_argument("log")
    start.add_argument("argv", nargs=argparse.REMAINDER)
    commands.add_parser("hold", help="wait for SIGTERM, reaping children")
    return parser


def _run(args: argparse.Namespace) -> None:
    handlers: dict[str, Callable[[], object]] = {
        "probe": lambda: print(json.dumps(probe(), sort_keys=True), flush=True),
        "sha256": lambda: print(file_sha256(args.path), flush=True),
        "mkdir": lambda: make_directories(args.paths, parents=args.parents, mode=args.mode),
        "rm": lambda: remove(args.paths, force=args.force, recursive=args.recursive),
        "rmdir": lambda: remove_directories(args.paths),
        "cat": lambda: copy_out(args.path),
        "write": lambda: write_new(args.path, mode=args.mode, parents=args.parents),
        "start": lambda: start_detached(
            args.log, _command(args.argv), settle=args.settle, cwd=args.cwd
        ),
        "hold": hold,
    }
    handlers[args.command]()


def _command(argv: list[str]) -> list[str]:
    return argv[1:] if argv[:1] == ["--"] else argv


def main(argv: list[str] | None = None) -> int:
    """``execd tool COMMAND ...``; the exit status."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        _run(args)
    except ToolFailed as exc:
        print(f"execd tool {args.command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"execd tool {args.command}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
