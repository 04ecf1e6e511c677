"""Reading a child's pipes with backpressure (:mod:`execd.pipes`), against real processes."""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import sys
import termios
import weakref

import pytest

from execd import pipes
from execd import spawn as sp
from tests.conftest import eventually

ENV = dict(os.environ)

pytestmark = pytest.mark.anyio


def pipe_full(fd: int) -> bool:
    """Whether the pipe whose read end is ``fd`` is full (its writer would block).

    Every page of the pipe's ring is full but the first, which the reader
    may have taken part of.
    """
    held = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, held)
    free = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) - int.from_bytes(held, sys.byteorder)
    return free < os.sysconf("SC_PAGESIZE")


async def test_queueing_reader_applies_backpressure() -> None:
    child = sp.spawn(["head", "-c", str(8 * 1024 * 1024), "/dev/zero"], env=ENV)
    reader = pipes.PipeReader(child.stdout, high_water=128 * 1024)
    pipes.PipeReader(child.stderr, sink=lambda _: None)
    # Nobody reads: the reader stops taking, the pipe fills, the child blocks.
    await eventually(lambda: pipe_full(child.stdout), what="a full pipe")
    assert child.running
    assert reader.queued < 128 * 1024 + pipes.READ_SIZE
    total = 0
    while data := await reader.read():
        total += len(data)
    assert total == 8 * 1024 * 1024
    await asyncio.wait_for(asyncio.shield(child.exited), 20)


async def test_readiness_is_level_triggered_and_keeps_going_past_a_failing_callback() -> None:
    """Each readable descriptor's callback runs on every loop pass until it is drained or
    removed; one that raises goes to the loop's exception handler and the others still run."""
    loop = asyncio.get_running_loop()
    readiness = pipes.readiness()
    assert pipes.readiness() is readiness
    failures: list[BaseException | None] = []
    loop.set_exception_handler(lambda _, context: failures.append(context.get("exception")))
    (bad_r, bad_w), (good_r, good_w) = os.pipe2(os.O_CLOEXEC), os.pipe2(os.O_CLOEXEC)
    calls = {"bad": 0, "good": 0}

    def bad() -> None:
        calls["bad"] += 1
        raise RuntimeError("callback failed")

    def good() -> None:
        calls["good"] += 1
        if calls["good"] == 3:
            os.read(good_r, 1)  # drained: no more calls

    try:
        readiness.add(bad_r, bad)
        readiness.add(good_r, good)
        os.write(bad_w, b"x")
        os.write(good_w, b"x")
        await eventually(lambda: calls["bad"] >= 3 and calls["good"] >= 3, what="repeated calls")
        readiness.remove(bad_r)
        readiness.remove(bad_r)  # a second remove is harmless
        settled = dict(calls)
        for _ in range(5):
            await asyncio.sleep(0)
        assert calls == settled
        assert failures and all(isinstance(exc, RuntimeError) for exc in failures)
    finally:
        loop.set_exception_handler(None)
        readiness.remove(bad_r)
        readiness.remove(good_r)
        for fd in (bad_r, bad_w, good_r, good_w):
            os.close(fd)


async def test_a_callback_removing_another_descriptor_keeps_its_callback_from_running() -> None:
    """Both descriptors ready in one pass: the first callback removes the second, which then
    never runs."""
    readiness = pipes.readiness()
    (a_r, a_w), (b_r, b_w) = os.pipe2(os.O_CLOEXEC), os.pipe2(os.O_CLOEXEC)
    ran: list[str] = []

    def first(mine: int, other: int, name: str) -> None:
        ran.append(name)
        readiness.remove(mine)
        readiness.remove(other)

    try:
        readiness.add(a_r, lambda: first(a_r, b_r, "a"))
        readiness.add(b_r, lambda: first(b_r, a_r, "b"))
        os.write(a_w, b"x")
        os.write(b_w, b"x")
        await eventually(lambda: bool(ran), what="a callback")
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(ran) == 1
    finally:
        readiness.remove(a_r)
        readiness.remove(b_r)
        for fd in (a_r, a_w, b_r, b_w):
            os.close(fd)


def test_a_closed_loop_and_its_epoll_go_once_nobody_holds_the_loop() -> None:
    """Each loop's instance is kept for the loop, not beyond it: no loop, no descriptor."""

    async def watch_a_pipe() -> None:
        r, w = os.pipe()
        seen = asyncio.get_running_loop().create_future()
        ready = pipes.readiness()

        def mark_seen() -> None:
            if not seen.done():
                seen.set_result(None)

        ready.add(r, mark_seen)
        os.write(w, b"x")
        await seen
        ready.remove(r)
        os.close(r)
        os.close(w)

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    gc.collect()
    before = descriptors()
    loops = []
    for _ in range(10):
        loop = asyncio.new_event_loop()
        loop.run_until_complete(watch_a_pipe())
        loop.close()
        loops.append(weakref.ref(loop))
        del loop
    gc.collect()
    assert [ref for ref in loops if ref() is not None] == []
    assert descriptors() == before
