"""execd.spawn: real processes on asyncio and uvloop, pipes, group kills, orphan reaping."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from execd import pipes, reaper, spawn_at
from execd import spawn as sp
from execd.errors import InvalidParams, SpawnFailed
from tests.conftest import eventually
from tests.support.procs import alive, searchable_path, state

ENV = dict(os.environ)

pytestmark = pytest.mark.anyio


async def collect(child: sp.Child) -> tuple[int, bytes, bytes]:
    out: list[bytes] = []
    err: list[bytes] = []
    r_out = pipes.PipeReader(child.stdout, sink=out.append)
    r_err = pipes.PipeReader(child.stderr, sink=err.append)
    waits: list[asyncio.Future[Any]] = [child.exited, r_out.eof, r_err.eof]
    await asyncio.wait_for(asyncio.gather(*waits), 20)
    return child.exited.result(), b"".join(out), b"".join(err)


async def test_exit_codes_signals_and_output() -> None:
    status, out, err = await collect(
        sp.spawn(["/bin/sh", "-c", "echo out; echo err >&2; exit 7"], env=ENV)
    )
    assert sp.decode_status(status) == (7, None)
    assert (out, err) == (b"out\n", b"err\n")
    status, _, _ = await collect(sp.spawn(["/bin/sh", "-c", "kill -KILL $$"], env=ENV))
    assert sp.decode_status(status) == (None, signal.SIGKILL)


async def test_each_child_leads_its_own_session() -> None:
    child = sp.spawn(["sleep", "5"], env=ENV)
    try:
        assert os.getsid(child.pid) == child.pid
        assert os.getpgid(child.pid) == child.pid
    finally:
        child.signal(signal.SIGKILL)
        await collect(child)


async def test_stdin_is_dev_null_unless_piped() -> None:
    _, out, _ = await collect(sp.spawn(["cat"], env=ENV))
    assert out == b""
    child = sp.spawn(["cat"], env=ENV, stdin_pipe=True)
    assert child.stdin is not None
    collecting = asyncio.ensure_future(collect(child))
    assert await asyncio.wait_for(pipes.write_all(child.stdin, b"x" * 300_000), 20)
    child.close_stdin()
    _, out, _ = await collecting
    assert out == b"x" * 300_000
    # A reader that went away: the write reports it instead of raising.
    child = sp.spawn(["true"], env=ENV, stdin_pipe=True)
    assert child.stdin is not None
    await collect(child)
    assert not await asyncio.wait_for(pipes.write_all(child.stdin, b"y" * 300_000), 20)
    child.close_stdin()


async def test_cwd_env_and_path_lookup(tmp_path: Path) -> None:
    tool = tmp_path / "bin" / "mytool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho tool:$PWD:$FOO\n")
    tool.chmod(0o755)
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


async def test_only_stdio_reaches_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    leak = os.open("/dev/null", os.O_RDONLY)
    os.set_inheritable(leak, True)  # as if inherited from execd's parent
    monkeypatch.setattr(sp, "_swept", False)  # as in a fresh execd
    try:
        for cwd in (None, "/"):
            script = "ls /proc/self/fd"
            _, out, _ = await collect(sp.spawn(["/bin/sh", "-c", script], env=ENV, cwd=cwd))
            fds = {int(x) for x in out.split()}
            # 0-2 plus the directory ls itself opened to list them.
            assert fds <= {0, 1, 2, 3}, fds
    finally:
        os.close(leak)


async def test_sigpipe_is_default_in_children() -> None:
    status, out, _ = await collect(sp.spawn(["/bin/sh", "-c", "yes | head -n 2"], env=ENV))
    assert sp.decode_status(status) == (0, None)
    assert out == b"y\ny\n"


@pytest.mark.parametrize("cwd", [None, "/"], ids=["posix_spawnp", "with a directory"])
async def test_every_signal_starts_at_its_default_whatever_execd_ignores(cwd: str | None) -> None:
    if cwd is not None and not spawn_at.available():
        pytest.skip("this C library has no posix_spawn_file_actions_addchdir_np")
    ignored = (signal.SIGHUP, signal.SIGUSR2, signal.SIGTERM)
    before = {signum: signal.signal(signum, signal.SIG_IGN) for signum in ignored}
    try:
        child = sp.spawn(["/bin/sh", "-c", "grep ^SigIgn /proc/self/status"], env=ENV, cwd=cwd)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    _, out, _ = await collect(child)
    mask = int(out.split()[1], 16)
    # Standard signals only: glibc's child leaves its two internal real-time ones ignored.
    assert [n for n in range(1, 32) if mask & (1 << (n - 1))] == []


async def test_spawn_errors_are_typed(tmp_path: Path) -> None:
    not_exec = tmp_path / "data.txt"
    not_exec.write_text("hello")
    # The loop runs already, with whatever descriptors it keeps for the
    # process's life (libuv's process-wide signal pipe, under uvloop).
    before = len(os.listdir("/proc/self/fd"))
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
    # Failed spawns leave no descriptors behind.
    assert len(os.listdir("/proc/self/fd")) <= before


async def test_terminate_group_kills_grandchildren() -> None:
    child = sp.spawn(["/bin/sh", "-c", "sleep 300 & echo $!; wait"], env=ENV)
    reader = pipes.PipeReader(child.stdout)
    pipes.PipeReader(child.stderr, sink=lambda _: None)
    grandchild = int(await reader.read())
    assert alive(grandchild)
    await asyncio.wait_for(sp.terminate_group(child, 5.0), 20)
    assert sp.decode_status(child.exited.result()) == (None, signal.SIGTERM)
    await eventually(lambda: not alive(grandchild), what="the grandchild's death")


async def test_terminate_group_wakes_a_stopped_group() -> None:
    child = sp.spawn(["/bin/sh", "-c", "echo $$; kill -STOP $$; echo resumed"], env=ENV)
    reader = pipes.PipeReader(child.stdout)
    pipes.PipeReader(child.stderr, sink=lambda _: None)
    await reader.read()
    await eventually(lambda: state(child.pid) == "T", what="the group stopped")
    start = time.monotonic()
    # SIGTERM alone would stay pending on a stopped process until SIGKILL.
    await asyncio.wait_for(sp.terminate_group(child, 30.0), 20)
    assert time.monotonic() - start < 15
    assert sp.decode_status(child.exited.result()) == (None, signal.SIGTERM)
    assert await reader.read() == b""


async def test_terminate_group_escalates_to_sigkill() -> None:
    # The ignored SIGTERM is inherited by the background sleep too.
    child = sp.spawn(["/bin/sh", "-c", "trap '' TERM; sleep 300 & echo $!; wait"], env=ENV)
    reader = pipes.PipeReader(child.stdout)
    pipes.PipeReader(child.stderr, sink=lambda _: None)
    grandchild = int(await reader.read())
    start = time.monotonic()
    await asyncio.wait_for(sp.terminate_group(child, 0.3), 20)
    assert time.monotonic() - start >= 0.25
    assert sp.decode_status(child.exited.result()) == (None, signal.SIGKILL)
    await eventually(lambda: not alive(grandchild), what="the grandchild's death")


async def test_hundred_concurrent_children() -> None:
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
