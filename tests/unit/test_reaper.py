"""execd.reaper: orphans reaped, tracked children never taken, on asyncio and uvloop."""

from __future__ import annotations

import asyncio
import os
import textwrap

import pytest

from execd import pipes, reaper
from execd import spawn as sp
from tests.support.procs import run_python

pytestmark = pytest.mark.anyio


_REAPER_SCRIPT = textwrap.dedent(
    """
    import asyncio, ctypes, os, sys, time
    import uvloop
    from execd import reaper as rp
    from execd import pipes
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
        pipes.PipeReader(child.stdout, sink=lambda _: None)
        pipes.PipeReader(child.stderr, sink=lambda _: None)
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
        out = pipes.PipeReader(child.stdout)
        pipes.PipeReader(child.stderr, sink=lambda _: None)
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
    result = run_python("-c", _REAPER_SCRIPT, loop, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


async def test_reaper_without_subreaper_finds_nothing_to_steal() -> None:
    child = sp.spawn(["/bin/sh", "-c", "exit 3"], env=dict(os.environ))
    pipes.PipeReader(child.stdout, sink=lambda _: None)
    pipes.PipeReader(child.stderr, sink=lambda _: None)
    orphans = reaper.Reaper(interval=0.01)
    orphans.start()
    try:
        status = await asyncio.wait_for(asyncio.shield(child.exited), 20)
        # A scan after the exit finds nothing of ours (zombies of other tests may be there).
        assert child.pid not in [pid for pid, _ in orphans.reap()]
    finally:
        orphans.stop()
    assert sp.decode_status(status) == (3, None)
    assert child.pid not in reaper._tracked
