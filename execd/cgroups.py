"""Per-command cgroups, where execd may create them: a delegated cgroup v2 subtree, v1 controllers.

execd finds the hierarchies in ``/proc/self/mountinfo`` (``cgroup2``, and
each v1 controller it uses: ``memory``, ``pids``, ``cpuacct``) and its own
place in each in ``/proc/self/cgroup`` (the ``0::`` line for v2). Where it
may create a directory there, it keeps a subtree of its own
(``execd-<pid>``) below its own cgroup, so the command cgroups nest inside
whatever already bounds execd, and gives each limited command a cgroup of
its own in it (``<n>``). The command joins it before its first instruction
(:mod:`execd.limits` writes its pid into ``cgroup.procs`` from the shell
that then execs it).

cgroup v2 (:class:`V2Tree`): execd uses its v2 cgroup when it may write it
(delegated to its user: systemd ``Delegate=yes``, a container runtime, or
root). A cgroup with processes cannot hand controllers to its children (the
no-internal-process rule), so execd moves itself into a leaf of its subtree
(``execd-<pid>/execd``) and then enables ``memory`` and ``pids`` in
``cgroup.subtree_control`` along the way down (its own cgroup, then its
subtree) where they are available. The core files need no controller:
``cpu.stat`` (``usage_usec``) gives the CPU time of a command and all it
started, ``cgroup.kill`` kills every process in it in one write, and
``populated`` in ``cgroup.events`` says when they are gone. A controller v2
does not offer stays with v1 when a v1 hierarchy of it is writable.

A command's cgroup is removed when the command ends and its processes are
gone; one that still holds processes (something the command left behind), or
whose command never got to report its end, is removed by
:meth:`Cgroups.sweep`, which execd runs after its marker cleanup (killing what
is left) and when it exits. Subtrees of an execd that died without cleaning
up are removed, once empty, when the next execd starts using cgroups in the
same place, and by :func:`sweep_stale` wherever they are (``execd cleanup``
and ``harnessd gc`` run it).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import stat
import time

from protocol.rpc.resources import LimitName

log = logging.getLogger(__name__)

CONTROLLERS = ("pids", "memory", "cpuacct")
"""The v1 controllers execd uses (cpuacct: a command's CPU time, where v2 cannot give it)."""
V2_CONTROLLERS = ("memory", "pids")
"""The v2 controllers execd enables for its commands where they are available."""
V2 = "v2"
"""The key of a command's v2 directory in :attr:`CommandCgroup.dirs`."""
_LEAF = "execd"
"""The leaf of execd's v2 subtree that execd itself moves into."""


def _mountinfo() -> list[tuple[str, str, list[str]]]:
    """``(mount point, fstype, super options)`` of every mount."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) >= 5 and len(rest) >= 3:
                found.append((fields[4].replace("\\040", " "), rest[0], rest[2].split(",")))
    return found


def _mount_points() -> dict[str, str]:
    """Mount point of each v1 controller's hierarchy, and of the v2 one (key :data:`V2`)."""
    found: dict[str, str] = {}
    for point, fstype, options in _mountinfo():
        if fstype == "cgroup2":
            found.setdefault(V2, point)
        elif fstype == "cgroup":
            for option in options:
                if option in CONTROLLERS:
                    found[option] = point
    return found


def _own_paths() -> dict[str, str]:
    """execd's cgroup path in each v1 controller's hierarchy, and in v2 (key :data:`V2`)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) != 3:
                continue
            if parts[0] == "0" and parts[1] == "":
                found[V2] = parts[2]
            for controller in parts[1].split(","):
                found[controller] = parts[2]
    return found


def _read_counter(path: str, key: str) -> int:
    """The value of ``key`` in a flat-keyed cgroup file (0 when absent or unreadable)."""
    with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _read_words(path: str) -> list[str]:
    with contextlib.suppress(OSError), open(path, encoding="ascii") as f:
        return f.read().split()
    return []


class CommandCgroup:
    """One command's cgroups: a directory per v1 controller and/or one v2 directory."""

    def __init__(self, dirs: dict[str, str]) -> None:
        self.dirs = dirs
        #: Set by the CPU watch of :mod:`execd.limits` when it killed the cgroup.
        self.cpu_exceeded = False

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files the command's pid is written to."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def counters(self) -> dict[str, int]:
        """How often each limit was hit so far: OOM kills, CPU kills, refused forks."""
        found: dict[str, int] = {"cpu": int(self.cpu_exceeded)}
        v2 = self.dirs.get(V2)
        memory, pids = self.dirs.get("memory"), self.dirs.get("pids")
        if memory is not None:
            found["memory"] = _read_counter(os.path.join(memory, "memory.oom_control"), "oom_kill")
        elif v2 is not None:
            found["memory"] = _read_counter(os.path.join(v2, "memory.events"), "oom_kill")
        where = pids if pids is not None else v2
        if where is not None:
            found["processes"] = _read_counter(os.path.join(where, "pids.events"), "max")
        return found

    def exceeded(self, since: dict[str, int] | None = None) -> LimitName | None:
        """``"memory"`` after an OOM kill, ``"cpu"`` after the CPU watch killed the
        command, ``"processes"`` after a refused fork, else None.

        With ``since`` (earlier :meth:`counters`), only what happened after it counts.
        """
        counts = self.counters()
        names: tuple[LimitName, ...] = ("memory", "cpu", "processes")
        for name in names:
            if counts.get(name, 0) > (since or {}).get(name, 0):
                return name
        return None

    def cpu_usage(self) -> float | None:
        """CPU seconds used by everything that ran in the cgroup; None when it cannot be read."""
        v2 = self.dirs.get(V2)
        if v2 is not None:
            with (
                contextlib.suppress(OSError, ValueError),
                open(os.path.join(v2, "cpu.stat"), encoding="ascii") as f,
            ):
                for line in f:
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
        cpuacct = self.dirs.get("cpuacct")
        if cpuacct is not None:
            with (
                contextlib.suppress(OSError, ValueError),
                open(os.path.join(cpuacct, "cpuacct.usage"), encoding="ascii") as f,
            ):
                return int(f.read()) / 1e9
        return None

    def pids(self) -> set[int]:
        """Every process still in the command's cgroups."""
        found: set[int] = set()
        for path in self.procs_files:
            with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as f:
                found.update(int(line) for line in f if line.strip())
        return found

    def populated(self) -> bool:
        """Whether any process is left (v2: ``populated`` in ``cgroup.events``)."""
        v2 = self.dirs.get(V2)
        if v2 is not None and len(self.dirs) == 1:
            return _read_counter(os.path.join(v2, "cgroup.events"), "populated") > 0
        return bool(self.pids())

    def kill(self) -> None:
        """SIGKILL everything in the cgroups (v2: one write to ``cgroup.kill``)."""
        v2 = self.dirs.get(V2)
        if v2 is not None:
            with (
                contextlib.suppress(OSError),
                open(os.path.join(v2, "cgroup.kill"), "w", encoding="ascii") as f,
            ):
                f.write("1")
            if len(self.dirs) == 1:
                return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self) -> bool:
        """Remove the directories; False while processes remain in one."""
        for key, path in list(self.dirs.items()):
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                return False
            del self.dirs[key]
        return True


class V2Tree:
    """execd's subtree of its own v2 cgroup, with execd itself moved into a leaf of it.

    Raises OSError from the constructor when the subtree cannot be made.
    """

    def __init__(self, mount: str, own: str) -> None:
        self.base = os.path.join(mount, own.lstrip("/"))
        _remove_stale(self.base)
        self.root = os.path.join(self.base, f"execd-{os.getpid()}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.root, 0o755)
        leaf = os.path.join(self.root, _LEAF)
        self.moved = False
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(leaf, 0o755)
            _write(os.path.join(leaf, "cgroup.procs"), os.getpid())
            self.moved = True
        except OSError as exc:
            # The core files still work; only the controllers need execd out of the way.
            log.info("cannot move execd into its own v2 leaf: %s", exc.strerror)
        if not os.path.exists(os.path.join(self.root, "cgroup.kill")):
            self.close()
            raise OSError(0, "cgroup.kill is missing (kernel before 5.14)")
        self.controllers = self._enable() if self.moved else set()
        #: Whether ``cpu.stat`` (``usage_usec``) is there without the cpu controller (Linux 4.15).
        self.cpu_stat = os.path.exists(os.path.join(leaf, "cpu.stat"))

    def _enable(self) -> set[str]:
        """Enable the controllers execd wants where available; the set available to commands."""
        for where in (self.base, self.root):
            available = set(_read_words(os.path.join(where, "cgroup.controllers")))
            enabled = set(_read_words(os.path.join(where, "cgroup.subtree_control")))
            for controller in V2_CONTROLLERS:
                if controller in available and controller not in enabled:
                    with contextlib.suppress(OSError):
                        _write_text(os.path.join(where, "cgroup.subtree_control"), f"+{controller}")
        return set(_read_words(os.path.join(self.root, "cgroup.subtree_control"))) & set(
            V2_CONTROLLERS
        )

    def close(self) -> None:
        """Move execd back where it was and remove the subtree (what is left of it goes later)."""
        if self.moved:
            try:
                _write(os.path.join(self.base, "cgroup.procs"), os.getpid())
                self.moved = False
            except OSError:
                # Controllers now enabled in the base refuse processes there: the
                # empty leaf is removed when the next execd starts.
                return
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(self.root, _LEAF))
        with contextlib.suppress(OSError):
            os.rmdir(self.root)


class Cgroups:
    """execd's own subtree in v2 and in each v1 controller it may write; the command cgroups."""

    def __init__(self) -> None:
        self.roots: dict[str, str] = {}
        self.v2: V2Tree | None = None
        self._seq = itertools.count(1)
        self._groups: set[CommandCgroup] = set()
        mounts, own = _mount_points(), _own_paths()
        if V2 in mounts and V2 in own:
            base = os.path.join(mounts[V2], own[V2].lstrip("/"))
            if os.access(base, os.W_OK) and os.access(os.path.join(base, "cgroup.procs"), os.W_OK):
                try:
                    self.v2 = V2Tree(mounts[V2], own[V2])
                except OSError as exc:
                    log.info("not using cgroup v2: %s", exc.strerror or exc)
        for controller in CONTROLLERS:
            if controller not in mounts or controller not in own:
                continue
            base = os.path.join(mounts[controller], own[controller].lstrip("/"))
            _remove_stale(base)
            root = os.path.join(base, f"execd-{os.getpid()}")
            try:
                os.mkdir(root, 0o755)
            except FileExistsError:
                pass
            except OSError:
                continue
            self.roots[controller] = root

    def create(self, v1: dict[str, int | None], v2: dict[str, int | None] | None) -> CommandCgroup:
        """A command's cgroup: in each v1 controller of ``v1``, and a v2 one when ``v2`` is given.

        The values bound the controller (``memory``: bytes, ``pids``:
        processes; None: a directory only, for accounting). Raises OSError
        when the kernel refuses a directory or a value.
        """
        name = str(next(self._seq))
        group = CommandCgroup({})
        try:
            if v2 is not None:
                assert self.v2 is not None
                path = os.path.join(self.v2.root, name)
                os.mkdir(path, 0o755)
                group.dirs[V2] = path
                for controller, value in v2.items():
                    if value is not None:
                        _write(os.path.join(path, f"{controller}.max"), value)
                if v2.get("memory") is not None:
                    with contextlib.suppress(OSError):
                        _write(os.path.join(path, "memory.swap.max"), 0)
            for controller, value in v1.items():
                path = os.path.join(self.roots[controller], name)
                os.mkdir(path, 0o755)
                group.dirs[controller] = path
                if value is None:
                    continue
                if controller == "pids":
                    _write(os.path.join(path, "pids.max"), value)
                else:
                    _write(os.path.join(path, "memory.limit_in_bytes"), value)
                    # Without swap accounting a limited command could swap instead of stopping.
                    with contextlib.suppress(OSError):
                        _write(os.path.join(path, "memory.memsw.limit_in_bytes"), value)
        except OSError:
            group.remove()
            raise
        self._groups.add(group)
        return group

    def release(self, group: CommandCgroup) -> None:
        """Remove a finished command's cgroup now, or at the next :meth:`sweep`."""
        if group.remove():
            self._groups.discard(group)

    def sweep(self, *, final: bool = False) -> None:
        """Kill what is left in every command cgroup and remove them.

        Run once every command has ended (execd's cleanup, after its marker
        cleanup) and when execd exits (``final``: execd's own subtrees go too).
        """
        for group in list(self._groups):
            # Killed processes leave their cgroup a moment after the signal.
            for _ in range(50):
                group.kill()
                if group.remove():
                    break
                time.sleep(0.01)
            if group.remove():
                self._groups.discard(group)
        if final:
            for root in self.roots.values():
                with contextlib.suppress(OSError):
                    os.rmdir(root)
            if self.v2 is not None:
                self.v2.close()


def _remove_stale(base: str) -> None:
    """Remove the empty subtrees an execd that died without cleaning up left in ``base``."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(base):
            if _dead_owner(entry):
                _remove_subtree(os.path.join(base, entry))


def _dead_owner(name: str) -> bool:
    """Whether ``name`` is an execd subtree (``execd-<pid>``) whose execd is gone."""
    owner = name.removeprefix("execd-")
    return owner != name and owner.isdigit() and not os.path.exists(f"/proc/{owner}")


def _remove_subtree(root: str, *, dry_run: bool = False) -> bool:
    """Remove an execd subtree: its command cgroups, its leaf, itself; False if one is busy.

    Only cgroups of the shapes execd makes (``<n>`` and the ``execd`` leaf)
    are removed; ``rmdir`` of a cgroup fails while processes are in it.
    """
    try:
        children = [c for c in os.listdir(root) if os.path.isdir(os.path.join(root, c))]
    except OSError:
        return False
    if any(not (child.isdigit() or child == _LEAF) for child in children):
        return False
    # Nothing is touched while any of it holds a process (its execd, seen from
    # another PID namespace, may be alive after all).
    for where in (root, *(os.path.join(root, child) for child in children)):
        if _read_words(os.path.join(where, "cgroup.procs")):
            return False
    if dry_run:
        return True
    for child in children:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(root, child))
    try:
        os.rmdir(root)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


STALE_WALK_LIMIT = 100_000
"""Most cgroup directories :func:`sweep_stale` looks at in one hierarchy."""


def sweep_stale(*, dry_run: bool = False) -> tuple[list[str], list[str]]:
    """Remove the subtrees of every execd that died without cleaning up; ``(removed, busy)``.

    Walks each hierarchy execd uses (v2, and the v1 ``pids``, ``memory`` and
    ``cpuacct``) from its mount point, at most :data:`STALE_WALK_LIMIT`
    directories each, for ``execd-<pid>`` directories whose process is gone.
    It only enters directories owned by root or by this user (by root alone
    when run as root) that no one else may write, and only removes subtrees
    owned by this user. ``busy``: subtrees still holding processes (something
    a command left behind), left in place. ``dry_run``: remove nothing, list
    what would go. Best run after the dead execd's marked processes are
    killed (``execd cleanup``).
    """
    uid = os.geteuid()
    trusted = {0} if uid == 0 else {0, uid}
    removed: list[str] = []
    busy: list[str] = []
    for mount in sorted(set(_mount_points().values())):
        pending = [mount]
        seen = 0
        while pending and seen < STALE_WALK_LIMIT:
            directory = pending.pop()
            seen += 1
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISDIR(info.st_mode) or info.st_uid not in trusted:
                    continue
                if info.st_mode & 0o022:
                    continue
                if _dead_owner(entry.name) and info.st_uid == uid:
                    ok = _remove_subtree(entry.path, dry_run=dry_run)
                    (removed if ok else busy).append(entry.path)
                    if ok:
                        continue
                pending.append(entry.path)
    return removed, busy


def _write(path: str, value: int) -> None:
    _write_text(path, str(value))


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)
