"""execd.procfs: stat fields, children and process-group members read from /proc."""

from __future__ import annotations

import os
import subprocess

from execd import procfs
from tests.conftest import eventually_blocking


def test_read_stat_of_a_live_process_and_of_none() -> None:
    me = procfs.read_stat(os.getpid())
    assert me is not None and me.alive and me.state in "RS"
    assert (me.ppid, me.pgrp) == (os.getppid(), os.getpgrp())
    assert 0 < me.start <= procfs.boot_ticks()
    assert procfs.read_stat(2**22 + 1) is None  # above pid_max


def test_children_and_group_members() -> None:
    since = procfs.boot_ticks()
    leader = subprocess.Popen(["sleep", "300"], process_group=0)
    member = subprocess.Popen(["sleep", "300"], process_group=leader.pid)
    try:
        assert {leader.pid, member.pid} <= set(procfs.children())
        assert sorted(procfs.live_group_members(leader.pid)) == [leader.pid, member.pid]
        assert sorted(procfs.live_group_members(leader.pid, since=since)) == [
            leader.pid,
            member.pid,
        ]
        assert list(procfs.live_group_members(leader.pid, since=procfs.boot_ticks() + 1000)) == []
        member.kill()
        # A zombie is no live member (nobody has waited for it yet).
        eventually_blocking(lambda: procfs.read_stat(member.pid).state == "Z")  # type: ignore[union-attr]
        assert list(procfs.live_group_members(leader.pid)) == [leader.pid]
    finally:
        for proc in (leader, member):
            proc.kill()
            proc.wait()
