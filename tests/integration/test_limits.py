"""Per-command resource limits against a real execd: memory, processes, file size, CPU, defaults.

Which mechanism enforces a limit depends on who runs the test (root with
writable v1 cgroups here; rlimits as an unprivileged user), so the tests
read ``server.info`` and assert what that mechanism can tell.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import msgspec
import pytest

import harnessd
from bench.limits_noop import ALLOCATE, FORK
from harnessd.api import ExecdClient
from harnessd.errors import InvalidParams, NotSupported
from protocol.rpc.resources import LimitName, Limits, Mechanism
from protocol.rpc.services import ServiceInfo
from tests.conftest import eventually, one_loop

pytestmark = [pytest.mark.anyio, one_loop]


async def _mechanism(client: ExecdClient, name: LimitName) -> Mechanism:
    info = await client.server_info()
    assert info.limits is not None
    return info.limits.mechanisms[name]


async def test_memory_limit_stops_the_allocation_and_execd_stays_responsive(
    client: ExecdClient,
) -> None:
    run = asyncio.ensure_future(
        client.run([sys.executable, "-c", ALLOCATE], limits={"memory": 256 << 20})
    )
    slowest = 0.0
    while not run.done():
        before = time.perf_counter()
        await client.noop()
        slowest = max(slowest, time.perf_counter() - before)
        await asyncio.sleep(0.005)
    result = await run
    assert b"allocated" not in result.stdout
    assert result.exit_code != 0
    assert result.limits is not None
    if (await _mechanism(client, "memory")).startswith("cgroup"):
        assert result.limit_exceeded == "memory"
        assert result.signal == signal.SIGKILL
    else:
        # RLIMIT_AS: the allocation merely fails; the program decides, the verdict cannot tell.
        assert b"refused" in result.stdout
        assert result.limit_exceeded is None
    # The no-op round trips were answered throughout (the figure is the bench's business).
    print(f"slowest no-op while the command hit its memory limit: {slowest * 1000:.1f} ms")


async def test_processes_limit_bounds_forks_and_leaves_nothing(client: ExecdClient) -> None:
    mechanism = await _mechanism(client, "processes")
    if mechanism == "unavailable":
        with pytest.raises(NotSupported):
            await client.run([sys.executable, "-c", FORK], limits={"processes": 64})
        return
    result = await client.run([sys.executable, "-c", FORK], limits=Limits(processes=64))
    assert result.exit_code == 0, result.stderr
    started = int(result.stdout)
    assert 0 < started < 64
    if mechanism.startswith("cgroup"):
        assert result.limit_exceeded == "processes"
    await client.cleanup()
    marker = (await client.server_info()).marker
    assert not _marked_processes(marker)


def _marked_processes(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


async def test_file_size_limit_ends_a_large_write(client: ExecdClient, tmp_path: object) -> None:
    target = os.path.join(str(tmp_path), "big")
    result = await client.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", "count=1024"],
        limits={"file_size": 64 << 20},
    )
    assert result.limit_exceeded == "file_size"
    assert result.signal == signal.SIGXFSZ
    assert os.path.getsize(target) <= 64 << 20
    assert result.limits == {"file_size": "rlimit"}


async def test_cpu_limit_ends_a_busy_loop(client: ExecdClient) -> None:
    result = await client.run(["sh", "-c", "while :; do :; done"], limits={"cpu": 1.0})
    assert result.limit_exceeded == "cpu"
    # RLIMIT_CPU signals the process; execd's watch of a cgroup's CPU time kills the cgroup.
    rlimit = await _mechanism(client, "cpu") == "rlimit"
    assert result.signal == (signal.SIGXCPU if rlimit else signal.SIGKILL)


async def test_limits_apply_to_streaming_and_detached_commands(client: ExecdClient) -> None:
    running = client.run_streaming(["sh", "-c", "while :; do :; done"], limits={"cpu": 1})
    async for _ in running.output():
        pass
    assert (await running.result()).limit_exceeded == "cpu"
    started = await client.run_detached(["sh", "-c", "ulimit -n"], limits={"open_files": 77})
    assert started.command_id is not None
    info = await client.wait_command(started.command_id, timeout=30)
    assert info.exit_code == 0
    assert info.limits == {"open_files": "rlimit"}
    late = await client.run_detached(["sh", "-c", "while :; do :; done"], limits={"cpu": 1})
    assert late.command_id is not None
    assert (await client.wait_command(late.command_id, timeout=30)).limit_exceeded == "cpu"


async def test_limits_in_force_from_the_first_instruction(client: ExecdClient) -> None:
    result = await client.run(
        ["cat", "/proc/self/limits"],
        limits={"open_files": 100, "file_size": 1 << 20, "cpu": 2.5},
    )
    lines = {line[:26].strip(): line[26:].split() for line in result.stdout.decode().splitlines()}
    assert lines["Max open files"][:2] == ["100", "100"]
    assert lines["Max file size"][:2] == [str(1 << 20), str(1 << 20)]
    if await _mechanism(client, "cpu") == "rlimit":
        assert lines["Max cpu time"][:2] == ["3", "4"]
    else:
        assert lines["Max cpu time"][:2] == ["unlimited", "unlimited"]


async def test_a_missing_program_is_refused_as_without_limits(client: ExecdClient) -> None:
    with pytest.raises(harnessd.errors.SpawnFailed):
        await client.run(["no-such-program-here"], limits={"cpu": 1})


@pytest.mark.execd_args("--limit-open-files", "64", "--limit-cpu", "5")
async def test_defaults_apply_and_cannot_be_raised(client: ExecdClient) -> None:
    info = await client.server_info()
    assert info.limits is not None and info.limits.defaults == Limits(open_files=64, cpu=5.0)
    result = await client.run(["sh", "-c", "ulimit -n; ulimit -t"])
    cpu = b"5" if await _mechanism(client, "cpu") == "rlimit" else b"unlimited"
    assert result.stdout.split() == [b"64", cpu]
    lowered = await client.run(["sh", "-c", "ulimit -n"], limits={"open_files": 32})
    assert lowered.stdout.strip() == b"32"
    with pytest.raises(InvalidParams) as raised:
        await client.run(["true"], limits={"open_files": 1000})
    assert raised.value.data["limit"] == "open_files"


async def test_unknown_limits_are_refused_by_the_client(client: ExecdClient) -> None:
    with pytest.raises(Exception, match="gpu"):
        await client.run(["true"], limits={"gpu": 1})


async def test_memory_cgroup_is_removed_after_the_command(client: ExecdClient) -> None:
    if await _mechanism(client, "memory") != "cgroup-v1":
        pytest.skip("needs a writable v1 memory cgroup (root on a v1 host)")
    result = await client.run(["true"], limits={"memory": 64 << 20})
    assert result.limits == {"memory": "cgroup-v1"}
    info = await client.server_info()
    own = Path(f"/proc/{info.pid}/cgroup").read_text().splitlines()
    roots = [line.split(":", 2) for line in own]
    memory_path = next(p for _, c, p in roots if "memory" in c.split(","))
    root = f"/sys/fs/cgroup/memory{memory_path}/execd-{info.pid}"
    await eventually(lambda: not [d for d in os.listdir(root) if d.isdigit()], what="cgroup gone")


async def test_services_take_limits_and_report_the_verdict(client: ExecdClient) -> None:
    info = await client.start_service(
        "spin", ["sh", "-c", "ulimit -n; while :; do :; done"], limits={"cpu": 1, "open_files": 99}
    )
    assert info.limits == {"cpu": await _mechanism(client, "cpu"), "open_files": "rlimit"}

    async def ended() -> ServiceInfo | None:
        status = await client.service_status("spin")
        return status if status.state == "exited" else None

    final = await eventually(ended, timeout=30, what="service stopped by its cpu limit")
    assert final is not None
    assert final.limit_exceeded == "cpu"
    logs = await client.service_logs("spin")
    assert b"99" in logs.data


async def test_session_shells_take_limits(client: ExecdClient) -> None:
    opened = await client.open_session("limited", limits={"open_files": 42, "file_size": 1 << 20})
    assert opened.limits == {"open_files": "rlimit", "file_size": "rlimit"}
    result = await client.session_run("limited", "ulimit -n; ulimit -f")
    assert result.stdout.split() == [b"42", b"2048"]
    # The client checks a mapping; a Struct built by hand is checked by execd.
    with pytest.raises(msgspec.ValidationError):
        await client.open_session("bad", limits={"open_files": 1})
    with pytest.raises(InvalidParams):
        await client.open_session("bad", limits=Limits(open_files=1))


async def test_session_runs_carry_their_own_verdict(client: ExecdClient, tmp_path: object) -> None:
    await client.open_session("verdicts", limits={"memory": 256 << 20, "file_size": 1 << 20})
    big = os.path.join(str(tmp_path), "big")
    written = await client.session_run("verdicts", f"dd if=/dev/zero of={big} bs=1M count=4")
    assert written.exit_code == 128 + signal.SIGXFSZ
    assert written.limit_exceeded == "file_size"
    assert written.limits is not None and written.limits["file_size"] == "rlimit"
    allocated = await client.session_run("verdicts", f"{sys.executable} -c {shlex.quote(ALLOCATE)}")
    assert b"allocated" not in allocated.stdout
    assert not allocated.session_ended
    if (await _mechanism(client, "memory")).startswith("cgroup"):
        # The OOM kill in the session's memory cgroup happened during this command.
        assert allocated.limit_exceeded == "memory"
    else:
        assert allocated.limit_exceeded is None
    # The verdict is per command: the next one ran into nothing.
    clean = await client.session_run("verdicts", "echo fine")
    assert clean.stdout == b"fine\n" and clean.limit_exceeded is None
    await client.close_session_shell("verdicts")


SPIN = "import time\nwhile time.process_time() < 0.6:\n    pass\nprint('spun')"
"""0.6 CPU seconds of work, then done."""


async def test_a_sessions_cpu_budget_holds_per_command(client: ExecdClient) -> None:
    await client.open_session("budget", limits={"cpu": 1.0})
    spin = f"{sys.executable} -c {shlex.quote(SPIN)}"
    # Two commands of 0.6 s each: more than the budget together, each within it.
    for _ in range(2):
        done = await client.session_run("budget", spin)
        assert (done.exit_code, done.stdout, done.limit_exceeded) == (0, b"spun\n", None)
    looped = await client.session_run("budget", "sh -c 'while :; do :; done'")
    assert looped.limit_exceeded == "cpu"
    if await _mechanism(client, "cpu") == "rlimit":
        # RLIMIT_CPU ended the looping process; the shell goes on.
        assert looped.exit_code == 128 + signal.SIGXCPU and not looped.session_ended
    else:
        # The session's cgroup went past the command's budget: all of it was killed.
        assert looped.session_ended and looped.signal == signal.SIGKILL
    await client.close_session_shell("budget")
