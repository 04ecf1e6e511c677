"""What the capabilities that start commands share: ``shell``, ``services``, ``sessions``.

This module owns the rules a call's parameters pass through before a process
is spawned, so that the three capabilities cannot drift apart:

* :data:`SHELL` runs a command given as a string (``/bin/sh -c``), and
  :func:`command_argv` turns a call's ``argv`` or ``command`` into the argv
  to spawn;
* :func:`check_variables` holds the rules for environment names and values,
  and :func:`command_environment` layers a call's ``env`` and ``unset`` over
  a capability's base environment, keeping the marker variables out of the
  caller's reach (``execd.marker.child_environment`` applies the same rules
  to the daemon's own base environment);
* :func:`title_of` is the bounded one-line description clients see;
* :func:`private_root` is where a capability keeps files only this user may
  enter (service logs, session channels);
* :class:`CommandCapability` is what each of the three keeps: its limits,
  the protected marker variable, the base environment of its commands, its
  :class:`BackgroundTasks` (tasks it starts and must see finished before it
  closes), its :func:`private_root` once made, and whether it is closed (then
  it refuses to start anything); :func:`close_each` ends a table of
  records at once when it closes, and :func:`wait_done` is the ``*.wait``
  methods' bounded wait for a record to end. Every process it starts holds a
  unit of the process budget (:mod:`execd.budget`) until it is reaped
  (:meth:`CommandCapability._counted`), shared with the other capabilities.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, ClassVar, Protocol, TypeVar

from execd import budget
from execd.config import Config
from execd.context import Method, bind
from execd.errors import InvalidParams, ShuttingDown
from protocol.rpc import Rpc

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Exits(Protocol):
    """A started process, or the record of one: its exit status once reaped."""

    @property
    def exited(self) -> asyncio.Future[int]: ...


Started = TypeVar("Started", bound=_Exits)

SHELL = "/bin/sh"
"""The shell that runs a command given as a string."""

_DIR_MODE = 0o700


def command_argv(argv: list[str] | None, command: str | None, what: str = "") -> list[str]:
    """The argv a call names: ``argv`` itself, or ``command`` run by :data:`SHELL`.

    Exactly one of the two must be given. ``what`` names the thing in error
    messages (``"a command probe"``); the call itself when empty.
    """
    if (argv is None) == (command is None):
        raise InvalidParams(f"{what or 'the call'} needs exactly one of argv and command")
    if command is not None:
        return [SHELL, "-c", command]
    assert argv is not None
    if not argv or not argv[0]:
        raise InvalidParams(f"argv[0] of {what or 'the call'} must not be empty")
    return list(argv)


def title_of(argv: list[str]) -> str:
    """A one-line description of a command, at most ``MAX_TITLE`` characters."""
    # Imported here: the shell schemas and shlex are not needed before execd listens.
    import shlex

    from protocol.rpc.shell import MAX_TITLE

    text = argv[2] if argv[:2] == [SHELL, "-c"] and len(argv) == 3 else shlex.join(argv)
    return text if len(text) <= MAX_TITLE else text[: MAX_TITLE - 1] + "…"


# -- environments -----------------------------------------------------------------------


def _shown(name: str) -> str:
    """A variable name fit for an error message: quoted and bounded."""
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def check_variables(
    assignments: Mapping[str, str] | None,
    unset: Iterable[str] | None,
    protected: Iterable[str],
    origin: str = "environment",
) -> None:
    """Refuse what no process can receive, and any touch of a ``protected`` name.

    A name must be non-empty and hold neither ``=`` nor NUL; a value must be
    text without NUL. Raises :class:`~execd.errors.InvalidParams`, whose
    message names the variable but never echoes a value.
    """
    guarded = frozenset(protected)
    for name in unset or ():
        _check_name(name, "unset")
        if name in guarded:
            raise InvalidParams(f"unset: {_shown(name)} is a marker variable; it cannot be unset")
    for name, value in (assignments or {}).items():
        _check_name(name, origin)
        if name in guarded:
            raise InvalidParams(f"{origin}: {_shown(name)} is a marker variable; it cannot be set")
        if not isinstance(value, str) or "\0" in value:
            raise InvalidParams(f"{origin}: the value of {_shown(name)} must be text without NUL")


def _check_name(name: object, origin: str) -> None:
    if not isinstance(name, str) or not name or "=" in name or "\0" in name:
        raise InvalidParams(
            f"{origin}: {_shown(str(name))} is not a valid environment variable name"
            " (it must be non-empty and contain neither '=' nor NUL)"
        )


def command_environment(
    base: Mapping[str, str],
    protected: Iterable[str],
    env: Mapping[str, str] | None,
    unset: Iterable[str] | None,
    extra: Mapping[str, str] | None = None,
) -> Mapping[str, str]:
    """``base`` with ``unset`` removed and ``env`` then ``extra`` applied.

    Names in ``protected`` (the marker variables) may be neither set nor
    unset by the caller (:func:`check_variables`). Protected and ``extra``
    names come first in the result, so a bounded read of
    ``/proc/PID/environ`` always reaches them. With nothing to change,
    ``base`` itself is returned (the spawn path only reads it).
    """
    if not env and not unset and not extra:
        return base
    guarded = tuple(protected)
    check_variables(env, unset, guarded)
    result = dict(base)
    for name in unset or ():
        result.pop(name, None)
    result.update(env or {})
    result.update(extra or {})
    first = [name for name in dict.fromkeys((*guarded, *(extra or {}))) if name in result]
    ordered = {name: result.pop(name) for name in first}
    ordered.update(result)
    return ordered


# -- files and tasks --------------------------------------------------------------------


def private_root(config: Config, kind: str) -> str:
    """A directory only this user can enter: ``<state_dir>/<kind>``, or a fresh temporary one."""
    if config.state_dir:
        path = os.path.join(config.state_dir, kind)
        os.makedirs(path, mode=_DIR_MODE, exist_ok=True)
        return path
    import tempfile

    return tempfile.mkdtemp(prefix=f"execd-{kind}-")


class BackgroundTasks:
    """Tasks a capability starts and does not await in the call that started them.

    A failure is logged under ``name`` (nobody else would see it); :meth:`join`
    waits until every task, including those started meanwhile, is done.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` as a task kept until it is done."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s background task failed", self._name, exc_info=task.exception())

    async def join(self) -> None:
        """Wait for every task, those started while waiting too."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class CommandCapability:
    """The state of a capability that starts commands.

    ``base_env`` is the environment its commands start from; it carries the
    daemon's marker variable (``config.marker_var``), which calls may neither
    override nor unset. ``name`` labels the failures of its background tasks.
    """

    def __init__(
        self,
        config: Config,
        base_env: Mapping[str, str],
        name: str,
        processes: budget.Budget | None = None,
    ) -> None:
        self._config = config
        self._limits = config.limits
        #: The process budget, shared with every capability that starts processes.
        self._processes = processes if processes is not None else budget.processes(config.limits)
        from execd.limits import ResourceControl  # with the first capability, not at startup

        self._resources = ResourceControl(config.limits.command_limits)
        self._marker_var = config.marker_var
        self._base_env = dict(base_env)
        self._name = name
        self._background = BackgroundTasks(name)
        self._closed = False
        self._root: str | None = None

    rpcs: ClassVar[tuple[Rpc[Any, Any], ...]] = ()
    """The methods this capability serves, each by the handler named after it."""

    def methods(self) -> list[Method]:
        """The dispatch table entries of this capability."""
        return bind(self, self.rpcs)

    def _check_open(self) -> None:
        """Refuse to start anything once the capability is closing."""
        if self._closed:
            raise ShuttingDown(f"the {self._name} capability is closed")

    def _counted(self, start: Callable[[], Started], connection: int | None = None) -> Started:
        """``start()``, a process held against the process budget until it is reaped.

        ``connection``: the connection whose share it also holds (a command
        that runs for a call), or None. Raises ProcessLimit instead of
        starting it when a bound is reached.
        """
        give_back = self._processes.take(connection)
        try:
            child = start()
        except BaseException:
            give_back()
            raise
        child.exited.add_done_callback(lambda _: give_back())
        return child

    def _private_root(self) -> str:
        """This capability's :func:`private_root` (named after it), made on first use."""
        if self._root is None:
            self._root = private_root(self._config, self._name)
        return self._root


async def wait_done(done: asyncio.Event, timeout: float | None) -> None:
    """Wait up to ``timeout`` seconds (None: no limit) for ``done``; reaching it is no error."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await done.wait()


async def close_each(
    records: Iterable[T], close: Callable[[T], Awaitable[object]], describe: Callable[[T], str]
) -> None:
    """``close(record)`` for every record at once; a failure is logged, the rest go on."""
    pending = list(records)
    results = await asyncio.gather(*(close(record) for record in pending), return_exceptions=True)
    for record, result in zip(pending, results, strict=True):
        if isinstance(result, BaseException):
            log.error("%s failed", describe(record), exc_info=result)
