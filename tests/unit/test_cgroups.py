"""execd's per-command cgroups on this host's v1 and v2 hierarchies (root only), and the limit plans."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from execd.cgroups import Cgroups
from execd.errors import InvalidParams
from execd.limits import ResourceControl, sweep
from protocol.rpc.resources import Limits
from tests.conftest import eventually_blocking


def _cgroups() -> Cgroups:
    groups = Cgroups()
    if "pids" not in groups.roots:
        pytest.skip("needs a writable v1 pids hierarchy (root on a v1 host)")
    return groups


def test_a_command_cgroup_bounds_pids_and_is_removed() -> None:
    groups = _cgroups()
    group = groups.create({"pids": 3}, None)
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
    group = groups.create({"pids": 10}, None)
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


@pytest.fixture
def v2() -> Iterator[Cgroups]:
    """Cgroups with a v2 subtree (the test process moves into its leaf), swept afterwards."""
    groups = Cgroups()
    try:
        if groups.v2 is None:
            pytest.skip("needs a cgroup v2 subtree this user may write (root here, or delegated)")
        yield groups
    finally:
        groups.sweep(final=True)


def _own_v2() -> str:
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    return next(line[3:] for line in lines if line.startswith("0::"))


def test_execd_moves_into_a_leaf_and_back_out(v2: Cgroups) -> None:
    assert v2.v2 is not None
    assert _own_v2().endswith(f"/execd-{os.getpid()}/execd")
    root = v2.v2.root
    v2.sweep(final=True)
    assert not os.path.exists(root)
    assert not _own_v2().endswith("/execd")


def test_a_v2_command_cgroup_counts_cpu_and_kills_in_one_write(v2: Cgroups) -> None:
    group = v2.create({}, {})
    procs = group.procs_files[0]
    spin = "i=0; while [ $i -lt 100000 ]; do i=$((i + 1)); done"
    subprocess.run(["sh", "-c", f"echo $$ > {procs} && {spin}"], check=True, timeout=60)
    used = group.cpu_usage()
    assert used is not None and used > 0
    # A double fork out of the session, then the cgroup's one kill.
    script = f"echo $$ > {procs} && (setsid sleep 300 </dev/null >/dev/null 2>&1 &)"
    subprocess.run(["sh", "-c", script], check=True, timeout=30)
    eventually_blocking(group.pids, what="the escaped sleep in the cgroup")
    assert group.populated()
    group.kill()
    eventually_blocking(lambda: not group.populated(), what="the cgroup emptied")
    v2.release(group)
    assert not group.dirs


def test_a_dead_execds_v2_subtree_is_removed(v2: Cgroups) -> None:
    assert v2.v2 is not None
    stale = os.path.join(v2.v2.base, "execd-999999999")
    os.makedirs(os.path.join(stale, "execd"))
    os.makedirs(os.path.join(stale, "7"))
    v2.sweep(final=True)  # out of the leaf: the next start looks where this one did
    again = Cgroups()
    again.sweep(final=True)
    assert not os.path.exists(stale)


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
    if plan.mechanisms["cpu"] == "rlimit":
        assert "ulimit -S -t 2 && ulimit -H -t 3" in argv[2]
    else:
        # The CPU time of the command's cgroup is watched instead.
        assert "ulimit -S -t" not in argv[2] and "cgroup.procs" in argv[2]
    assert "ulimit -S -f 1 && ulimit -H -f 1" in argv[2]
    done = subprocess.run(argv, capture_output=True, check=True)
    assert done.stdout == b"hi there\n"
    plan.release()
    sweep(final=True)
