"""Worker threads for blocking filesystem work, shared fairly between connections.

Theory of operation
-------------------
One :class:`WorkerPool` runs blocking *units* (one read or write of a block,
one metadata call, one listing) in threads of its own, never in the event
loop's default executor, so a unit that hangs cannot hold up work that other
parts of execd hand to that executor (the marker sweep at shutdown among
them). Threads start on demand, up to ``max_threads``, and end after idling.
They are daemon threads: one stuck in a system call that does not return (a
hung network filesystem) cannot keep the process from exiting.

Fairness. Units are queued per *lane* (a connection): a lane has at most
``per_lane`` units in the pool at once, and its further units wait, in
asyncio and cancellably, for one of its own to end. A connection whose units
all hang therefore holds at most ``per_lane`` threads, and every other
connection keeps being served.

Cancellation (:class:`Work`). A cancelled caller waits at most
:data:`CANCEL_GRACE` for the unit in flight, then lets the cancellation through
although the unit still runs: so a cancel is always answered. Whatever the
call must release after its units (a descriptor a unit may be using, a
temporary file) is registered with :meth:`Work.release`; it runs when the
call ends or, if a unit is still in flight then, once that unit ends. A
result that arrives for nobody goes to the unit's ``discard`` callback.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import Any, Final, TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Seconds a cancelled call waits for its unit in flight before the cancel goes through.
CANCEL_GRACE: Final = 1.0
#: Units one lane may have in the pool at once.
PER_LANE: Final = 4
#: Most threads the pool runs.
MAX_THREADS: Final = 256
#: Seconds an idle thread waits for work before it ends.
IDLE_TIMEOUT: Final = 30.0


_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], Any]]


class _Lane:
    """Units of one connection in the pool, and callers waiting for room."""

    __slots__ = ("running", "waiters")

    def __init__(self) -> None:
        self.running = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()


class WorkerPool:
    """Daemon threads running blocking units, at most ``per_lane`` per lane at once."""

    def __init__(
        self,
        *,
        per_lane: int = PER_LANE,
        max_threads: int = MAX_THREADS,
        idle_timeout: float = IDLE_TIMEOUT,
    ) -> None:
        self._per_lane = per_lane
        self._max_threads = max_threads
        self._idle_timeout = idle_timeout
        self._jobs: queue.SimpleQueue[_Job]
        self._lanes: dict[Hashable, _Lane] = {}
        self._reset()
        _POOLS.add(self)

    def _reset(self) -> None:
        """Start without threads (also in a forked child, which has none of them)."""
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = threading.Semaphore(0)

    @property
    def threads(self) -> int:
        """Threads alive now."""
        return self._threads

    @property
    def idle(self) -> bool:
        """Whether no unit of any lane is in the pool (running, queued, stuck or waiting)."""
        return not self._lanes

    def running(self, lane: Hashable) -> int:
        """Units of ``lane`` in the pool now (running, queued or stuck)."""
        entry = self._lanes.get(lane)
        return 0 if entry is None else entry.running

    async def submit(self, lane: Hashable, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        """Wait for room in ``lane``, then start ``fn`` in a thread; return its future.

        The lane's room is given back when ``fn`` ends, whenever that is.
        """
        entry = self._lanes.get(lane)
        if entry is None:
            entry = self._lanes[lane] = _Lane()
        while entry.running >= self._per_lane:
            waiter = asyncio.get_running_loop().create_future()
            entry.waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_next(lane, entry)  # the room it was given goes on
                else:
                    with contextlib.suppress(ValueError):
                        entry.waiters.remove(waiter)
                    self._forget_if_idle(lane, entry)
                raise
        entry.running += 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        future.add_done_callback(functools.partial(self._unit_done, lane))
        self._jobs.put((loop, future, fn))
        self._add_thread_if_needed()
        return future

    def _unit_done(self, lane: Hashable, _: object) -> None:
        entry = self._lanes.get(lane)
        if entry is None:
            return
        entry.running -= 1
        self._wake_next(lane, entry)

    def _wake_next(self, lane: Hashable, entry: _Lane) -> None:
        while entry.waiters:
            waiter = entry.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._forget_if_idle(lane, entry)

    def _forget_if_idle(self, lane: Hashable, entry: _Lane) -> None:
        if entry.running == 0 and not entry.waiters and self._lanes.get(lane) is entry:
            del self._lanes[lane]

    # -- threads -------------------------------------------------------------

    def _add_thread_if_needed(self) -> None:
        if self._idle.acquire(blocking=False):
            return  # an idle thread takes the job
        with self._lock:
            if self._threads >= self._max_threads:
                return
            self._threads += 1
        thread = threading.Thread(target=self._work, name="execd-files", daemon=True)
        thread.start()

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_timeout)
            except queue.Empty:
                # Leave only if no job counted on this thread being idle.
                if self._idle.acquire(blocking=False):
                    with self._lock:
                        self._threads -= 1
                    return
                continue
            loop, future, fn = job
            del job
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as exc:
                error = exc
            # Idle before the caller hears of it, so its next unit reuses this thread.
            self._idle.release()
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens
                loop.call_soon_threadsafe(_resolve, future, result, error)
            # An idle thread holds no block of data.
            del loop, future, fn, result, error


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _after_fork() -> None:
    for pool in list(_POOLS):
        pool._reset()


os.register_at_fork(after_in_child=_after_fork)


class Work:
    """The blocking units of one call and what to release after them.

    Use as ``async with Work(pool, lane) as work``; run units with
    :meth:`run` and :meth:`run_interruptible`, register releases with
    :meth:`release`. See the module docstring for cancellation.
    """

    def __init__(self, pool: WorkerPool, lane: Hashable, *, grace: float = CANCEL_GRACE) -> None:
        self._pool = pool
        self._lane = lane
        self._grace = grace
        self._releases: list[Callable[[], object]] = []
        self._straggler: asyncio.Future[Any] | None = None

    async def __aenter__(self) -> Work:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        releases, self._releases = self._releases, []
        straggler = self._straggler
        if straggler is not None and not straggler.done():
            straggler.add_done_callback(lambda _: _release_all(releases))
        else:
            _release_all(releases)

    def release(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` when the call ends, after every unit it started has ended."""
        self._releases.append(functools.partial(fn, *args))

    async def run(
        self, fn: Callable[[], _T], *, discard: Callable[[_T], object] | None = None
    ) -> _T:
        """Run ``fn`` in the pool and return its result (see the module docstring)."""
        return await self._run(fn, None, discard)

    async def run_interruptible(self, fn: Callable[[threading.Event], _T]) -> _T:
        """Like :meth:`run` for long work that polls a cancel event, set on cancellation."""
        cancel = threading.Event()
        return await self._run(functools.partial(fn, cancel), cancel.set, None)

    async def _run(
        self,
        fn: Callable[[], _T],
        on_cancel: Callable[[], None] | None,
        discard: Callable[[_T], object] | None,
    ) -> _T:
        if self._straggler is not None and not self._straggler.done():
            raise RuntimeError("a unit of this call is still running")
        future = await self._pool.submit(self._lane, fn)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if on_cancel is not None:
                on_cancel()
            await _wait_at_most(future, self._grace)
            if future.done():
                if discard is not None and not future.cancelled() and future.exception() is None:
                    discard(future.result())
                elif not future.cancelled():
                    future.exception()  # retrieved: the caller is gone
            else:
                self._straggler = future
                future.add_done_callback(functools.partial(_late, discard))
            raise


async def _wait_at_most(future: asyncio.Future[Any], seconds: float) -> None:
    """Wait until ``future`` is done or ``seconds`` pass, riding out cancellations."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not future.done():
        left = deadline - loop.time()
        if left <= 0:
            return
        try:
            await asyncio.wait([future], timeout=left)
        except asyncio.CancelledError:
            continue


def _late(discard: Callable[[Any], object] | None, future: asyncio.Future[Any]) -> None:
    """A unit whose caller had gone ended: hand its result to ``discard``."""
    if future.cancelled():
        return
    exc = future.exception()
    if exc is None and discard is not None:
        try:
            discard(future.result())
        except Exception:
            log.exception("discarding the result of an abandoned unit failed")


def _release_all(releases: list[Callable[[], object]]) -> None:
    for release in releases:
        try:
            release()
        except Exception:
            log.exception("releasing what a call held failed")
