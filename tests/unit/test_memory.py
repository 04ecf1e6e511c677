"""Giving freed heap memory back: the allocator settings and the trim, in a child process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import pytest

from execd import memory

pytestmark = pytest.mark.skipif(memory._LIBC is None, reason="needs glibc's malloc_trim")

# Runs in a child so the allocator settings do not leak into the test process.
_PROGRAM = textwrap.dedent(
    """
    import json
    from execd import memory

    tuned = memory.tune()
    keep, scratch = [], []
    for index in range(256):
        block = bytearray(256 * 1024)  # below the mmap threshold: from the heap
        block[::4096] = b"x" * len(block[::4096])
        (keep if index % 16 == 0 else scratch).append(block)
    grown = memory.resident_bytes()
    scratch.clear()  # freed, but pinned in the heap by the blocks kept between them
    freed = memory.resident_bytes()
    memory.trim()
    trimmed = memory.resident_bytes()
    print(json.dumps({"tuned": tuned, "grown": grown, "freed": freed, "trimmed": trimmed}))
    """
)


def test_trim_returns_freed_heap_pages() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=60, check=True
    )
    figures = json.loads(done.stdout)
    assert figures["tuned"]
    mib = 1024 * 1024
    # About 60 MiB were freed between kept blocks: free() alone cannot return them.
    assert figures["freed"] > figures["grown"] - 16 * mib
    assert figures["trimmed"] < figures["freed"] - 32 * mib, figures


def test_trimmer_checks_only_after_activity() -> None:
    async def main() -> None:
        trimmer = memory.Trimmer(delay=0.01, slack=1 << 40)
        trimmer.start()
        assert trimmer._timer is None
        trimmer.activity()
        assert trimmer._timer is not None
        first = trimmer._timer
        trimmer.activity()  # coalesced into the pending check
        assert trimmer._timer is first
        await asyncio.sleep(0.1)
        assert trimmer._timer is None
        trimmer.activity()
        trimmer.stop()
        assert trimmer._timer is None

    asyncio.run(main())
