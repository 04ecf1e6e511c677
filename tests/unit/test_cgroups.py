"""execd's per-command cgroups on this host's v1 hierarchies (root only), and the limit plans."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from execd.cgroups import Cgroups
from execd.errors import InvalidParams
from execd.limits import ResourceControl
from protocol.rpc.resources import Limits
from tests.conftest import eventually_blocking


def _cgroups() -> Cgroups:
    groups = Cgroups()
    if "pids" not in groups.roots:
        pytest.skip("needs a writable v1 pids hierarchy (root on a v1 host)")
    return groups


def test_a_command_cgroup_bounds_pids_and_is_removed() -> None:
    groups = _cgroups()
    group = groups.create(None, 3)
    assert group is not None
    script = "for i in 1 2 3 4 5; do sleep 5 & done; wait"
    wrapped = f'echo $$ > {group.procs_files[0]} && exec sh -c "{script}"'
    done = subprocess.run(["sh", "-c", wrapped], capture_output=True, timeout=30, check=False)
    # The shell could start only two of its five sleeps, and the cgroup counted the refusals.
    assert b"fork" in done.stderr.lower()
    assert group.exceeded() == "processes"
    group.kill()
    groups.sweep(final=True)
    assert not os.path.exists(groups.roots["pids"])


def test_the_final_sweep_kills_what_is_left() -> None:
    groups = _cgroups()
    group = groups.create(None, 10)
    assert group is not None
    proc = subprocess.Popen(["sh", "-c", f"echo $$ > {group.procs_files[0]} && exec sleep 60"])
    try:
        eventually_blocking(group.pids, what="the process in its cgroup")
        groups.release(group)  # still busy: kept for the sweep
        assert os.path.isdir(group.dirs["pids"])
        groups.sweep(final=True)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert not group.dirs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dead_execds_empty_subtree_is_removed() -> None:
    groups = _cgroups()
    base = os.path.dirname(groups.roots["pids"])
    stale = os.path.join(base, "execd-999999999")
    os.makedirs(os.path.join(stale, "3"))
    again = Cgroups()
    assert not os.path.exists(stale)
    again.sweep(final=True)
    groups.sweep(final=True)


def test_a_call_may_lower_defaults_but_not_raise_them() -> None:
    control = ResourceControl(Limits(cpu=10.0, open_files=100))
    assert control.effective(None) == Limits(cpu=10.0, open_files=100)
    assert control.effective(Limits(cpu=2.0, memory=1 << 30)) == Limits(
        cpu=2.0, open_files=100, memory=1 << 30
    )
    with pytest.raises(InvalidParams) as raised:
        control.effective(Limits(open_files=101))
    assert raised.value.data == {"limit": "open_files", "default": 100}


def test_the_prelude_sets_soft_then_hard_and_execs_the_command() -> None:
    plan = ResourceControl(None).plan(Limits(cpu=1.5, file_size=1000, open_files=64))
    assert plan is not None
    argv = plan.wrap(["echo", "hi there"])
    assert argv[:2] == ["/bin/sh", "-c"] and argv[3:] == ["echo", "hi there"]
    assert "ulimit -S -t 2 && ulimit -H -t 3" in argv[2]
    assert "ulimit -S -f 1 && ulimit -H -f 1" in argv[2]
    done = subprocess.run(argv, capture_output=True, check=True)
    assert done.stdout == b"hi there\n"
    plan.release()
