"""Reading a child's pipes with backpressure (:mod:`execd.pipes`), against real processes."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
import termios

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
