"""Driving a call's coroutine: its first step at once where it cannot need a task, the rest in one.

A task per call costs its creation, a trip through the event loop's ready
queue and a step, for a handler that may well finish without ever
suspending (``server.noop``, a small inline file read). :func:`start` avoids
that:

* On Python 3.12+ every call is an *eager* task (``eager_start=True``): its
  first step runs at once, as the current task, and a call that finishes
  there never reaches the ready queue.
* On Python 3.11 a method marked ``direct`` (its handler calls nothing that
  needs a current task, such as ``asyncio.timeout``, before it first
  suspends) has its first step run here, outside any task; only if it
  suspends does a task take over the rest of it (:class:`_Rest` hands the
  future it waits on, then every result, cancellation and exception, through
  to the same coroutine). Other methods get a task as before.

Either way the same coroutine (``ServerProtocol._run``) runs the call, so
every check and answer is shared; only who drives it differs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine, Generator
from typing import Any


def start(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None], name: str, direct: bool
) -> asyncio.Task[None] | None:
    """Run ``coro``; the task that runs the rest of it, or None when it finished at once."""
    if sys.version_info >= (3, 12):
        task = asyncio.Task(coro, loop=loop, name=name, eager_start=True)
        return None if task.done() else task
    if not direct:
        return loop.create_task(coro, name=name)
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return None
    return loop.create_task(_finish(_Rest(coro, waiting_on)), name=name)


class _Rest:
    """The rest of a coroutine whose first step ran outside a task, as an awaitable."""

    __slots__ = ("_coro", "_waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, None]:
        coro, waiting_on = self._coro, self._waiting_on
        del self._coro, self._waiting_on
        while True:
            try:
                # The task sees the very future the coroutine waits on, as if it had yielded it.
                sent = yield waiting_on
            except BaseException as exc:
                try:
                    waiting_on = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    waiting_on = coro.send(sent)
                except StopIteration:
                    return


async def _finish(rest: _Rest) -> None:
    await rest
