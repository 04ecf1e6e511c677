"""Driving a call's coroutine: its first step at once where it cannot need a task, the rest in one.

A task per call costs its creation, a trip through the event loop's ready
queue and a step, for a handler that may well finish without ever
suspending (``server.noop``, a small inline file read). :func:`start` avoids
that:

* A method marked ``direct`` (its handler calls nothing that needs a
  current task, such as ``asyncio.timeout``, before it first suspends) has
  its first step run here, outside any task; only if it suspends does a
  task take over the rest of it (:class:`_Rest` hands it the future the
  coroutine waits on, then every result, cancellation and exception through
  to the same coroutine). No task at all for a call that finishes at once:
  even an eager one (below) costs its creation, its context and its
  registration, several times what running the step here costs.
* Other methods get an *eager* task on Python 3.12+ (``eager_start=True``):
  its first step runs at once, as the current task, and a call that
  finishes there never reaches the ready queue. On 3.11, a task as before.

Either way the same coroutine (``ServerProtocol._run``) runs the call, so
every check and answer is shared; only who drives it differs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine, Generator
from types import TracebackType
from typing import Any, Final


def start(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None], name: str, direct: bool
) -> asyncio.Task[None] | None:
    """Run ``coro``; the task that runs the rest of it, or None when it finished at once."""
    if direct:
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return None
        return loop.create_task(_Rest(coro, waiting_on), name=name)
    if sys.version_info >= (3, 12):
        task = asyncio.Task(coro, loop=loop, name=name, eager_start=True)
        return None if task.done() else task
    return loop.create_task(coro, name=name)


#: What :class:`_Rest` holds once it has handed the task what the coroutine waited on.
_HANDED_OVER: Final = object()


class _Rest(Generator[Any, Any, None]):
    """The rest of a coroutine whose first step ran outside a task, for a task to run.

    The task's first step gets the future the coroutine waits on, as if the
    coroutine had just yielded it; every later step, and every exception
    thrown in, goes to the coroutine. A cancellation thrown in before the
    task's first step too (a Cancel read right behind its Call): the
    coroutine is cancelled where it waits, as in a task of its own. (An
    ``async def`` around it would be cancelled before it ever ran, and leave
    the coroutine waiting for good.)
    """

    __slots__ = ("_coro", "_waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on

    def send(self, value: Any) -> Any:
        waiting_on = self._waiting_on
        if waiting_on is _HANDED_OVER:
            return self._coro.send(value)
        self._waiting_on = _HANDED_OVER
        return waiting_on

    def throw(self, typ: Any, val: Any = None, tb: TracebackType | None = None, /) -> Any:
        self._waiting_on = _HANDED_OVER
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def __await__(self) -> Generator[Any, Any, None]:
        return self
