"""The session marker: how execd tags what it starts, and how it kills all of it.

Theory of operation
-------------------
Every process execd starts gets ``NAME=ID`` in its environment, where ``NAME``
is the marker variable (``EXECD_MARKER`` unless configured otherwise) and
``ID`` is a random 128-bit hex string fixed for the session. Environments are
inherited, so every descendant -- daemonised, ``setsid``'d, ``nohup``'d,
re-parented to PID 1 -- carries the marker too, unless it deliberately drops it.

Closing a session kills every process that carries the marker, as execd's own
user, without root and without a shell:

1. *Scan.* Walk ``/proc/[0-9]*``. A process is a candidate when its
   ``/proc/PID/environ`` holds the exact entry ``NAME=ID`` (a whole
   NUL-separated entry, never a substring of another one), it is not a zombie,
   and its real and effective uid (``Uid:`` in ``/proc/PID/status``) both equal
   the uid being cleaned (checked in that order: the status costs the most to
   read, and only a process carrying the marker needs it). The scanning process itself, all of its ancestors and PID 1 are never
   candidates. At most :data:`ENVIRON_READ_CAP` bytes of one environment are
   read; :func:`child_environment` places the marker *first* in the block so a
   giant environment cannot push it out of reach.
2. *Freeze.* For each candidate open a pidfd, then re-read ``/proc/PID`` to
   check the marker and uid again: the pidfd pins the process, so a PID that was
   recycled between the scan and the open is caught here and left alone. The
   process is then sent SIGSTOP through the pidfd. Freezing the whole tree
   before killing any of it means a supervisor loop cannot notice a child's
   death and respawn it.
3. *Kill.* Every frozen process gets SIGKILL through the same pidfd (a
   signal sent through a pidfd can never reach a different process), and the
   round waits briefly for the pidfds to report the exits.
4. *Repeat* until a scan finds nothing, or the timeout expires: a fork bomb
   makes every round find new processes, and the timeout bounds the loop. The
   report lists whatever the last scan still found. An empty scan is confirmed
   by one more after a short pause: a process in the middle of ``execve`` shows
   an empty ``/proc/PID/environ`` (the kernel releases a vfork parent and
   switches to the new address space before it records where the new
   environment lies), so one scan can miss a command that is just starting.

PIDs come only from ``/proc`` scans, never from files a process could write.
Killed processes are not reaped here: the caller may be their parent and its
own reaper collects them. Zombies are dead and never counted as remaining.
Without pidfd support (kernels before 5.3, or a seccomp filter that denies
``pidfd_open``) the same steps run with ``kill(2)``, which is open to PID reuse
between the check and the signal.

Limits, by design
-----------------
* ``/proc/PID/environ`` shows the environment the process received at its last
  ``execve``; later ``setenv``/``unsetenv`` calls do not change it. A process
  that execs with a fresh environment -- ``env -i``, ``execve`` with its own
  ``envp``, a login shell that rebuilds its environment -- carries no marker
  and escapes marker cleanup. So does a process whose environment cannot be
  read: a non-dumpable process of the same uid, one running under another uid
  (setuid programs), or a multi-threaded process whose main thread has already
  exited (the leader shows as a zombie without memory while other threads run).
  Containing such processes needs a cgroup or a PID namespace, not a marker.
* Setting the marker in ``os.environ`` of a running process does not mark it:
  only what was passed to ``execve`` shows in ``/proc``.
* A nested execd overwrites the marker variable in its children when it uses
  the same variable name, so an outer session's cleanup reaches the inner
  execd but not its children; use distinct variable names for nesting.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import errno
import json
import math
import os
import resource
import select
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping

import msgspec

from execd.commands import check_variables
from protocol.values import (
    DEFAULT_MARKER_VAR,
    TOKEN_VAR,
    count,
    non_negative,
    validate_marker,
    validate_marker_var,
)

__all__ = [
    "ENVIRON_READ_CAP",
    "CleanupReport",
    "child_environment",
    "cleanup",
    "cleanup_async",
    "cleanup_main",
    "find_marked",
    "scrub_own_environment",
    "set_child_subreaper",
]

ENVIRON_READ_CAP = 1024 * 1024
"""The most bytes read from one ``/proc/PID/environ``."""

DEFAULT_SECRET_VARS: tuple[str, ...] = (TOKEN_VAR,)

_STATUS_CAP = 64 * 1024
_READ_CHUNK = 64 * 1024
_MAX_ANCESTRY = 65536
_MIN_DEATH_WAIT = 0.1
_MAX_DEATH_WAIT = 1.0
_IDLE_PAUSE = 0.05
_CONFIRM_PAUSE = 0.005
_MAX_CLI_TIMEOUT = 3600.0
_PR_SET_CHILD_SUBREAPER = 36
_PIDFD_UNAVAILABLE = frozenset({errno.ENOSYS, errno.EPERM})
_FD_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE})


# -- markers and environments ---------------------------------------------------


def child_environment(
    base: Mapping[str, str],
    marker_var: str,
    marker: str,
    *,
    overrides: Mapping[str, str] | None = None,
    unset: Iterable[str] = (),
    extra: Mapping[str, str] | None = None,
    secret_vars: Iterable[str] = DEFAULT_SECRET_VARS,
) -> dict[str, str]:
    """Build the environment of a child process.

    The result is ``base`` without ``secret_vars``, updated with ``extra``, then
    with ``overrides``, without the names in ``unset``, and with ``marker_var``
    set to ``marker`` last, so nothing can replace or remove it. The marker is
    the first entry of the returned dict, which puts it at the start of the
    child's environment block where a bounded ``/proc`` read always reaches it.

    ``base`` is not modified. Raises :class:`~execd.errors.InvalidParams` when
    ``overrides``, ``extra`` or ``unset`` name the marker variable, name an
    invalid variable, or carry a value containing NUL; raises ValueError for an
    invalid ``marker_var`` or ``marker`` (a configuration bug).
    """
    validate_marker_var(marker_var)
    validate_marker(marker)
    removed = list(unset)
    check_variables(extra, None, (marker_var,), "extra environment")
    check_variables(overrides, removed, (marker_var,), "environment override")
    hidden = set(secret_vars)
    hidden.add(marker_var)
    env = {name: value for name, value in base.items() if name not in hidden}
    if extra:
        env.update(extra)
    if overrides:
        env.update(overrides)
    for name in removed:
        env.pop(name, None)
    return {marker_var: marker, **env}


def scrub_own_environment(secret_vars: Iterable[str] = DEFAULT_SECRET_VARS) -> list[str]:
    """Remove secret variables from this process's environment; return the names removed.

    The names leave ``os.environ`` (and the C library's environment, so no
    child inherits them). Because ``/proc/self/environ`` keeps showing the block
    this process was exec'd with -- readable by every process of the same uid --
    the matching entries of that original block are also overwritten with NUL
    bytes in place, when the block can be located safely. Values are never
    returned or logged.
    """
    names = list(dict.fromkeys(secret_vars))
    removed = [name for name in names if os.environ.pop(name, None) is not None]
    wiped = _wipe_exec_environment({os.fsencode(name) for name in names})
    return [name for name in names if name in removed or os.fsencode(name) in wiped]


def _own_env_block() -> tuple[int, int] | None:
    """The address range of this process's exec-time environment, if it is safe to write."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        start, end = int(fields[47]), int(fields[48])
        if not 0 < start < end or end - start > 64 * ENVIRON_READ_CAP:
            return None
        with open("/proc/self/maps", "rb") as fh:
            for line in fh:
                span, perms = line.split()[:2]
                low, high = (int(part, 16) for part in span.split(b"-"))
                if low <= start and end <= high:
                    return (start, end) if perms.startswith(b"rw") else None
    except (OSError, ValueError, IndexError):
        return None
    return None


def _wipe_exec_environment(names: set[bytes]) -> set[bytes]:
    """Overwrite entries named ``names`` in the exec-time environment block with NULs."""
    bounds = _own_env_block()
    if bounds is None:
        return set()
    start, end = bounds
    try:
        with open("/proc/self/environ", "rb") as fh:
            shown = fh.read(end - start + 1)
    except OSError:
        return set()
    block = ctypes.string_at(start, end - start)
    if block != shown:
        return set()
    wiped: set[bytes] = set()
    offset = 0
    for entry in block.split(b"\0"):
        name, sep, _ = entry.partition(b"=")
        if sep and name in names:
            ctypes.memset(start + offset, 0, len(entry))
            wiped.add(name)
        offset += len(entry) + 1
    return wiped


# -- reading /proc -------------------------------------------------------------------


class _Status(msgspec.Struct, frozen=True):
    state: str
    ppid: int
    ruid: int
    euid: int


def _read_bounded(path: str, cap: int) -> tuple[bytes, bool]:
    """Read at most ``cap`` bytes of ``path``; the flag tells whether more was there."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks: list[bytes] = []
        total = 0
        while total <= cap:
            chunk = os.read(fd, min(_READ_CHUNK, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return data[:cap], total > cap


def _read_status(pid: int) -> _Status | None:
    """State, parent and uids of ``pid``, or None when it is gone or unreadable."""
    try:
        data, _ = _read_bounded(f"/proc/{pid}/status", _STATUS_CAP)
    except OSError:
        return None
    state: str | None = None
    ppid: int | None = None
    uids: list[bytes] | None = None
    try:
        for line in data.split(b"\n"):
            key, _, value = line.partition(b":")
            if key == b"State":
                state = value.strip()[:1].decode("ascii", "replace")
            elif key == b"PPid":
                ppid = int(value)
            elif key == b"Uid":
                uids = value.split()
                break
        if state is None or ppid is None or uids is None or len(uids) < 2:
            return None
        return _Status(state=state, ppid=ppid, ruid=int(uids[0]), euid=int(uids[1]))
    except ValueError:
        return None


def _environ_has(pid: int, entry: bytes) -> bool:
    """Whether ``/proc/PID/environ`` holds ``entry`` as one whole NUL-separated entry."""
    try:
        data, truncated = _read_bounded(f"/proc/{pid}/environ", ENVIRON_READ_CAP)
    except OSError:
        return False
    if truncated:
        # The last entry was cut by the cap; a prefix of it must not match.
        data = data[: data.rfind(b"\0") + 1]
    elif data and not data.endswith(b"\0"):
        data += b"\0"
    terminated = entry + b"\0"
    return data.startswith(terminated) or b"\0" + terminated in data


def _carries(pid: int, entry: bytes, uid: int) -> bool:
    """Whether live process ``pid`` runs as ``uid`` (real and effective) and carries ``entry``."""
    # The environment first: reading it costs a third of formatting the status, and
    # almost every process on the machine fails there (or cannot be read at all).
    if not _environ_has(pid, entry):
        return False
    status = _read_status(pid)
    if status is None or status.state in ("Z", "X"):
        return False
    return status.ruid == uid and status.euid == uid


def _excluded_pids() -> set[int]:
    """This process, its ancestors and PID 1: never cleanup candidates."""
    me = os.getpid()
    try:
        seen_as = int(os.readlink("/proc/self"))
    except (OSError, ValueError) as exc:
        raise RuntimeError("/proc is not mounted or not readable") from exc
    if seen_as != me:
        raise RuntimeError(
            "/proc belongs to another PID namespace than this process; refusing to signal"
        )
    excluded = {0, 1, me}
    pid = me
    for _ in range(_MAX_ANCESTRY):
        status = _read_status(pid)
        if status is None or status.ppid in excluded:
            break
        pid = status.ppid
        excluded.add(pid)
    return excluded


def _entry(marker_var: str, marker: str) -> bytes:
    validate_marker_var(marker_var)
    validate_marker(marker)
    return f"{marker_var}={marker}".encode("ascii")


def _scan(entry: bytes, uid: int) -> list[int]:
    excluded = _excluded_pids()
    found: list[int] = []
    with os.scandir("/proc") as listing:
        for item in listing:
            name = item.name
            if not (name.isascii() and name.isdigit()):
                continue
            pid = int(name)
            if pid not in excluded and _carries(pid, entry, uid):
                found.append(pid)
    found.sort()
    return found


def find_marked(marker_var: str, marker: str, *, uid: int | None = None) -> list[int]:
    """PIDs of live processes carrying ``marker_var=marker``, sorted.

    Only processes whose real and effective uid equal ``uid`` (default: this
    process's effective uid) count. This process, its ancestors and PID 1 are
    never returned. Processes that vanish or turn unreadable mid-scan are
    skipped. Raises ValueError for an invalid marker or variable name.
    """
    return _scan(_entry(marker_var, marker), os.geteuid() if uid is None else uid)


# -- signalling ----------------------------------------------------------------------


class _PidfdUnavailable(Exception):
    """The kernel (or a seccomp filter) does not offer pidfd_open."""


def _pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid``; None if it is gone. Raises OSError when out of descriptors."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError as exc:
        if exc.errno in _PIDFD_UNAVAILABLE:
            raise _PidfdUnavailable from exc
        if exc.errno in _FD_EXHAUSTED:
            raise
        return None


def _sent(send: Callable[[int, int], None], target: int, sig: int) -> bool:
    """``send(target, sig)`` (``os.kill`` by pid or ``pidfd_send_signal``); False if refused."""
    try:
        send(target, sig)
    except OSError:
        return False
    return True


def _fd_budget() -> int:
    """How many pidfds one round may hold without starving the rest of the process."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft < 0:
        soft = 1 << 20
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    return max(16, min(4096, soft // 2 - in_use))


def _wait_exited(fds: list[int], limit: float) -> None:
    """Wait up to ``limit`` seconds for every pidfd in ``fds`` to report its exit."""
    if not fds:
        return
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    pending = len(fds)
    deadline = time.monotonic() + limit
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for fd, _ in poller.poll(max(1, math.ceil(left * 1000))):
            poller.unregister(fd)
            pending -= 1


def _kill_round(pids: list[int], entry: bytes, uid: int, death_wait: float) -> set[int]:
    """Freeze, then kill, the still-matching processes among ``pids``; return those killed."""
    held: list[tuple[int, int]] = []
    legacy: list[int] = []
    budget = _fd_budget()
    killed: set[int] = set()
    try:
        for pid in pids:
            if len(held) >= budget:
                break
            try:
                fd = _pidfd_open(pid)
            except _PidfdUnavailable:
                if _carries(pid, entry, uid) and _sent(os.kill, pid, signal.SIGSTOP):
                    legacy.append(pid)
                continue
            except OSError:
                break
            if fd is None:
                continue
            if _carries(pid, entry, uid) and _sent(signal.pidfd_send_signal, fd, signal.SIGSTOP):
                held.append((pid, fd))
            else:
                os.close(fd)
        for pid, fd in held:
            if _sent(signal.pidfd_send_signal, fd, signal.SIGKILL):
                killed.add(pid)
        for pid in legacy:
            if _carries(pid, entry, uid) and _sent(os.kill, pid, signal.SIGKILL):
                killed.add(pid)
        _wait_exited([fd for _, fd in held], death_wait)
        if legacy:
            time.sleep(min(death_wait, _IDLE_PAUSE))
    finally:
        for _, fd in held:
            os.close(fd)
    return killed


# -- cleanup ---------------------------------------------------------------------------


class CleanupReport(msgspec.Struct, frozen=True):
    """What one :func:`cleanup` did.

    ``killed`` counts distinct PIDs that were sent SIGKILL; ``remaining`` lists
    the marked processes the last scan still found (empty on success);
    ``rounds`` counts freeze-and-kill passes; ``elapsed`` is in seconds.
    """

    killed: int
    remaining: list[int]
    rounds: int
    elapsed: float


def cleanup(
    marker_var: str, marker: str, *, timeout: float = 5.0, uid: int | None = None
) -> CleanupReport:
    """Kill every process carrying ``marker_var=marker`` and running as ``uid``.

    Rounds of scan, SIGSTOP-all, SIGKILL-all repeat until a scan finds nothing
    or ``timeout`` seconds have passed (at least one round always runs). The
    killed processes are not reaped. This process, its ancestors and PID 1 are
    never touched. ``uid`` defaults to this process's effective uid. Blocking:
    from async code use :func:`cleanup_async`.
    """
    entry = _entry(marker_var, marker)
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout >= 0):
        raise ValueError("timeout must be a finite number of seconds >= 0")
    want = os.geteuid() if uid is None else uid
    started = time.monotonic()
    deadline = started + timeout
    killed: set[int] = set()
    rounds = 0
    while True:
        pids = _scan(entry, want)
        if not pids:
            time.sleep(_CONFIRM_PAUSE)
            pids = _scan(entry, want)
        if not pids or (rounds and time.monotonic() >= deadline):
            break
        rounds += 1
        left = deadline - time.monotonic()
        wait = min(_MAX_DEATH_WAIT, max(_MIN_DEATH_WAIT, left))
        hit = _kill_round(pids, entry, want, wait)
        killed |= hit
        if not hit:
            time.sleep(min(_IDLE_PAUSE, max(0.0, deadline - time.monotonic())))
    return CleanupReport(
        killed=len(killed),
        remaining=pids,
        rounds=rounds,
        elapsed=time.monotonic() - started,
    )


async def cleanup_async(
    marker_var: str, marker: str, *, timeout: float = 5.0, uid: int | None = None
) -> CleanupReport:
    """:func:`cleanup` in a worker thread, so the event loop keeps running."""
    return await asyncio.to_thread(cleanup, marker_var, marker, timeout=timeout, uid=uid)


def set_child_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux prctl).

    Returns False when the platform or kernel does not support it.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    result: int = prctl(
        ctypes.c_int(_PR_SET_CHILD_SUBREAPER),
        ctypes.c_ulong(1),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
    )
    return result == 0


# -- command line ---------------------------------------------------------------------


def _cli_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="execd cleanup",
        description="Kill every process of this user that carries the session marker, then "
        "remove the cgroups of execds that died without removing them.",
    )
    parser.add_argument("--marker", required=True, help="the session marker value")
    parser.add_argument(
        "--marker-var",
        default=DEFAULT_MARKER_VAR,
        help=f"the marker variable name (default {DEFAULT_MARKER_VAR})",
    )
    parser.add_argument(
        "--timeout",
        type=non_negative,
        default=5.0,
        help="give up after this many seconds (default 5)",
    )
    parser.add_argument(
        "--uid",
        type=count,
        help="clean up the marked processes of this user (default: this process's; needs root)",
    )
    return parser


def cleanup_main(argv: list[str] | None = None) -> int:
    """``execd cleanup --marker ID [--marker-var NAME] [--timeout S] [--uid UID]``.

    Kills the marked processes, then removes the cgroups of every execd that
    died without removing them (:func:`execd.cgroups.sweep_stale`). Prints
    one JSON line ``{"event": "cleanup", "killed": N, "remaining": [...],
    "rounds": N, "stale_cgroups_removed": N}``. Returns 0 when no marked
    process remains, 1 when some do (or the scan failed), 2 on bad arguments.
    """
    parser = _cli_parser()
    try:
        args = parser.parse_args(argv)
        try:
            validate_marker(args.marker)
        except ValueError as exc:
            parser.error(f"--marker: {exc}")
        try:
            validate_marker_var(args.marker_var)
        except ValueError as exc:
            parser.error(f"--marker-var: {exc}")
        timeout: float = args.timeout
        if not (math.isfinite(timeout) and 0 <= timeout <= _MAX_CLI_TIMEOUT):
            parser.error(f"--timeout: must be between 0 and {_MAX_CLI_TIMEOUT:g} seconds")
        if args.uid is not None and args.uid < 0:
            parser.error("--uid: must not be negative")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        report = cleanup(args.marker_var, args.marker, timeout=timeout, uid=args.uid)
    except (OSError, RuntimeError) as exc:
        print(f"execd cleanup: error: {exc}", file=sys.stderr)
        return 1
    # The cgroups of an execd that died (SIGKILL) without removing them: empty now
    # that its marked processes are gone.
    from execd.cgroups import sweep_stale

    removed, _ = sweep_stale()
    line = {
        "event": "cleanup",
        "killed": report.killed,
        "remaining": report.remaining,
        "rounds": report.rounds,
        "stale_cgroups_removed": len(removed),
    }
    print(json.dumps(line), flush=True)
    return 1 if report.remaining else 0
