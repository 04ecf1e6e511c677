"""The worker pool behind files.*: fair lanes, cancels always answered, daemon threads."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import pytest

from execd.fsops import Interrupted
from execd.workers import Work, WorkerPool
from tests.conftest import eventually

WAIT = 30.0


async def until(condition: Callable[[], object]) -> None:
    await eventually(condition, timeout=WAIT)


class Blocked:
    """A call whose unit holds a worker thread until ``release`` is set, then returns ``value``.

    ``discarded`` and ``released`` record what the pool did with the unit's
    result and with the descriptor it registered for release.
    """

    def __init__(self, pool: WorkerPool, *, grace: float, value: int) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.discarded: list[int] = []
        self.released: list[str] = []

        def work() -> int:
            self.started.set()
            self.release.wait(WAIT)
            return value

        async def call() -> int:
            async with Work(pool, "lane", grace=grace) as unit:
                unit.release(self.released.append, "fd")
                return await unit.run(work, discard=self.discarded.append)

        self.task = asyncio.create_task(call())


def test_cancel_waits_for_a_quick_unit_and_discards_its_result() -> None:
    async def main() -> None:
        call = Blocked(WorkerPool(), grace=5.0, value=7)
        await until(call.started.is_set)
        call.task.cancel()
        await asyncio.sleep(0.2)
        call.task.cancel()  # a second cancellation must not cut the grace short
        await asyncio.sleep(0.2)
        assert not call.task.done(), "the cancel went through while a quick unit still ran"
        call.release.set()
        with pytest.raises(asyncio.CancelledError):
            await call.task
        # The unit ended within the grace: everything was settled before the cancel.
        assert call.discarded == [7]
        assert call.released == ["fd"]

    asyncio.run(main())


def test_cancel_of_a_stuck_unit_is_answered_and_releases_wait_for_it() -> None:
    async def main() -> None:
        pool = WorkerPool()
        call = Blocked(pool, grace=0.3, value=9)
        await until(call.started.is_set)
        cancelled_at = time.monotonic()
        call.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.task
        assert time.monotonic() - cancelled_at < 10
        # The descriptor the unit may still use is not released under it.
        assert call.released == [] and call.discarded == []
        assert pool.running("lane") == 1
        call.release.set()
        await until(lambda: call.released == ["fd"])
        assert call.discarded == [9]
        await until(lambda: pool.running("lane") == 0)

    asyncio.run(main())


def test_interruptible_unit_sees_its_cancel_event() -> None:
    async def main() -> None:
        pool = WorkerPool()
        started = threading.Event()
        seen: list[bool] = []

        def work(cancel: threading.Event) -> None:
            started.set()
            seen.append(cancel.wait(WAIT))
            raise Interrupted

        async def call() -> None:
            async with Work(pool, "lane") as unit:
                await unit.run_interruptible(work)

        task = asyncio.create_task(call())
        await until(started.is_set)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == [True]

    asyncio.run(main())


def test_a_lane_whose_units_hang_never_starves_another() -> None:
    async def main() -> None:
        pool = WorkerPool(per_lane=2)
        release = threading.Event()
        entered = threading.Semaphore(0)

        def stuck() -> None:
            entered.release()
            release.wait(WAIT)

        async def hog() -> None:
            async with Work(pool, "hog", grace=0.1) as unit:
                await unit.run(stuck)

        hogs = [asyncio.create_task(hog()) for _ in range(8)]
        await until(lambda: pool.running("hog") == 2)
        # Only the hog's share of threads is taken; the rest of its calls wait in asyncio.
        await asyncio.sleep(0.2)
        assert pool.running("hog") == 2
        async with Work(pool, "other") as unit:
            assert await asyncio.wait_for(unit.run(lambda: "served"), WAIT) == "served"
        # Cancelling the hog's waiting and running calls is answered either way.
        for task in hogs:
            task.cancel()
        done, pending = await asyncio.wait(hogs, timeout=WAIT)
        assert not pending and all(t.cancelled() for t in done)
        release.set()
        await until(lambda: pool.running("hog") == 0)

    asyncio.run(main())


def test_threads_are_reused_and_end_when_idle() -> None:
    async def main() -> None:
        pool = WorkerPool(idle_timeout=0.2)
        for _ in range(20):
            async with Work(pool, "lane") as unit:
                await unit.run(lambda: None)
        assert pool.threads == 1
        await until(lambda: pool.threads == 0)

    asyncio.run(main())


def test_a_stuck_unit_does_not_keep_the_process_alive() -> None:
    program = textwrap.dedent(
        """
        import asyncio, threading, time
        from execd.workers import Work, WorkerPool

        async def main():
            pool = WorkerPool()
            started = threading.Event()
            def stuck():
                started.set()
                threading.Event().wait()
            async def call():
                async with Work(pool, 1, grace=0.1) as unit:
                    await unit.run(stuck)
            task = asyncio.create_task(call())
            while not started.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                print("cancel answered", flush=True)

        asyncio.run(main())
        """
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cancel answered"
    assert time.monotonic() - started < 30
