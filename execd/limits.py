"""Resource limits of one command, in force before its first instruction.

``posix_spawn`` cannot set rlimits or join a cgroup in the child, and a
limit set on the child after it started (``prlimit``) leaves a window in which
it runs unlimited. A command with limits therefore starts through
:data:`~execd.commands.SHELL` (``/bin/sh -c``) running a short prelude: it
writes its own pid into the command's cgroups, sets each rlimit (soft, then
hard), then ``exec``s the command in the same process, so the command's
first instruction already runs limited and everything it starts inherits
the limits. A command without limits is spawned exactly as before (the only
added work is a ``None`` check); ``python -m bench.spawn`` measures both.

:class:`ResourceControl` holds a capability's defaults (execd's command-line
flags) and turns a call's ``limits`` into a :class:`Plan`; which mechanism
enforces which limit is described in :mod:`protocol.rpc.resources`.
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import shlex
import signal
from typing import TYPE_CHECKING

from execd.cgroups import Cgroups, CommandCgroup
from execd.errors import InvalidParams, NotSupported, SpawnFailed
from protocol.rpc.resources import LIMIT_NAMES, Limits, LimitsInfo, Mechanism

if TYPE_CHECKING:
    from execd.spawn import Child

SHELL = "/bin/sh"

_cgroups: Cgroups | None = None


def shared_cgroups() -> Cgroups:
    """The process-wide cgroup subtrees (detected on first use)."""
    global _cgroups
    if _cgroups is None:
        _cgroups = Cgroups()
    return _cgroups


def sweep(*, final: bool = False) -> None:
    """Remove command cgroups left behind (see :meth:`Cgroups.sweep`)."""
    if _cgroups is not None:
        _cgroups.sweep(final=final)


# (ulimit flag, resource, unit in bytes or seconds)
_RLIMITS = {
    "memory": ("v", resource.RLIMIT_AS, 1024),
    "cpu": ("t", resource.RLIMIT_CPU, 1),
    "processes": ("p", resource.RLIMIT_NPROC, 1),
    "file_size": ("f", resource.RLIMIT_FSIZE, 512),
    "open_files": ("n", resource.RLIMIT_NOFILE, 1),
}


class Plan:
    """How one command's limits are applied, and what became of them."""

    def __init__(
        self,
        limits: Limits,
        mechanisms: dict[str, Mechanism],
        rlimits: list[tuple[str, int, int]],
        cgroup: CommandCgroup | None,
        cgroups: Cgroups,
    ) -> None:
        self.limits = limits
        self.mechanisms = mechanisms
        self.rlimits = rlimits
        self.cgroup = cgroup
        self._cgroups = cgroups
        self.exceeded: str | None = None

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` behind the prelude that applies the limits, then execs it."""
        steps = (
            [f"echo $$ >{shlex.quote(path)}" for path in self.cgroup.procs_files]
            if self.cgroup
            else []
        )
        for flag, soft, hard in self.rlimits:
            steps.append(f"ulimit -S -{flag} {soft}")
            steps.append(f"ulimit -H -{flag} {hard}")
        return [SHELL, "-c", " && ".join(steps) + ' || exit 126\nexec "$0" "$@"', *argv]

    def verdict(self, status: int) -> str | None:
        """The limit that ended the command with wait status ``status``, where it can be told."""
        by_group = self.cgroup.exceeded() if self.cgroup is not None else None
        return self._judge(os.waitstatus_to_exitcode(status), by_group)

    def mark(self) -> dict[str, int]:
        """The cgroup counters now: where a command run inside the limited one starts."""
        return self.cgroup.counters() if self.cgroup is not None else {}

    def command_verdict(self, since: dict[str, int], exit_code: int) -> str | None:
        """The limit a command run inside the limited one (a session's) ran into.

        ``since`` is the :meth:`mark` taken when it started; ``exit_code`` its
        exit status as its shell reports it (128 + N after signal N).
        """
        by_group = self.cgroup.exceeded(since) if self.cgroup is not None else None
        return self._judge(exit_code, by_group)

    def _judge(self, code: int, by_group: str | None) -> str | None:
        if by_group == "memory":
            return by_group
        for name, sig in (("cpu", signal.SIGXCPU), ("file_size", signal.SIGXFSZ)):
            # A shell reports a child killed by the signal as 128 + its number.
            if getattr(self.limits, name) is not None and code in (-sig, 128 + sig):
                return name
        return by_group

    def attach(self, child: Child) -> None:
        """Follow ``child``: at its reaping record the verdict (``exceeded``) and :meth:`release`."""
        child.limits = self

        def reaped(exited: asyncio.Future[int]) -> None:
            if not exited.cancelled():
                self.exceeded = self.verdict(exited.result())
            self.release()

        child.exited.add_done_callback(reaped)

    def release(self) -> None:
        """Remove the command's cgroup (now, or once what it left behind is gone)."""
        if self.cgroup is not None:
            self._cgroups.release(self.cgroup)
            self.cgroup = None


class ResourceControl:
    """A capability's default limits and the way to apply a call's limits."""

    def __init__(self, defaults: Limits | None) -> None:
        self.defaults = None if defaults is None or defaults.is_empty() else defaults

    def mechanisms(self) -> dict[str, Mechanism]:
        """Which mechanism enforces each limit in this process."""
        roots = shared_cgroups().roots
        found: dict[str, Mechanism] = dict.fromkeys(LIMIT_NAMES, "rlimit")
        if "memory" in roots:
            found["memory"] = "cgroup-v1"
        if "pids" in roots:
            found["processes"] = "cgroup-v1"
        elif os.geteuid() == 0:
            found["processes"] = "unavailable"
        return found

    def info(self) -> LimitsInfo:
        """What ``server.info`` says about limits."""
        return LimitsInfo(mechanisms=self.mechanisms(), defaults=self.defaults)  # type: ignore[arg-type]

    def effective(self, requested: Limits | None) -> Limits | None:
        """The call's limits over the defaults; raising a default is refused."""
        defaults = self.defaults
        if requested is None or requested.is_empty():
            return defaults
        if defaults is None:
            return requested
        merged: dict[str, float | None] = {}
        for name in LIMIT_NAMES:
            asked, default = getattr(requested, name), getattr(defaults, name)
            if asked is not None and default is not None and asked > default:
                raise InvalidParams(
                    f"limits: {name} {asked} is above execd's limit of {default}",
                    {"limit": name, "default": default},
                )
            merged[name] = default if asked is None else asked
        return Limits(**merged)  # type: ignore[arg-type]

    def plan(self, requested: Limits | None) -> Plan | None:
        """How to apply the call's limits; None when no limit applies.

        Raises InvalidParams (a default raised), NotSupported (a limit that
        cannot be enforced here) or SpawnFailed (the cgroup was refused).
        """
        limits = self.effective(requested)
        if limits is None:
            return None
        mechanisms = self.mechanisms()
        wanted = {
            name: mechanisms[name] for name in LIMIT_NAMES if getattr(limits, name) is not None
        }
        if wanted.get("processes") == "unavailable":
            raise NotSupported(
                "limits: processes cannot be enforced: execd runs as root (RLIMIT_NPROC does not"
                " bind root) and has no writable pids cgroup",
                {"limit": "processes"},
            )
        cgroups = shared_cgroups()
        cgroup = None
        if wanted.get("memory") == "cgroup-v1" or wanted.get("processes") == "cgroup-v1":
            try:
                cgroup = cgroups.create(
                    limits.memory if wanted.get("memory") == "cgroup-v1" else None,
                    limits.processes if wanted.get("processes") == "cgroup-v1" else None,
                )
            except OSError as exc:
                raise SpawnFailed(
                    f"limits: cannot create the command's cgroup: {exc.strerror}"
                ) from None
        rlimits = [
            _rlimit(name, getattr(limits, name)) for name, how in wanted.items() if how == "rlimit"
        ]
        return Plan(limits, wanted, rlimits, cgroup, cgroups)


def _rlimit(name: str, value: float) -> tuple[str, int, int]:
    """``(ulimit flag, soft, hard)`` in the shell's units, within execd's own hard limit."""
    flag, which, unit = _RLIMITS[name]
    soft = math.ceil(value) if name == "cpu" else int(value) // unit
    # CPU: SIGXCPU at the soft limit tells the verdict; SIGKILL a second later if it is caught.
    hard = soft + 1 if name == "cpu" else soft
    current = resource.getrlimit(which)[1]
    if current != resource.RLIM_INFINITY:
        ceiling = current // unit
        soft, hard = min(soft, ceiling), min(hard, ceiling)
    return flag, soft, hard
