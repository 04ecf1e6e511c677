"""What every harnessd command shares: one-line usage errors and running a session.

Conventions of the command line: a mistake is one line on stderr naming the
command and the value at fault, never a traceback; usage errors exit 2. The
argument types (ports, seconds, counts) are execd's too: :mod:`protocol.values`.
:func:`run_session` runs a command's coroutine on uvloop so that SIGINT,
SIGTERM and SIGHUP cancel it -- its ``finally`` blocks close the session
(marker cleanup, temporary workspace removed) -- and then exit 128+N.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import NoReturn

from harnessd.errors import HarnessError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that end a harnessd command cleanly (exit status 128+N)."""

USAGE = 2
"""Exit status of a usage error (bad option, unreadable token file, ...)."""


class UsageError(Exception):
    """The command line asks for something that cannot be done; exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``PROG: MESSAGE (see PROG --help)``."""

    def error(self, message: str) -> NoReturn:
        say(f"{self.prog}: {message} (see {self.prog} --help)")
        sys.exit(USAGE)


def say(line: str) -> None:
    """Print one line on stderr; a closed stderr is not an error worth a traceback."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush cannot fail on a closed pipe."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def run_session(
    main: Callable[[], Awaitable[int]],
    prog: str,
    *,
    on_signal: Callable[[int], None] | None = None,
) -> int:
    """Run ``main()`` on uvloop and return the exit status.

    SIGINT, SIGTERM and SIGHUP cancel ``main`` once (later ones are ignored
    while it cleans up: cutting cleanup short is what would leak processes);
    the status is then 128+N. ``on_signal(signum)`` is called first (to
    record it, say). A :class:`HarnessError` is one line and status 1, a
    :class:`UsageError` one line and status 2.
    """
    import uvloop

    received: list[int] = []

    async def guarded() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def stop(signum: int) -> None:
            if received:
                return
            received.append(signum)
            say(f"{prog}: {signal.Signals(signum).name} received, closing the session")
            if on_signal is not None:
                with contextlib.suppress(Exception):
                    on_signal(signum)
            task.cancel()

        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, stop, signum)
        try:
            return await main()
        except asyncio.CancelledError:
            if received:
                return 128 + received[0]
            raise
        finally:
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            status = runner.run(guarded())
    except UsageError as exc:
        say(f"{prog}: {exc}")
        return USAGE
    except HarnessError as exc:
        say(f"{prog}: {exc}")
        return 128 + received[0] if received else 1
    except KeyboardInterrupt:
        say(f"{prog}: interrupted")
        return 128 + signal.SIGINT
    # A signal decides the status even when the work ended on its own meanwhile.
    return 128 + received[0] if received else status
