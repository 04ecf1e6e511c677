"""Command cgroups in a delegated cgroup v2 subtree against a real execd: CPU totals, cgroup.kill.

Which mechanism applies depends on who runs the test and the host (root on
this host: a writable v2 hierarchy, so ``cpu`` is ``cgroup-v2``); the tests
that need it skip with the reason otherwise.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

from harnessd.api import ExecdClient
from tests.conftest import eventually, one_loop

pytestmark = [pytest.mark.anyio, one_loop]

BUSY = """
import os, sys, time
name = sys.argv[1]
while time.process_time() < 4.0:  # never more than 4 s of CPU, whatever happens
    end = time.process_time() + 0.01
    while time.process_time() < end:
        pass
    os.write(1, f"{name} {time.process_time()}\\n".encode())  # one write: lines never mix
"""
"""A busy loop that prints its own CPU time every 10 ms of it (and gives up after 4 s)."""


def _v2_mount() -> str | None:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return left.split()[4]
    return None


def _v2_path(pid: int) -> str | None:
    """The v2 cgroup of ``pid`` (the ``0::`` line), None once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    return next((line[3:] for line in lines if line.startswith("0::")), None)


async def _cpu_mechanism(client: ExecdClient) -> str:
    info = await client.server_info()
    assert info.limits is not None
    return info.limits.mechanisms["cpu"]


async def _needs_v2(client: ExecdClient) -> None:
    if await _cpu_mechanism(client) != "cgroup-v2":
        pytest.skip("needs a cgroup v2 subtree execd may write (root here, or a delegated one)")


async def test_server_info_names_the_v2_subtree_and_execd_moved_into_its_leaf(
    client: ExecdClient,
) -> None:
    info = await client.server_info()
    assert info.limits is not None
    mechanism = info.limits.mechanisms["cpu"]
    mount = _v2_mount()
    if os.geteuid() == 0 and mount is not None:
        assert mechanism == "cgroup-v2"
    if mechanism == "cgroup-v2":
        assert mount is not None
        own = _v2_path(info.pid)
        assert own is not None and own.endswith(f"/execd-{info.pid}/execd")
        assert os.path.isdir(os.path.join(mount, own.lstrip("/")))
    else:
        assert mechanism in ("cgroup-v1", "rlimit")
    # file_size and open_files have no cgroup counterpart.
    assert info.limits.mechanisms["file_size"] == info.limits.mechanisms["open_files"] == "rlimit"


async def test_cpu_is_a_total_over_the_command_and_all_its_children(client: ExecdClient) -> None:
    mechanism = await _cpu_mechanism(client)
    if mechanism == "rlimit":
        pytest.skip("needs a cgroup whose CPU time execd can read (v2, or a writable v1 cpuacct)")
    busy = shlex.quote(BUSY)
    script = f"for i in 1 2 3 4; do {shlex.quote(sys.executable)} -c {busy} $i & done; wait"
    result = await client.run(["sh", "-c", script], limits={"cpu": 1.0}, timeout=120)
    assert not result.timed_out
    assert result.limit_exceeded == "cpu"
    assert result.limits == {"cpu": mechanism}
    last: dict[str, float] = {}
    for line in result.stdout.decode().splitlines():
        name, _, used = line.partition(" ")
        last[name] = float(used)
    # Every child ran (none was spared) and none got the 4 s it would have had alone.
    assert sorted(last) == ["1", "2", "3", "4"]
    total = sum(last.values())
    assert total < 2.0, f"the children used {total:.2f} CPU seconds under a 1 s total"
    print(f"CPU seconds the 4 children used under a 1 s total: {total:.2f}")


async def test_stopping_a_command_kills_its_double_forked_child_through_the_cgroup(
    client: ExecdClient, tmp_path: Path
) -> None:
    await _needs_v2(client)
    pidfile = tmp_path / "escaped"
    # A child that leaves the group and the session, and drops the marker from its environment:
    # only the command's cgroup still holds it.
    escape = f"echo $$ > {pidfile}; exec sleep 300"
    script = (
        f"( env -i setsid sh -c {shlex.quote(escape)} </dev/null >/dev/null 2>&1 & ); "
        f"while [ ! -s {pidfile} ]; do sleep 0.01; done; echo ready; exec sleep 300"
    )
    running = client.run_streaming(["sh", "-c", script], limits={"cpu": 600})
    async for _, data in running.output():
        if b"ready" in data:
            break
    escaped = int(pidfile.read_text())
    info = await client.server_info()
    group = _v2_path(escaped)
    assert group is not None and f"/execd-{info.pid}/" in group
    assert f"{info.marker_var}=".encode() not in Path(f"/proc/{escaped}/environ").read_bytes()
    assert os.getsid(escaped) != os.getsid(info.pid)
    running.cancel()

    def dead() -> bool:
        try:
            return Path(f"/proc/{escaped}/stat").read_text().split(")")[-1].split()[0] == "Z"
        except OSError:
            return True

    await eventually(dead, timeout=30, what="the double-forked child killed")
    mount = _v2_mount()
    assert mount is not None
    directory = os.path.join(mount, group.lstrip("/"))
    await client.cleanup()
    await eventually(lambda: not os.path.exists(directory), timeout=30, what="its cgroup removed")


def _cgroup_dirs(pid: int) -> list[Path]:
    """Every cgroup directory ``pid`` is in, in each hierarchy mounted here."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, options = right.split()[0], right.split()[2].split(",")
            point = left.split()[4]
            if fstype == "cgroup2":
                mounts.setdefault("", point)
            elif fstype == "cgroup":
                mounts.update(dict.fromkeys(options, point))
    found = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        where = mounts.get(controllers.split(",")[0])
        if where is not None:
            found.append(Path(where) / path.lstrip("/"))
    return found


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: execd makes cgroups of its own as root")
async def test_the_cgroups_of_a_sigkilled_execd_go_with_the_cleanup_after_it(
    tmp_path: Path,
) -> None:
    from harnessd.launcher import serve

    session = await serve(workdir=str(tmp_path / "work"))
    try:
        command = await session.client.run_detached(["sleep", "300"], limits={"memory": 64 << 20})
        subtree = f"execd-{session.pid}"
        # Until the prelude has joined the command's cgroups, /proc shows execd's own.
        dirs = await eventually(
            lambda: [d for d in _cgroup_dirs(command.pid) if subtree in d.parts],
            what="the command in its cgroups",
        )
        roots = {Path(*d.parts[: d.parts.index(subtree) + 1]) for d in dirs}
        os.kill(session.pid, 9)
    finally:
        closed = await session.close(keep_log=False)
    assert closed.fallback_ran and closed.clean
    left = sorted(str(root) for root in roots if root.exists())
    assert left == [], f"cgroups of the killed execd left: {left}"
