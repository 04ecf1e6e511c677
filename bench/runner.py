"""Running a bench entry point on uvloop, stopped by SIGTERM or SIGHUP as by Ctrl-C.

A run starts execds and baseline servers, each with a private directory (its
token file among others) that the run stops and removes on its way out.
Ctrl-C cancels the run's task, so every ``finally`` block runs. SIGTERM and
SIGHUP at their default would end the process with none of them run: the
execds would end by their lease, but their directories would stay behind.
:func:`run` makes both cancel the run as SIGINT does; the process then exits
with status 128 + the signal's number.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

import uvloop

T = TypeVar("T")

STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGHUP)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on a fresh uvloop; SIGTERM or SIGHUP cancel it (then SystemExit)."""
    received: list[int] = []

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def stop(signum: int) -> None:
            # The first one only: a second must not cut the cleanup short.
            if not received:
                received.append(signum)
                task.cancel()

        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, stop, signum)
        try:
            return await main
        finally:
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            return runner.run(guarded())
        except asyncio.CancelledError:
            if received:
                raise SystemExit(128 + received[0]) from None
            raise
