"""Resource limits of one command, in force before its first instruction.

``posix_spawn`` cannot set rlimits or join a cgroup in the child, and a
limit set on the child after it started (``prlimit``) leaves a window in which
it runs unlimited. A command with limits therefore starts through
:data:`~execd.commands.SHELL` (``/bin/sh -c``) running a short prelude: it
writes its own pid into the command's cgroups, sets each rlimit (soft, then
hard), then ``exec``s the command in the same process, so the command's
first instruction already runs limited and everything it starts inherits
the limits. Where there is no shell (a bare image running the
self-contained worker), the child does the same itself between fork and
exec (:meth:`Plan.apply_in_child`). A command without limits is spawned exactly as before (the only
added work is a ``None`` check); ``python -m bench.spawn`` measures both.

:class:`ResourceControl` holds a capability's defaults (execd's command-line
flags) and turns a call's ``limits`` into a :class:`Plan`; which mechanism
enforces which limit is described in :mod:`protocol.rpc.resources`. A
``cpu`` limit on a cgroup whose CPU time execd can read is a total over the
command and all it starts, kept by a :class:`CpuWatch` (a timer on the
event loop); stopping a command kills what is left in its cgroup
(:meth:`Plan.kill`).
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import shlex
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from execd.cgroups import Cgroups, CommandCgroup
from execd.errors import InvalidParams, NotSupported, SpawnFailed
from protocol.rpc.resources import LIMIT_NAMES, LimitName, Limits, LimitsInfo, Mechanism

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
    """Remove command cgroups left behind (see :meth:`Cgroups.sweep`); ``final``: all of them."""
    global _cgroups
    if _cgroups is not None:
        _cgroups.sweep(final=final)
        if final:
            _cgroups = None


_CONTROLLERS: dict[LimitName, str] = {"memory": "memory", "processes": "pids", "cpu": "cpuacct"}
"""The cgroup controller of each limit a cgroup can enforce (v2 counts CPU time without one)."""

# (ulimit flag, resource, unit in bytes or seconds)
_RLIMITS = {
    "memory": ("v", resource.RLIMIT_AS, 1024),
    "cpu": ("t", resource.RLIMIT_CPU, 1),
    "processes": ("p", resource.RLIMIT_NPROC, 1),
    "file_size": ("f", resource.RLIMIT_FSIZE, 512),
    "open_files": ("n", resource.RLIMIT_NOFILE, 1),
}
_BY_FLAG = {flag: (which, unit) for flag, which, unit in _RLIMITS.values()}


@dataclass(eq=False, repr=False)
class Plan:
    """How one command's limits are applied, and what became of them."""

    limits: Limits
    mechanisms: dict[LimitName, Mechanism]
    rlimits: list[tuple[str, int, int]]
    cgroup: CommandCgroup | None
    _cgroups: Cgroups
    exceeded: LimitName | None = field(default=None, init=False)
    _cpu_watch: CpuWatch | None = field(init=False)

    def __post_init__(self) -> None:
        cpu = self.limits.cpu
        self._cpu_watch = (
            CpuWatch(self.cgroup, cpu)
            if self.cgroup is not None
            and cpu is not None
            and self.mechanisms.get("cpu") != "rlimit"
            else None
        )

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

    def apply_in_child(self) -> None:
        """What the prelude does, done by the child itself between fork and exec.

        For a workspace without :data:`SHELL`: the spawner runs this in the
        child (``preexec_fn``), which then execs the command. Raises OSError
        when the cgroup or a limit is refused (the spawn then fails).
        """
        own = str(os.getpid()).encode()
        for path in self.cgroup.procs_files if self.cgroup else ():
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, own)
            finally:
                os.close(fd)
        for flag, soft, hard in self.rlimits:
            which, unit = _BY_FLAG[flag]
            resource.setrlimit(which, (soft * unit, hard * unit))

    def verdict(self, status: int) -> LimitName | None:
        """The limit that ended the command with wait status ``status``, where it can be told."""
        by_group = self.cgroup.exceeded() if self.cgroup is not None else None
        return self._judge(os.waitstatus_to_exitcode(status), by_group)

    def command_started(self) -> dict[str, int]:
        """A command starts inside the limited one (a session's): its mark for :meth:`command_verdict`.

        The command gets the whole CPU budget: a cgroup's CPU time is counted from now.
        """
        if self._cpu_watch is not None:
            self._cpu_watch.rebase()
        return self.cgroup.counters() if self.cgroup is not None else {}

    def command_verdict(self, since: dict[str, int], exit_code: int) -> LimitName | None:
        """The limit a command run inside the limited one (a session's) ran into.

        ``since`` is what :meth:`command_started` gave when it started; ``exit_code`` its
        exit status as its shell reports it (128 + N after signal N).
        """
        by_group = self.cgroup.exceeded(since) if self.cgroup is not None else None
        return self._judge(exit_code, by_group)

    def _judge(self, code: int, by_group: LimitName | None) -> LimitName | None:
        if by_group == "memory":
            return by_group
        by_signal: tuple[tuple[LimitName, int], ...] = (
            ("cpu", signal.SIGXCPU),
            ("file_size", signal.SIGXFSZ),
        )
        for name, sig in by_signal:
            # A shell reports a child killed by the signal as 128 + its number.
            if getattr(self.limits, name) is not None and code in (-sig, 128 + sig):
                return name
        return by_group

    def attach(self, child: Child) -> None:
        """Follow ``child``: at its reaping record the verdict (``exceeded``) and :meth:`release`."""
        child.limits = self
        if self._cpu_watch is not None:
            self._cpu_watch.start()

        def reaped(exited: asyncio.Future[int]) -> None:
            if not exited.cancelled():
                self.exceeded = self.verdict(exited.result())
            self.release()

        child.exited.add_done_callback(reaped)

    def release(self) -> None:
        """Remove the command's cgroup (now, or once what it left behind is gone).

        A cgroup still holding processes stays known (for :meth:`kill`) until then.
        """
        if self.cgroup is not None:
            self._cgroups.release(self.cgroup)
            if not self.cgroup.dirs:
                if self._cpu_watch is not None:
                    self._cpu_watch.stop()
                self.cgroup = None

    def kill(self) -> None:
        """SIGKILL everything left in the command's cgroup (it is being stopped)."""
        if self.cgroup is not None:
            self.cgroup.kill()


class CpuWatch:
    """Kills a cgroup once the CPU time of everything in it passes a limit.

    Checks on a timer, never busier than needed: with ``n`` CPUs the cgroup
    can use at most ``n`` CPU seconds per second, so after reading ``used``
    the next check is due when the rest of the budget could be gone at the
    earliest, ``(limit - used) / n`` seconds later (at least :attr:`FLOOR`).
    A busy command is therefore caught within ``FLOOR * n`` CPU seconds of
    its limit, and an idle one costs a read every now and then. The watch
    ends when the cgroup is gone.
    """

    FLOOR = 0.02

    def __init__(self, cgroup: CommandCgroup, limit: float) -> None:
        self.cgroup = cgroup
        self.limit = limit
        self.base = 0.0
        self._cpus = os.cpu_count() or 1
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Begin watching (from the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._check()

    def rebase(self) -> None:
        """Count the budget from the cgroup's usage now."""
        self.base = self.cgroup.cpu_usage() or 0.0
        if self._loop is not None:
            self.stop()
            self._check()

    def stop(self) -> None:
        """Stop watching."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        usage = self.cgroup.cpu_usage()
        if usage is None or self._loop is None or self._loop.is_closed():
            return
        used = usage - self.base
        if used >= self.limit:
            self.cgroup.cpu_exceeded = True
            self.cgroup.kill()
            return
        delay = max(self.FLOOR, (self.limit - used) / self._cpus)
        self._timer = self._loop.call_later(delay, self._check)


class ResourceControl:
    """A capability's default limits and the way to apply a call's limits."""

    def __init__(self, defaults: Limits | None) -> None:
        self.defaults = None if defaults is None or defaults.is_empty() else defaults

    def mechanisms(self) -> dict[LimitName, Mechanism]:
        """Which mechanism enforces each limit in this process."""
        cgroups = shared_cgroups()
        v2 = cgroups.v2
        found: dict[LimitName, Mechanism] = dict.fromkeys(LIMIT_NAMES, "rlimit")
        for name, controller in _CONTROLLERS.items():
            if v2 is not None and (controller in v2.controllers or (name == "cpu" and v2.cpu_stat)):
                found[name] = "cgroup-v2"
            elif controller in cgroups.roots:
                found[name] = "cgroup-v1"
        if found["processes"] == "rlimit" and os.geteuid() == 0:
            found["processes"] = "unavailable"
        return found

    def info(self) -> LimitsInfo:
        """What ``server.info`` says about limits."""
        return LimitsInfo(mechanisms=self.mechanisms(), defaults=self.defaults)

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
        v1: dict[str, int | None] = {}
        v2: dict[str, int | None] | None = None
        for name, how in wanted.items():
            controller = _CONTROLLERS.get(name)
            value = None if name == "cpu" else getattr(limits, name)
            if controller is None or how not in ("cgroup-v1", "cgroup-v2"):
                continue
            if how == "cgroup-v1":
                v1[controller] = value
            else:
                v2 = v2 if v2 is not None else {}
                if name != "cpu":
                    v2[controller] = value
        cgroup = None
        if v1 or v2 is not None:
            try:
                cgroup = cgroups.create(v1, v2)
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
