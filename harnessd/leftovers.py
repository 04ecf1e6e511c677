"""What harnessd and execd leave on this machine, and how ``harnessd gc`` removes it.

Theory of operation
-------------------
Everything harnessd makes in the temporary directory has a name of its own
(:data:`KINDS`): the launcher's private directories (``execd-<16 hex>``,
token file, log and execd's state), the workspaces of ``harnessd run`` and
``harnessd demo`` (``harnessd-run-*``, ``harnessd-demo-*``) and the rollout
directories of :class:`~harnessd.rollouts.LocalWorkspace` (``rollout-*``).
Normally each goes when its session ends; only the log of a session that
failed stays, its path printed. What a killed process (SIGKILL, a lost
machine, a lost Ray actor) could not remove is what :func:`collect` finds.

A directory is removed only when all of this holds, checked in this order:

1. *Ours.* Its name has one of those shapes, it is a real directory (not a
   symbolic link) owned by this user that no one else may write, its content
   has the shape that kind has (for the launcher's and rollout directories),
   and the directory it is in is owned by root or this user and either not
   writable by others or sticky (``/tmp``), so no one else can rename it.
2. *Not in use.* No process this user may see has its working directory,
   its root, its executable or an open file inside (execd and its
   supervisor keep their log open as long as they live); it has not changed
   for ``older_than`` seconds, which covers the moment between creating a
   directory and using it; and no live owner holds it: :class:`Hold` takes a
   shared ``flock`` on the directory (``harnessd run`` and ``harnessd demo``
   on their workspaces), and :func:`collect` takes it exclusively, without
   waiting, and keeps it while it removes.
3. *Removed without following links:* :func:`shutil.rmtree` on Linux opens
   each directory relative to its parent with ``O_NOFOLLOW``.

Stale cgroups of execds that died without removing them go too
(``execd.cgroups.sweep_stale``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

DEFAULT_OLDER_THAN = 60.0
"""Seconds a directory must be unchanged before :func:`collect` removes it."""

_MKDTEMP = r"[a-z0-9_]{8}"
_TAG = r"[A-Za-z0-9_.-]{1,12}"
_LAUNCHER_ENTRY = re.compile(rf"token-{_TAG}|execd-{_TAG}\.log|state-{_TAG}")
_ROLLOUT_ENTRIES = frozenset({"ws", "execd", "state"})


def _launcher_shape(names: list[str]) -> bool:
    return all(_LAUNCHER_ENTRY.fullmatch(name) for name in names)


def _rollout_shape(names: list[str]) -> bool:
    return bool(names) and set(names) <= _ROLLOUT_ENTRIES and "execd" in names


def _any_shape(names: list[str]) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of directory harnessd leaves: its name pattern and the shape of its content."""

    name: str
    pattern: re.Pattern[str]
    shape: Callable[[list[str]], bool]


KINDS = (
    Kind("launcher directory", re.compile(r"execd-[0-9a-f]{16}"), _launcher_shape),
    Kind("run workspace", re.compile(rf"harnessd-run-{_MKDTEMP}"), _any_shape),
    Kind("demo workspace", re.compile(rf"harnessd-demo-{_MKDTEMP}"), _any_shape),
    # rollout-<the attempt's marker>
    Kind("rollout directory", re.compile(r"rollout-[A-Za-z0-9_.-]{1,128}"), _rollout_shape),
)
"""What :func:`collect` looks for in each directory it searches."""


class Hold:
    """A new private temporary directory, held as in use until :meth:`remove`.

    ``prefix`` names its kind (``harnessd-run-``, ``harnessd-demo-``);
    ``directory`` is where it is made (default: the temporary directory). The
    shared lock keeps :func:`collect` away from it while this process lives.
    """

    def __init__(self, prefix: str, directory: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix=prefix, dir=directory)
        self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def remove(self) -> None:
        """Remove the directory and everything in it, then let go of it (idempotent)."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None


@dataclass(frozen=True, slots=True)
class Found:
    """One directory :func:`collect` looked at: what it is and what became of it.

    ``removed``: it is gone (or, in a dry run, would be). Otherwise ``why``
    says why it stays.
    """

    path: str
    kind: str
    removed: bool
    why: str = ""


def search_dirs(extra: Iterable[str] = ()) -> list[str]:
    """Where :func:`collect` looks: the temporary directory, ``/tmp``, and ``extra``."""
    found: list[str] = []
    for directory in (tempfile.gettempdir(), "/tmp", *extra):  # noqa: S108 - looked in, not written
        real = os.path.abspath(directory)
        if real not in found:
            found.append(real)
    return found


def collect(
    directories: Iterable[str],
    *,
    older_than: float = DEFAULT_OLDER_THAN,
    dry_run: bool = False,
) -> list[Found]:
    """Find what harnessd left in ``directories`` and remove what is ours and unused.

    Every candidate is reported, removed or not (see the module's theory of
    operation for the checks). ``dry_run``: remove nothing, report what would go.
    """
    uid = os.geteuid()
    candidates: list[tuple[str, Kind]] = []
    results: list[Found] = []
    for directory in directories:
        refusal = _unsafe_parent(directory, uid)
        for name, kind in _named(directory):
            path = os.path.join(directory, name)
            if refusal is not None:
                results.append(Found(path, kind.name, False, refusal))
            else:
                candidates.append((path, kind))
    users = _users_of([path for path, _ in candidates])
    now = time.time()
    for path, kind in candidates:
        results.append(_settle(path, kind, uid, users.get(path), now - older_than, dry_run))
    return results


def _named(directory: str) -> Iterator[tuple[str, Kind]]:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return
    for name in names:
        kind = next((k for k in KINDS if k.pattern.fullmatch(name)), None)
        if kind is not None:
            yield name, kind


def _unsafe_parent(directory: str, uid: int) -> str | None:
    """Why entries of ``directory`` may be renamed by someone else (None: they may not)."""
    try:
        info = os.lstat(directory)
    except OSError as exc:
        return f"cannot look at {directory}: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory"
    if info.st_uid not in (0, uid):
        return f"{directory} belongs to another user"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return f"others may write {directory} and it is not sticky"
    return None


def _settle(
    path: str, kind: Kind, uid: int, user: int | None, cutoff: float, dry_run: bool
) -> Found:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return Found(path, kind.name, False, f"cannot open it: {exc.strerror}")
    try:
        info = os.fstat(fd)
        why = _not_ours(fd, info, uid, kind)
        if why is None and user is not None:
            why = f"in use by process {user}"
        if why is None and max(info.st_mtime, info.st_ctime) > cutoff:
            why = "changed too recently"
        if why is None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                why = "held by its owner"
        if why is not None:
            return Found(path, kind.name, False, why)
        if not dry_run:
            try:
                shutil.rmtree(path)
            except OSError as exc:
                return Found(path, kind.name, False, f"cannot remove it: {exc}")
        return Found(path, kind.name, True)
    finally:
        os.close(fd)


def _not_ours(fd: int, info: os.stat_result, uid: int, kind: Kind) -> str | None:
    if info.st_uid != uid:
        return "belongs to another user"
    if info.st_mode & 0o022:
        return "others may write it"
    try:
        names = os.listdir(fd)
    except OSError as exc:
        return f"cannot list it: {exc.strerror}"
    if not kind.shape(names):
        return f"its content is not that of a {kind.name}"
    return None


def _users_of(paths: list[str]) -> dict[str, int]:
    """For each of ``paths`` in use by a process this user may inspect, one such process."""
    if not paths:
        return {}
    found: dict[str, int] = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        for target in _references(int(entry)):
            for path in paths:
                if path not in found and (target == path or target.startswith(path + "/")):
                    found[path] = int(entry)
    return found


def _references(pid: int) -> Iterator[str]:
    """What process ``pid`` has open or stands in: cwd, root, executable, open files."""
    base = f"/proc/{pid}"
    links = [f"{base}/cwd", f"{base}/root", f"{base}/exe"]
    with contextlib.suppress(OSError):
        links += [f"{base}/fd/{fd}" for fd in os.listdir(f"{base}/fd")]
    for link in links:
        with contextlib.suppress(OSError):
            yield os.readlink(link).removesuffix(" (deleted)")


def sweep_cgroups(*, dry_run: bool = False) -> tuple[list[str], list[str]]:
    """The stale cgroups of dead execds: ``(removed, busy)`` (``execd.cgroups.sweep_stale``)."""
    from execd.cgroups import sweep_stale

    return sweep_stale(dry_run=dry_run)
