"""What peers can make execd hold: bounds in total and per connection, within the process's limits.

Theory of operation
-------------------
Three things execd holds grow with what its peers ask: connections (held to
``Limits.max_connections`` by the server's admission, :mod:`execd.server`),
processes it starts, and files its calls keep open. A :class:`Budget` counts
one of the last two against a bound in total and a bound per connection, and
refuses at once, with a typed error on a connection that lives on, rather
than make a call wait for room that a stalled peer may never give back:

* **processes** (:func:`processes`): every process execd starts (a command,
  a terminal's program, a service instance, a session's shell, a readiness
  probe) holds one unit until it is reaped; a command that runs for a call on
  a connection (``shell.run`` not detached) also holds one of that
  connection's share. Refused with PROCESS_LIMIT.
* **open files** (:func:`open_files`): a ``files.*`` call holds a unit per
  descriptor it may keep open until it ends (a read, a digest, a listing, a
  removal one; a write or a move two), given back once no unit of work it
  started still runs; a ``ledger.read`` two while it streams. Refused with
  LIMIT_EXCEEDED. (The ledgers' own files are at most :data:`LEDGERS_OPEN`.)

Descriptors. Every unit stands for a bounded number of descriptors (a
process at most :data:`FDS_PER_PROCESS`: its pipes, its pidfd and what its
kind adds, a terminal's master or a session's channels), so the bounds give
the most descriptors execd holds: :func:`descriptor_bound`. At start,
:func:`fit_process_limits` raises the soft ``RLIMIT_NOFILE`` to cover that
bound, up to the hard limit, and where the hard limit is lower scales the
bounds down to fit; it also keeps the process bound within half a finite
``RLIMIT_NPROC`` (the user's other processes and the commands' own children
need the rest). So one peer, or many, cannot run execd out of descriptors
or the workspace out of processes; what it is refused is named in the error.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import msgspec

from execd.config import Limits
from execd.errors import ExecdError, LimitExceeded, ProcessLimit

log = logging.getLogger(__name__)

RESERVED_FDS = 64
"""Descriptors of execd's own: stdio, the listener, the event loop's, inotify, its log, cgroups."""
FDS_PER_PROCESS = 6
"""Most descriptors one process execd started holds in execd (pipes, pidfd, channels)."""
FDS_PER_OPEN_FILE = 1
"""Descriptors one unit of the open-files budget stands for."""
FDS_PER_LEDGER = 2
"""Descriptors of one open ledger (its data and its index)."""
LEDGERS_OPEN = 64
"""Most ledgers open at once (:class:`execd.ledger.LedgerStore`)."""

Refusal = Callable[[str, int], ExecdError]
"""Makes the error for a budget whose bound (``"in total"`` or ``"per connection"``) is hit."""


class Budget:
    """A count held against ``total`` and, per connection, against ``per_connection``."""

    __slots__ = ("_held", "_refuse", "per_connection", "total", "used")

    def __init__(self, total: int, per_connection: int, refuse: Refusal) -> None:
        self.total = total
        self.per_connection = per_connection
        self._refuse = refuse
        self.used = 0
        self._held: dict[Hashable, int] = {}

    def take(self, connection: Hashable | None = None, units: int = 1) -> Callable[[], None]:
        """Hold ``units`` more (for ``connection``, if not None), or raise the budget's error.

        Returns the function that gives them back; calling it again does nothing.
        """
        if self.used + units > self.total:
            raise self._refuse("in total", self.total)
        if connection is not None:
            held = self._held.get(connection, 0)
            if held + units > self.per_connection:
                raise self._refuse("per connection", self.per_connection)
            self._held[connection] = held + units
        self.used += units
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if given_back:
                return
            given_back = True
            self.used -= units
            if connection is not None:
                left = self._held[connection] - units
                if left:
                    self._held[connection] = left
                else:
                    del self._held[connection]

        return give_back

    def held_by(self, connection: Hashable) -> int:
        """Units ``connection`` holds now."""
        return self._held.get(connection, 0)


@dataclass(frozen=True, slots=True)
class Budgets:
    """The budgets of one execd, shared by the capabilities that hold what they count."""

    processes: Budget
    open_files: Budget

    @classmethod
    def of(cls, limits: Limits) -> Budgets:
        return cls(processes(limits), open_files(limits))


def processes(limits: Limits) -> Budget:
    """The budget of processes execd runs (see the module docstring)."""

    def refuse(scope: str, bound: int) -> ExecdError:
        if scope == "in total":
            return ProcessLimit(f"too many running processes (limit {bound})", {"limit": bound})
        return ProcessLimit(
            f"too many commands running for this connection (limit {bound})",
            {"limit": bound, "scope": "connection"},
        )

    return Budget(limits.max_processes, limits.max_processes_per_connection, refuse)


def open_files(limits: Limits) -> Budget:
    """The budget of files ``files.*`` calls hold open (see the module docstring)."""

    def refuse(scope: str, bound: int) -> ExecdError:
        where = "" if scope == "in total" else " for this connection"
        data: dict[str, object] = {"limit": bound}
        if scope != "in total":
            data["scope"] = "connection"
        return LimitExceeded(f"too many files open{where} (limit {bound})", data)

    return Budget(limits.max_open_files, limits.max_open_files_per_connection, refuse)


def descriptor_bound(limits: Limits) -> int:
    """The most descriptors execd holds under ``limits`` (see the module docstring)."""
    return (
        RESERVED_FDS
        + limits.max_connections
        + FDS_PER_PROCESS * limits.max_processes
        + FDS_PER_OPEN_FILE * limits.max_open_files
        + FDS_PER_LEDGER * LEDGERS_OPEN
    )


def fit_process_limits(limits: Limits) -> Limits:
    """``limits`` made to fit this process's RLIMIT_NOFILE and RLIMIT_NPROC (see above).

    Raises the soft descriptor limit as far as the bounds need and the hard
    limit allows; scales the bounds down (logging it) where that is not far
    enough.
    """
    nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if nproc != resource.RLIM_INFINITY and limits.max_processes > nproc // 2:
        fitted = max(1, nproc // 2)
        log.warning(
            "RLIMIT_NPROC is %d: running at most %d processes (not %d)",
            nproc,
            fitted,
            limits.max_processes,
        )
        limits = msgspec.structs.replace(
            limits,
            max_processes=fitted,
            max_processes_per_connection=min(limits.max_processes_per_connection, fitted),
        )
    need = descriptor_bound(limits)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY or soft >= need:
        return limits
    return _scaled(limits, soft)


def _scaled(limits: Limits, available: int) -> Limits:
    """``limits`` with the bounds that grow with peers scaled down to ``available`` descriptors."""
    fixed = RESERVED_FDS + FDS_PER_LEDGER * LEDGERS_OPEN
    growing = descriptor_bound(limits) - fixed
    share = max(available - fixed, 0) / growing
    fitted = msgspec.structs.replace(
        limits,
        max_connections=max(1, int(limits.max_connections * share)),
        max_unauthenticated=max(
            1, min(limits.max_unauthenticated, int(limits.max_connections * share))
        ),
        max_processes=max(1, int(limits.max_processes * share)),
        max_open_files=max(1, int(limits.max_open_files * share)),
    )
    fitted = msgspec.structs.replace(
        fitted,
        max_processes_per_connection=min(fitted.max_processes_per_connection, fitted.max_processes),
        max_open_files_per_connection=min(
            fitted.max_open_files_per_connection, fitted.max_open_files
        ),
    )
    log.warning(
        "RLIMIT_NOFILE allows %d descriptors, %d wanted: at most %d connections, %d processes, "
        "%d open files",
        available,
        descriptor_bound(limits),
        fitted.max_connections,
        fitted.max_processes,
        fitted.max_open_files,
    )
    return fitted
