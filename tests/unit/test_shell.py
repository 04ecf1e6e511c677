"""The shell capability driven through LocalContext, with real processes, on both loops."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from execd import errors
from execd.fit import encoded_size, result_budget
from execd.shell import ShellCapability
from protocol import limits
from protocol.rpc import shell as rpc
from tests.conftest import eventually
from tests.support.capabilities import MARKER_VAR, capability_fixture
from tests.support.local_ctx import LocalContext
from tests.support.procs import alive, searchable_path, state

pytestmark = pytest.mark.anyio

#: The largest chunk to a client with the default frame cap (16 MiB).
DEFAULT_CHUNK = limits.DEFAULT_MAX_FRAME - limits.CHUNK_OVERHEAD
#: The largest chunk to a client with the smallest frame cap allowed (4 KiB).
SMALLEST_CHUNK = limits.MIN_MAX_FRAME - limits.CHUNK_OVERHEAD


def wide() -> LocalContext:
    """A context whose client takes frames of the default size."""
    return LocalContext(max_chunk=DEFAULT_CHUNK)


def _nothing_running(cap: ShellCapability, state: Path) -> None:
    assert cap.live_processes == 0


cap = capability_fixture(ShellCapability, after=_nothing_running, kill_grace=1.0, drain_grace=0.2)


async def gone(*pids: int) -> None:
    await eventually(lambda: not any(alive(p) for p in pids))


async def first_line(ctx: LocalContext) -> bytes:
    await eventually(lambda: b"\n" in ctx.received("stdout"))
    return ctx.received("stdout").split(b"\n")[0]


async def listed(cap: ShellCapability) -> dict[str, rpc.CommandInfo]:
    result = await cap.shell_list(rpc.ListParams(), LocalContext())
    return {info.command_id: info for info in result.commands}


async def until_exited(cap: ShellCapability, command_id: str) -> None:
    async def exited() -> bool:
        return (await listed(cap))[command_id].state == "exited"

    await eventually(exited, what="the command's exit")


def sibling(ctx: LocalContext, call_id: int) -> LocalContext:
    """Another call on the same connection as ``ctx``."""
    other = LocalContext(call_id=call_id)
    other.connection_id = ctx.connection_id
    return other


def run_params(**kw: Any) -> rpc.RunParams:
    return rpc.RunParams(**kw)


# -- running ----------------------------------------------------------------------


async def test_argv_and_sh_c(cap: ShellCapability) -> None:
    r = await cap.shell_run(run_params(argv=["echo", "a b", "$HOME"]), LocalContext())
    assert (r.exit_code, r.signal, r.stdout, r.stderr) == (0, None, b"a b $HOME\n", b"")
    r = await cap.shell_run(run_params(command="echo out; echo err >&2; exit 5"), LocalContext())
    assert (r.exit_code, r.stdout, r.stderr) == (5, b"out\n", b"err\n")
    assert r.duration >= 0 and not r.timed_out and not r.pipes_held_open
    for bad in (run_params(), run_params(argv=["true"], command="true"), run_params(argv=[""])):
        with pytest.raises(errors.InvalidParams):
            await cap.shell_run(bad, LocalContext())


async def test_cwd_env_unset_and_marker(
    cap: ShellCapability, tmp_path: Path, marker_tag: str
) -> None:
    os.environ.setdefault("EXECD_TEST_UNSET_ME", "1")
    r = await cap.shell_run(
        run_params(
            command='pwd; echo "$FOO|${EXECD_TEST_UNSET_ME-unset}|$EXECD_MARKER"',
            cwd=str(tmp_path),
            env={"FOO": "bar"},
            unset=["EXECD_TEST_UNSET_ME"],
        ),
        LocalContext(),
    )
    assert r.stdout == f"{tmp_path}\nbar|unset|{marker_tag}\n".encode()
    with pytest.raises(errors.InvalidParams):
        await cap.shell_run(run_params(argv=["true"], env={MARKER_VAR: "x"}), LocalContext())
    with pytest.raises(errors.InvalidParams):
        await cap.shell_run(run_params(argv=["true"], unset=[MARKER_VAR]), LocalContext())
    with pytest.raises(errors.InvalidParams):
        await cap.shell_run(run_params(argv=["true"], env={"A=B": "x"}), LocalContext())


async def test_spawn_errors_are_typed(cap: ShellCapability, tmp_path: Path) -> None:
    with pytest.raises(errors.SpawnFailed) as info:
        await cap.shell_run(
            run_params(argv=["no-such-command-xyz"], env={"PATH": searchable_path()}),
            LocalContext(),
        )
    assert info.value.data["errno"] == "ENOENT"
    with pytest.raises(errors.SpawnFailed) as info:
        await cap.shell_run(run_params(argv=["true"], cwd=str(tmp_path / "nope")), LocalContext())
    assert info.value.data["what"] == "working directory"
    assert cap.live_processes == 0


async def test_stdin_bytes_stream_and_default_dev_null(cap: ShellCapability) -> None:
    start = time.monotonic()
    r = await cap.shell_run(run_params(argv=["cat"]), LocalContext())
    assert r.stdout == b"" and r.exit_code == 0
    assert time.monotonic() - start < 10
    big = os.urandom(1 << 20)
    r = await cap.shell_run(run_params(argv=["cat"], stdin=big), wide())
    assert r.stdout == big
    ctx = LocalContext()
    task = asyncio.ensure_future(cap.shell_run(run_params(argv=["cat"], stdin_stream=True), ctx))
    ctx.feed("stdin", b"hello ")
    ctx.feed("stdin", b"world", end=True)
    r = await task
    assert r.stdout == b"hello world"
    with pytest.raises(errors.InvalidParams):
        await cap.shell_run(run_params(argv=["cat"], stdin=b"x", stdin_stream=True), LocalContext())


@pytest.mark.limits(output_cap=4 * 1024 * 1024)
async def test_head_tail_cap_reports_dropped(cap: ShellCapability) -> None:
    script = "i=0; while [ $i -lt 2000 ]; do printf '%04d' $i; i=$((i+1)); done"
    stream = b"".join(b"%04d" % i for i in range(2000))
    r = await cap.shell_run(run_params(command=script, output_cap=20), LocalContext())
    assert r.stdout == stream[:10] + stream[-10:] == b"0000000100" + b"9719981999"
    assert r.stdout_dropped == 8000 - 20
    assert r.stderr_dropped == 0
    # A cap above the daemon's own limit is clamped to it.
    r = await cap.shell_run(
        run_params(command="head -c 5242880 /dev/zero", output_cap=10**12), wide()
    )
    assert len(r.stdout) == 4 * 1024 * 1024 and r.stdout_dropped == 1024 * 1024
    r = await cap.shell_run(run_params(command="head -c 3000000 /dev/zero"), wide())
    assert r.stdout == bytes(3000000) and r.stdout_dropped == 0


async def test_collected_output_always_fits_the_clients_frame(cap: ShellCapability) -> None:
    """Both capped streams together are cut to what one reply frame holds, head and tail kept."""
    script = "i=0; while [ $i -lt 5000 ]; do printf '%05d' $i; i=$((i+1)); done"
    stream = b"".join(b"%05d" % i for i in range(5000))
    for chunk in (SMALLEST_CHUNK, 32 * 1024):
        ctx = LocalContext(max_chunk=chunk)
        both = run_params(command=f"{script}; {script} >&2")
        r = await cap.shell_run(both, ctx)
        assert r.exit_code == 0
        assert encoded_size(r) <= result_budget(ctx)
        for kept, dropped in ((r.stdout, r.stdout_dropped), (r.stderr, r.stderr_dropped)):
            assert dropped == len(stream) - len(kept) > 0
            head = len(kept) // 2
            assert kept == stream[:head] + stream[len(stream) - (len(kept) - head) :]
        # One small stream leaves the other the rest of the room.
        r = await cap.shell_run(run_params(command=f"{script}; echo tiny >&2"), ctx)
        assert r.stderr == b"tiny\n" and r.stderr_dropped == 0
        assert encoded_size(r) <= result_budget(ctx)
        assert len(r.stdout) >= min(len(stream), result_budget(ctx) - 512)


@pytest.mark.limits(output_cap=8 * 1024 * 1024)
async def test_both_streams_at_the_default_cap_fit_the_default_frame(cap: ShellCapability) -> None:
    ctx = wide()
    r = await cap.shell_run(
        run_params(command="head -c 20000000 /dev/zero; head -c 20000000 /dev/zero >&2"), ctx
    )
    assert r.exit_code == 0
    assert encoded_size(r) <= result_budget(ctx)
    assert r.stdout_dropped + len(r.stdout) == 20000000
    assert r.stderr_dropped + len(r.stderr) == 20000000


async def test_streaming_sends_chunks_and_ends_streams(cap: ShellCapability) -> None:
    ctx = LocalContext()
    r = await cap.shell_run(
        run_params(command="echo one; sleep 0.2; echo two >&2; echo three", stream=True),
        ctx,
    )
    assert r.exit_code == 0 and r.stdout == b"" and r.stderr == b""
    assert ctx.received("stdout") == b"one\nthree\n"
    assert ctx.received("stderr") == b"two\n"
    assert len(ctx.sent["stdout"]) >= 2  # live, not one lump at the end
    assert ctx.ended == {"stdout", "stderr"}


class _SlowContext(LocalContext):
    """Takes each chunk slowly and remembers only how much it got."""

    def __init__(self, delay: float, stall_first: float = 0.0) -> None:
        super().__init__()
        self.delay = delay
        self.stall_first = stall_first
        self.count = {"stdout": 0, "stderr": 0}

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        if self.stall_first and self.count[stream] == 0 and data:
            await asyncio.sleep(self.stall_first)
        self.count[stream] += len(data)
        if end:
            self.ended.add(stream)
        await asyncio.sleep(self.delay)


async def test_slow_client_gets_everything_without_pipes_held_open(cap: ShellCapability) -> None:
    ctx = _SlowContext(delay=0.005)
    r = await cap.shell_run(
        run_params(command="head -c 4194304 /dev/zero", stream=True, drain_grace=0.05), ctx
    )
    assert ctx.count["stdout"] == 4194304
    assert r.exit_code == 0 and not r.pipes_held_open


async def test_streaming_64_mib_keeps_buffering_bounded(cap: ShellCapability) -> None:
    size = 64 * 1024 * 1024
    ctx = _SlowContext(delay=0, stall_first=0.3)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        r = await cap.shell_run(
            run_params(argv=["head", "-c", str(size), "/dev/zero"], stream=True), ctx
        )
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    assert r.exit_code == 0
    assert ctx.count["stdout"] == size
    assert peak < 4 * 1024 * 1024, peak


async def test_hundred_concurrent_trues(cap: ShellCapability) -> None:
    results = await asyncio.gather(
        *(cap.shell_run(run_params(argv=["true"]), LocalContext(call_id=i)) for i in range(100))
    )
    assert [r.exit_code for r in results] == [0] * 100
    assert len({r.pid for r in results}) == 100


# -- stopping -------------------------------------------------------------------


async def test_timeout_kills_the_group_and_keeps_partial_output(cap: ShellCapability) -> None:
    r = await cap.shell_run(
        run_params(command="sleep 300 & echo $!; echo partial; wait", timeout=0.3),
        LocalContext(),
    )
    assert r.timed_out and not r.idle_out
    assert r.signal == signal.SIGTERM
    grandchild = int(r.stdout.split()[0])
    assert r.stdout.endswith(b"partial\n")
    await gone(grandchild, r.pid)


async def test_timeout_escalates_to_sigkill(cap: ShellCapability) -> None:
    start = time.monotonic()
    r = await cap.shell_run(
        run_params(command="trap '' TERM; sleep 300 & wait", timeout=0.2, kill_grace=0.3),
        LocalContext(),
    )
    assert r.timed_out and r.signal == signal.SIGKILL
    assert time.monotonic() - start >= 0.45


async def test_idle_timeout(cap: ShellCapability) -> None:
    r = await cap.shell_run(
        run_params(command="echo a; sleep 300", idle_timeout=0.3), LocalContext()
    )
    assert r.idle_out and not r.timed_out and r.stdout == b"a\n"
    r = await cap.shell_run(
        run_params(
            command="for i in 1 2 3 4 5 6 7 8; do echo $i; sleep 0.1; done",
            idle_timeout=0.7,
        ),
        LocalContext(),
    )
    assert not r.idle_out and r.exit_code == 0 and r.stdout.count(b"\n") == 8


async def test_background_child_holding_pipes_does_not_hold_the_reply(cap: ShellCapability) -> None:
    start = time.monotonic()
    r = await cap.shell_run(
        run_params(command="sleep 30 & echo $!", drain_grace=0.2), LocalContext()
    )
    assert time.monotonic() - start < 10
    assert r.exit_code == 0 and r.pipes_held_open
    background = int(r.stdout)
    assert alive(background)  # left running: only the reply was not held
    os.kill(background, signal.SIGKILL)


async def test_cancellation_kills_the_group(cap: ShellCapability) -> None:
    ctx = LocalContext()
    task = asyncio.ensure_future(
        cap.shell_run(run_params(command="sleep 300 & echo $$ $!; wait", stream=True), ctx)
    )
    leader, grandchild = map(int, (await first_line(ctx)).split())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gone(leader, grandchild)
    await eventually(lambda: cap.live_processes == 0)


async def test_connection_close_kills_non_detached(cap: ShellCapability) -> None:
    ctx = LocalContext()
    task = asyncio.ensure_future(
        cap.shell_run(run_params(command="sleep 300 & echo $!; wait", stream=True), ctx)
    )
    grandchild = int(await first_line(ctx))
    await ctx.close()
    r = await asyncio.wait_for(task, 10)
    assert r.signal == signal.SIGTERM
    await gone(grandchild, r.pid)


async def test_signal_reaches_running_and_stopped_commands(cap: ShellCapability) -> None:
    ctx = LocalContext(call_id=7)
    task = asyncio.ensure_future(
        cap.shell_run(
            run_params(
                command="trap 'echo usr1; exit 4' USR1; echo ready; while :; do sleep 0.05; done",
                stream=True,
            ),
            ctx,
        )
    )
    await first_line(ctx)
    other = sibling(ctx, 8)
    sent = await cap.shell_signal(
        rpc.SignalParams(call_id=7, signal=signal.SIGUSR1, group=False), other
    )
    r = await asyncio.wait_for(task, 10)
    assert sent.pid == r.pid
    assert r.exit_code == 4 and b"usr1" in ctx.received("stdout")

    ctx = LocalContext(call_id=9)
    task = asyncio.ensure_future(
        cap.shell_run(run_params(command="echo $$; kill -STOP $$; echo resumed", stream=True), ctx)
    )
    pid = int(await first_line(ctx))
    await eventually(lambda: state(pid) == "T")
    await cap.shell_signal(rpc.SignalParams(call_id=9, signal=signal.SIGTERM), sibling(ctx, 10))
    r = await asyncio.wait_for(task, 10)
    assert r.signal == signal.SIGTERM
    assert b"resumed" not in ctx.received("stdout")

    with pytest.raises(errors.NoSuchProcess):
        await cap.shell_signal(rpc.SignalParams(call_id=9, signal=15), sibling(ctx, 11))
    with pytest.raises(errors.NoSuchProcess):  # another connection's call is not addressable
        await cap.shell_signal(rpc.SignalParams(call_id=9, signal=15), LocalContext())
    with pytest.raises(errors.InvalidParams):
        await cap.shell_signal(rpc.SignalParams(signal=15), LocalContext())
    with pytest.raises(errors.InvalidParams):
        await cap.shell_signal(
            rpc.SignalParams(call_id=1, command_id="x", signal=15), LocalContext()
        )


@pytest.mark.limits(max_processes=2)
async def test_process_limit(cap: ShellCapability) -> None:
    tasks = [
        asyncio.ensure_future(cap.shell_run(run_params(argv=["sleep", "300"]), LocalContext()))
        for _ in range(2)
    ]
    await eventually(lambda: cap.live_processes == 2)
    with pytest.raises(errors.ProcessLimit):
        await asyncio.wait_for(cap.shell_run(run_params(argv=["true"]), LocalContext()), 5)
    with pytest.raises(errors.ProcessLimit):
        await cap.shell_run(run_params(argv=["true"], detached=True), LocalContext())
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await eventually(lambda: cap.live_processes == 0)
    r = await cap.shell_run(run_params(argv=["true"]), LocalContext())
    assert r.exit_code == 0


# -- detached -------------------------------------------------------------------


async def test_detached_survives_connection_and_can_be_attached(cap: ShellCapability) -> None:
    ctx = LocalContext()
    started = await cap.shell_run(
        run_params(command="echo start; sleep 0.5; echo end; echo e >&2", detached=True),
        ctx,
    )
    assert started.command_id and started.pid
    await ctx.close()
    assert alive(started.pid)
    listed = await cap.shell_list(rpc.ListParams(), LocalContext())
    [info] = listed.commands
    assert info.command_id == started.command_id and info.state == "running"
    status = await cap.shell_status(rpc.StatusParams(command_id=started.command_id), LocalContext())
    assert status.state == "running"

    viewer = LocalContext()
    attached = await cap.shell_attach(rpc.AttachParams(command_id=started.command_id), viewer)
    assert viewer.received("stdout") == b"start\nend\n"
    assert viewer.received("stderr") == b"e\n"
    assert viewer.ended == {"stdout", "stderr"}
    assert attached.info.state == "exited" and attached.info.exit_code == 0
    assert attached.stdout_lost == 0
    # The final status was read: the record is gone.
    assert (await cap.shell_list(rpc.ListParams(), LocalContext())).commands == []
    with pytest.raises(errors.NoSuchProcess):
        await cap.shell_status(rpc.StatusParams(command_id=started.command_id), ctx)


@pytest.mark.limits(detached_ring=1000)
async def test_detached_status_wait_and_ring_loss(cap: ShellCapability) -> None:
    started = await cap.shell_run(
        run_params(command="head -c 10000 /dev/zero; echo; echo tail", detached=True),
        LocalContext(),
    )
    assert started.command_id is not None
    info = await cap.shell_wait(rpc.WaitParams(command_id=started.command_id), LocalContext())
    assert info.state == "exited" and info.exit_code == 0
    assert info.stdout_bytes == 10000 + 1 + 5
    # wait read the final status: forgotten.
    with pytest.raises(errors.NoSuchProcess):
        await cap.shell_wait(rpc.WaitParams(command_id=started.command_id), LocalContext())

    started = await cap.shell_run(
        run_params(command="head -c 10000 /dev/zero; echo tail", detached=True),
        LocalContext(),
    )
    assert started.command_id is not None
    await until_exited(cap, started.command_id)
    with pytest.raises(errors.AlreadyExited):
        await cap.shell_signal(
            rpc.SignalParams(command_id=started.command_id, signal=15), LocalContext()
        )
    viewer = LocalContext()
    attached = await cap.shell_attach(rpc.AttachParams(command_id=started.command_id), viewer)
    out = viewer.received("stdout")
    assert out.endswith(b"tail\n") and len(out) == 1000
    assert attached.stdout_lost == 10005 - 1000

    # wait with a timeout on a running command returns its running state.
    ctx = LocalContext()
    started = await cap.shell_run(run_params(argv=["sleep", "300"], detached=True), ctx)
    assert started.command_id is not None
    info = await cap.shell_wait(rpc.WaitParams(command_id=started.command_id, timeout=0.1), ctx)
    assert info.state == "running"
    await cap.shell_signal(rpc.SignalParams(command_id=started.command_id, signal=9), ctx)
    info = await cap.shell_wait(rpc.WaitParams(command_id=started.command_id), ctx)
    assert info.signal == 9
    with pytest.raises(errors.NoSuchProcess):
        await cap.shell_signal(rpc.SignalParams(command_id=started.command_id, signal=9), ctx)


async def test_attach_follow_false_and_single_attacher(cap: ShellCapability) -> None:
    started = await cap.shell_run(
        run_params(command="echo hi; sleep 300", detached=True), LocalContext()
    )
    command_id = started.command_id
    assert command_id is not None

    async def printed() -> int:
        return (await listed(cap))[command_id].stdout_bytes

    await eventually(printed, what="the command's first output")
    viewer = LocalContext()
    snap = await cap.shell_attach(rpc.AttachParams(command_id=command_id, follow=False), viewer)
    assert viewer.received("stdout") == b"hi\n" and snap.info.state == "running"

    follower = LocalContext()
    following = asyncio.ensure_future(
        cap.shell_attach(rpc.AttachParams(command_id=command_id), follower)
    )
    await eventually(lambda: follower.received("stdout") == b"hi\n")
    with pytest.raises(errors.AlreadyAttached):
        await cap.shell_attach(rpc.AttachParams(command_id=command_id), LocalContext())
    await cap.shell_signal(
        rpc.SignalParams(command_id=command_id, signal=signal.SIGTERM), LocalContext()
    )
    result = await asyncio.wait_for(following, 10)
    assert result.info.signal == signal.SIGTERM
    with pytest.raises(errors.NoSuchProcess):
        await cap.shell_status(rpc.StatusParams(command_id=command_id), LocalContext())


@pytest.mark.limits(detached_retention=0.3, max_detached=2)
async def test_detached_retention_and_record_limit(cap: ShellCapability) -> None:
    done = await cap.shell_run(run_params(argv=["true"], detached=True), LocalContext())
    assert done.command_id is not None
    await until_exited(cap, done.command_id)

    # Unread, it is dropped once the retention period has passed.
    async def dropped() -> bool:
        return done.command_id not in await listed(cap)

    await eventually(dropped, what="the record's expiry")

    a = await cap.shell_run(run_params(argv=["sleep", "300"], detached=True), LocalContext())
    b = await cap.shell_run(run_params(argv=["true"], detached=True), LocalContext())
    assert a.command_id and b.command_id
    # b finishes; a new command may evict its unread record, never a running one.
    await until_exited(cap, b.command_id)
    c = await cap.shell_run(run_params(argv=["sleep", "300"], detached=True), LocalContext())
    assert list(await listed(cap)) == [a.command_id, c.command_id]
    with pytest.raises(errors.LimitExceeded):
        await cap.shell_run(run_params(argv=["true"], detached=True), LocalContext())
    with pytest.raises(errors.InvalidParams):
        await cap.shell_run(run_params(argv=["true"], detached=True, stream=True), LocalContext())


@pytest.mark.limits(kill_grace=0.3)
async def test_close_kills_everything(cap: ShellCapability) -> None:
    d = await cap.shell_run(
        run_params(command="trap '' TERM; sleep 300", detached=True), LocalContext()
    )
    ctx = LocalContext()
    task = asyncio.ensure_future(
        cap.shell_run(run_params(command="echo $$; sleep 300", stream=True), ctx)
    )
    pids = [d.pid, int(await first_line(ctx))]
    await cap.close()
    assert not any(alive(p) for p in pids)
    r = await asyncio.wait_for(task, 10)
    assert r.signal == signal.SIGTERM
    with pytest.raises(errors.ShuttingDown):
        await cap.shell_run(run_params(argv=["true"]), LocalContext())
