"""What execd reads about processes from ``/proc/PID/stat``: state, parent, group, start time.

One parser for the line (the command name in parentheses may hold spaces
and parentheses itself, so fields are counted from the last ``)``), and the
scans built on it: execd's own children (for the orphan reaper) and the
live members of a process group (to decide whether a group still needs a
SIGKILL, and which processes a persistent shell's command started).

The marker cleanup reads ``/proc`` differently (uids from ``status``, bounded
reads of ``environ``) and keeps that in :mod:`execd.marker`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import msgspec

_HZ = os.sysconf("SC_CLK_TCK")


class ProcStat(msgspec.Struct, frozen=True):
    """The fields of ``/proc/PID/stat`` execd uses."""

    state: str
    """One letter: ``R``, ``S``, ``D``, ``T``, ``Z`` (zombie), ``X`` (dead), ..."""
    ppid: int
    pgrp: int
    start: int
    """Start time in clock ticks since boot (comparable with :func:`boot_ticks`)."""

    @property
    def alive(self) -> bool:
        """Neither a zombie nor dead."""
        return self.state not in ("Z", "X")


def read_stat(pid: int | str) -> ProcStat | None:
    """The stat fields of ``pid``, or None if it is gone (or the line is cut short)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        return None
    return ProcStat(
        fields[0].decode("ascii", "replace"), int(fields[1]), int(fields[2]), int(fields[19])
    )


def _pids() -> Iterator[str]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield entry


def children() -> list[int]:
    """Every child of this process, from any of its threads."""
    pids: list[int] = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    found_file = False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                found_file = True
                pids += (int(p) for p in f.read().split())
        except OSError:
            continue
    if found_file:
        return pids
    me = os.getpid()
    for pid in _pids():
        stat = read_stat(pid)
        if stat is not None and stat.ppid == me:
            pids.append(int(pid))
    return pids


def live_group_members(pgid: int, since: int = 0) -> Iterator[int]:
    """Live (not zombie) members of process group ``pgid`` started at ``since`` or later.

    ``killpg(pgid, 0)`` also succeeds for a group of zombies, which may wait
    a while for a parent (or init) to reap them; only the living matter when
    deciding whether SIGKILL is needed. Lazy: take one to know whether any.
    """
    for pid in _pids():
        stat = read_stat(pid)
        if stat is not None and stat.pgrp == pgid and stat.alive and stat.start >= since:
            yield int(pid)


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that :attr:`ProcStat.start` uses."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _HZ)
