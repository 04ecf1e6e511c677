"""Per-command cgroups, where execd may create them (the v1 ``pids`` and ``memory`` controllers).

execd looks for each controller's hierarchy in ``/proc/self/mountinfo`` and
its own place in it in ``/proc/self/cgroup``. When it may create a directory
there, it keeps a subtree of its own (``execd-<pid>``) below its own cgroup,
so the command cgroups nest inside whatever already bounds execd, and gives
each limited command a cgroup of its own in it (``<n>``). The command joins
it before its first instruction (:mod:`execd.limits` writes its pid into
``cgroup.procs`` from the shell that then execs it).

A command's cgroup is removed when the command ends and its processes are
gone; one that still holds processes (something the command left behind), or
whose command never got to report its end, is removed by
:meth:`Cgroups.sweep`, which execd runs after its marker cleanup and, killing
what is left, when it exits.

cgroup v2: a delegated subtree needs execd to move itself out of the cgroup
whose ``subtree_control`` it enables; this is not done yet, so on a v2-only
host limits fall back to rlimits (:mod:`execd.limits`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time

log = logging.getLogger(__name__)

CONTROLLERS = ("pids", "memory")


def _mount_points() -> dict[str, str]:
    """Mount point of each v1 controller's hierarchy."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) < 5 or len(rest) < 3 or rest[0] != "cgroup":
                continue
            for option in rest[2].split(","):
                if option in CONTROLLERS:
                    found[option] = fields[4].replace("\\040", " ")
    return found


def _own_paths() -> dict[str, str]:
    """execd's cgroup path in each v1 controller's hierarchy."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3:
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


class CommandCgroup:
    """One command's cgroups (one directory per controller)."""

    def __init__(self, dirs: dict[str, str]) -> None:
        self.dirs = dirs

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files the command's pid is written to."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def counters(self) -> dict[str, int]:
        """How often each limit was hit so far: OOM kills (``memory``), refused forks (``processes``)."""
        found: dict[str, int] = {}
        memory = self.dirs.get("memory")
        if memory is not None:
            found["memory"] = _read_counter(os.path.join(memory, "memory.oom_control"), "oom_kill")
        pids = self.dirs.get("pids")
        if pids is not None:
            found["processes"] = _read_counter(os.path.join(pids, "pids.events"), "max")
        return found

    def exceeded(self, since: dict[str, int] | None = None) -> str | None:
        """``"memory"`` after an OOM kill, ``"processes"`` after a refused fork, else None.

        With ``since`` (earlier :meth:`counters`), only what happened after it counts.
        """
        counts = self.counters()
        for name in ("memory", "processes"):
            if counts.get(name, 0) > (since or {}).get(name, 0):
                return name
        return None

    def pids(self) -> set[int]:
        """Every process still in the command's cgroups."""
        found: set[int] = set()
        for path in self.procs_files:
            with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as f:
                found.update(int(line) for line in f if line.strip())
        return found

    def kill(self) -> int:
        """SIGKILL everything left in the cgroups; returns how many were signalled."""
        left = self.pids()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(left)

    def remove(self) -> bool:
        """Remove the directories; False while processes remain in one."""
        for controller, path in list(self.dirs.items()):
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                return False
            del self.dirs[controller]
        return True


class Cgroups:
    """execd's own subtree in each v1 controller it may write, and the command cgroups in it."""

    def __init__(self) -> None:
        self.roots: dict[str, str] = {}
        self._seq = itertools.count(1)
        self._groups: set[CommandCgroup] = set()
        mounts, own = _mount_points(), _own_paths()
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

    def create(self, memory: int | None, processes: int | None) -> CommandCgroup | None:
        """A cgroup bounding ``memory`` bytes and ``processes``; None when nothing needs one.

        Raises OSError when the kernel refuses the directory or a value.
        """
        wanted = {"memory": memory, "pids": processes}
        use = {c: v for c, v in wanted.items() if v is not None and c in self.roots}
        if not use:
            return None
        name = str(next(self._seq))
        group = CommandCgroup({})
        try:
            for controller, value in use.items():
                path = os.path.join(self.roots[controller], name)
                os.mkdir(path, 0o755)
                group.dirs[controller] = path
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
        """Remove the command cgroups that are empty by now.

        With ``final`` (execd exits) every command cgroup goes: what is left in
        one is killed first; then execd's own subtrees are removed.
        """
        for group in list(self._groups):
            if final:
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


def _remove_stale(base: str) -> None:
    """Remove the empty subtrees an execd that died without cleaning up left in ``base``."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(base):
            owner = entry.removeprefix("execd-")
            if owner == entry or not owner.isdigit() or os.path.exists(f"/proc/{owner}"):
                continue
            root = os.path.join(base, entry)
            with contextlib.suppress(OSError):
                for child in os.listdir(root):
                    if child.isdigit():
                        with contextlib.suppress(OSError):
                            os.rmdir(os.path.join(root, child))
                os.rmdir(root)


def _write(path: str, value: int) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(str(value))
