"""Running a bench entry point as a harnessd command runs its session.

A run starts execds and baseline servers, each with a private directory (its
token file among others) that the run stops and removes on its way out.
SIGTERM or SIGHUP at their default would end the process with no ``finally``
block run: the execds would end by their lease, but their directories would
stay behind. :func:`run` goes through :func:`harnessd.cli_common.run_session`,
where SIGINT, SIGTERM and SIGHUP cancel the run and every ``finally`` block
runs; the process then exits with status 128 + the signal's number.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from harnessd.cli_common import run_session

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], prog: str) -> T:
    """``main``'s result; SystemExit with the status when a signal (or a HarnessError) ended it."""
    results: list[T] = []

    async def keep() -> int:
        results.append(await main)
        return 0

    status = run_session(keep, prog)
    if status or not results:
        raise SystemExit(status)
    return results[0]
