"""execd.spawn: real processes on asyncio and uvloop, pipes, group kills, orphan reaping."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from execd import reaper
from execd import spawn as sp
from execd.errors import InvalidParams, SpawnFailed
from tests.support.procs import searchable_path

Runner = Callable[[Callable[[], Coroutine[Any, Any, None]]], None]
ENV = dict(os.environ)


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    def runner(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if request.param == "uvloop":
            uvloop.run(main())
        else:
            asyncio.run(main())

    return runner


def state(pid: int) -> str:
    """The state letter of ``pid`` in /proc, or "" when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return ""
    return raw[raw.rfind(b")") + 2 :].split()[0].decode()


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    return state(pid) not in ("", "Z", "X")


async def collect(child: sp.Child) -> tuple[int, bytes, bytes]:
    out: list[bytes] = []
    err: list[bytes] = []
    r_out = sp.PipeReader(child.stdout, sink=out.append)
    r_err = sp.PipeReader(child.stderr, sink=err.append)
    waits: list[asyncio.Future[Any]] = [child.exited, r_out.eof, r_err.eof]
    await asyncio.wait_for(asyncio.gather(*waits), 20)
    return child.exited.result(), b"".join(out), b"".join(err)


def test_exit_codes_signals_and_output(run: Runner) -> None:
    async def main() -> None:
        status, out, err = await collect(
            sp.spawn(["/bin/sh", "-c", "echo out; echo err >&2; exit 7"], env=ENV)
        )
        assert sp.decode_status(status) == (7, None)
        assert (out, err) == (b"out\n", b"err\n")
        status, _, _ = await collect(sp.spawn(["/bin/sh", "-c", "kill -KILL $$"], env=ENV))
        assert sp.decode_status(status) == (None, signal.SIGKILL)

    run(main)


def test_each_child_leads_its_own_session(run: Runner) -> None:
    async def main() -> None:
        child = sp.spawn(["sleep", "5"], env=ENV)
        try:
            assert os.getsid(child.pid) == child.pid
            assert os.getpgid(child.pid) == child.pid
        finally:
            child.signal(signal.SIGKILL)
            await collect(child)

    run(main)


def test_stdin_is_dev_null_unless_piped(run: Runner) -> None:
    async def main() -> None:
        _, out, _ = await collect(sp.spawn(["cat"], env=ENV))
        assert out == b""
        child = sp.spawn(["cat"], env=ENV, stdin_pipe=True)
        assert child.stdin is not None
        collecting = asyncio.ensure_future(collect(child))
        assert await asyncio.wait_for(sp.write_all(child.stdin, b"x" * 300_000), 20)
        child.close_stdin()
        _, out, _ = await collecting
        assert out == b"x" * 300_000
        # A reader that went away: the write reports it instead of raising.
        child = sp.spawn(["true"], env=ENV, stdin_pipe=True)
        assert child.stdin is not None
        await collect(child)
        assert not await asyncio.wait_for(sp.write_all(child.stdin, b"y" * 300_000), 20)
        child.close_stdin()

    run(main)


def test_cwd_env_and_path_lookup(run: Runner, tmp_path: Path) -> None:
    tool = tmp_path / "bin" / "mytool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho tool:$PWD:$FOO\n")
    tool.chmod(0o755)

    async def main() -> None:
        env = dict(ENV, FOO="bar", PATH=f"{tool.parent}:{ENV.get('PATH', '/usr/bin:/bin')}")
        # A PATH other than execd's, no cwd: resolved in the command's own PATH.
        _, out, _ = await collect(sp.spawn(["mytool"], env=env))
        assert out == f"tool:{os.getcwd()}:bar\n".encode()
        # With a cwd: the Popen path, same PATH semantics.
        _, out, _ = await collect(sp.spawn(["mytool"], env=env, cwd=str(tmp_path)))
        assert out == f"tool:{tmp_path}:bar\n".encode()
        # execd's own cwd takes the posix_spawn path; relative programs work.
        _, out, _ = await collect(sp.spawn(["./bin/mytool"], env=env, cwd=str(tmp_path)))
        assert out == f"tool:{tmp_path}:bar\n".encode()

    run(main)


def test_only_stdio_reaches_the_child(run: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    leak = os.open("/dev/null", os.O_RDONLY)
    os.set_inheritable(leak, True)  # as if inherited from execd's parent
    monkeypatch.setattr(sp, "_swept", False)  # as in a fresh execd

    async def main() -> None:
        script = "ls /proc/self/fd"
        for cwd in (None, "/"):
            _, out, _ = await collect(sp.spawn(["/bin/sh", "-c", script], env=ENV, cwd=cwd))
            fds = {int(x) for x in out.split()}
            # 0-2 plus the directory ls itself opened to list them.
            assert fds <= {0, 1, 2, 3}, fds

    try:
        run(main)
    finally:
        os.close(leak)


def test_sigpipe_is_default_in_children(run: Runner) -> None:
    async def main() -> None:
        status, out, _ = await collect(sp.spawn(["/bin/sh", "-c", "yes | head -n 2"], env=ENV))
        assert sp.decode_status(status) == (0, None)
        assert out == b"y\ny\n"

    run(main)


def test_spawn_errors_are_typed(run: Runner, tmp_path: Path) -> None:
    not_exec = tmp_path / "data.txt"
    not_exec.write_text("hello")

    async def main() -> None:
        with pytest.raises(SpawnFailed) as info:
            sp.spawn(["no-such-program-xyz"], env=dict(ENV, PATH=searchable_path()))
        assert info.value.data["errno"] == "ENOENT"
        assert "not found" in info.value.message
        with pytest.raises(SpawnFailed) as info:
            sp.spawn([str(not_exec)], env=ENV)
        assert info.value.data["errno"] == "EACCES"
        with pytest.raises(SpawnFailed) as info:
            sp.spawn(["true"], env=ENV, cwd=str(tmp_path / "missing"))
        assert info.value.data["what"] == "working directory"
        assert info.value.data["errno"] == "ENOENT"
        with pytest.raises(SpawnFailed) as info:
            sp.spawn(["true"], env=ENV, cwd=str(not_exec))
        assert info.value.data["errno"] == "ENOTDIR"
        with pytest.raises(SpawnFailed) as info:
            sp.spawn(["no-such-program-xyz"], env=dict(ENV, PATH=str(tmp_path)))
        assert info.value.data["errno"] == "ENOENT"
        with pytest.raises(InvalidParams):
            sp.spawn(["echo", "a\0b"], env=ENV)
        with pytest.raises(InvalidParams):
            sp.spawn(["true"], env={"A=B": "1"})
        with pytest.raises(InvalidParams):
            sp.spawn([], env=ENV)

    async def settle() -> None:
        await asyncio.sleep(0)

    # The first loop of a kind may open descriptors it keeps for the process's
    # life (libuv's process-wide signal pipe, under uvloop); count after one ran.
    run(settle)
    before = len(os.listdir("/proc/self/fd"))
    run(main)
    # Failed spawns leave no descriptors behind.
    assert len(os.listdir("/proc/self/fd")) <= before


def test_queueing_reader_applies_backpressure(run: Runner) -> None:
    async def main() -> None:
        child = sp.spawn(["head", "-c", str(8 * 1024 * 1024), "/dev/zero"], env=ENV)
        reader = sp.PipeReader(child.stdout, high_water=128 * 1024)
        sp.PipeReader(child.stderr, sink=lambda _: None)
        await asyncio.sleep(0.3)
        # Nobody reads: the child is blocked on a full pipe, execd holds little.
        assert child.running
        assert reader.queued < 128 * 1024 + sp.READ_SIZE
        total = 0
        while data := await reader.read():
            total += len(data)
        assert total == 8 * 1024 * 1024
        await asyncio.wait_for(asyncio.shield(child.exited), 20)

    run(main)


def test_terminate_group_kills_grandchildren(run: Runner) -> None:
    async def main() -> None:
        child = sp.spawn(["/bin/sh", "-c", "sleep 300 & echo $!; wait"], env=ENV)
        reader = sp.PipeReader(child.stdout)
        sp.PipeReader(child.stderr, sink=lambda _: None)
        grandchild = int(await reader.read())
        assert alive(grandchild)
        await asyncio.wait_for(sp.terminate_group(child, 5.0), 20)
        assert sp.decode_status(child.exited.result()) == (None, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while alive(grandchild) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not alive(grandchild)

    run(main)


def test_terminate_group_wakes_a_stopped_group(run: Runner) -> None:
    async def main() -> None:
        child = sp.spawn(["/bin/sh", "-c", "echo $$; kill -STOP $$; echo resumed"], env=ENV)
        reader = sp.PipeReader(child.stdout)
        sp.PipeReader(child.stderr, sink=lambda _: None)
        await reader.read()
        deadline = time.monotonic() + 10
        while state(child.pid) != "T" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        start = time.monotonic()
        # SIGTERM alone would stay pending on a stopped process until SIGKILL.
        await asyncio.wait_for(sp.terminate_group(child, 30.0), 20)
        assert time.monotonic() - start < 15
        assert sp.decode_status(child.exited.result()) == (None, signal.SIGTERM)
        assert await reader.read() == b""

    run(main)


def test_terminate_group_escalates_to_sigkill(run: Runner) -> None:
    async def main() -> None:
        # The ignored SIGTERM is inherited by the background sleep too.
        child = sp.spawn(["/bin/sh", "-c", "trap '' TERM; sleep 300 & echo $!; wait"], env=ENV)
        reader = sp.PipeReader(child.stdout)
        sp.PipeReader(child.stderr, sink=lambda _: None)
        grandchild = int(await reader.read())
        start = time.monotonic()
        await asyncio.wait_for(sp.terminate_group(child, 0.3), 20)
        assert time.monotonic() - start >= 0.25
        assert sp.decode_status(child.exited.result()) == (None, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(grandchild) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not alive(grandchild)

    run(main)


def test_hundred_concurrent_children(run: Runner) -> None:
    async def main() -> None:
        async def one(i: int) -> int:
            child = sp.spawn(["/bin/sh", "-c", f"echo {i}"], env=ENV)
            assert child.pid in reaper._tracked
            status, out, _ = await collect(child)
            assert sp.decode_status(status) == (0, None)
            assert out == f"{i}\n".encode()
            return child.pid

        pids = await asyncio.gather(*(one(i) for i in range(100)))
        assert len(set(pids)) == 100
        assert not reaper._tracked.intersection(pids)

    run(main)


_REAPER_SCRIPT = textwrap.dedent(
    """
    import asyncio, ctypes, os, sys, time
    import uvloop
    from execd import reaper as rp
    from execd import spawn as sp

    PR_SET_CHILD_SUBREAPER = 36

    def state(pid):
        try:
            raw = open(f"/proc/{pid}/stat", "rb").read()
        except OSError:
            return None
        return raw[raw.rfind(b")") + 2:].split()[0].decode()

    async def main():
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        # A tracked child that has exited is a zombie the reaper must not take.
        child = sp.spawn(["/bin/sh", "-c", "exit 7"], env=dict(os.environ))
        sp.PipeReader(child.stdout, sink=lambda _: None)
        sp.PipeReader(child.stderr, sink=lambda _: None)
        deadline = time.monotonic() + 10
        while state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.005)  # block the loop: the pidfd callback cannot run
        assert state(child.pid) == "Z"
        assert rp.reap_orphans() == []
        assert sp.decode_status(await child.exited) == (7, None)

        # A double fork: the grandchild is orphaned to us and dies a zombie.
        reaper = rp.Reaper(interval=0.05)
        reaper.start()
        child = sp.spawn(["/bin/sh", "-c", "sleep 0.3 & echo $!"], env=dict(os.environ))
        out = sp.PipeReader(child.stdout)
        sp.PipeReader(child.stderr, sink=lambda _: None)
        orphan = int(await out.read())
        await child.exited
        deadline = time.monotonic() + 10
        seen = set()
        while state(orphan) is not None and time.monotonic() < deadline:
            seen.add(state(orphan))
            await asyncio.sleep(0.01)
        assert state(orphan) is None, state(orphan)
        assert reaper.reaped >= 1
        reaper.stop()
        print("ok", sorted(seen))

    (uvloop.run if sys.argv[1] == "uvloop" else asyncio.run)(main())
    """
)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_reaper_reaps_orphans_but_not_tracked_children(loop: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _REAPER_SCRIPT, loop],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def test_reaper_without_subreaper_finds_nothing_to_steal(run: Runner) -> None:
    async def main() -> None:
        child = sp.spawn(["/bin/sh", "-c", "exit 3"], env=ENV)
        sp.PipeReader(child.stdout, sink=lambda _: None)
        sp.PipeReader(child.stderr, sink=lambda _: None)
        orphans = reaper.Reaper(interval=0.01)
        orphans.start()
        try:
            status = await asyncio.wait_for(asyncio.shield(child.exited), 20)
            await asyncio.sleep(0.05)
        finally:
            orphans.stop()
        assert sp.decode_status(status) == (3, None)
        assert child.pid not in reaper._tracked

    run(main)
