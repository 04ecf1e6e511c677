"""Parameter and result shapes of the ``sessions.*`` methods: persistent shells.

A *session* is a named ``/bin/sh`` that lives between calls, like a
terminal: the working directory, exported variables, shell variables and
functions a command leaves behind are there for the next command. Each
``sessions.run`` runs one command text in that shell and reports its own
exit status, output and working directory.

How a command runs
------------------

The command text is written to a private file and sourced by the session
shell (``. file``), so ``cd``, ``export``, heredocs and everything else of
the shell language behave as typed at a prompt. Its stdin is ``/dev/null``
(or the ``stdin`` bytes of the call); its stdout and stderr are collected,
each capped at ``output_cap`` bytes of which the first half (head) and the
last half (tail) are kept, both cut together to fit one reply frame as for
``shell.run``. The exit status travels back on a channel of its
own, never in the output, so nothing a command prints can fake or hide it.

Background jobs (``cmd &``) do not delay the reply; output they write while
a later command runs is part of that command's output, and output written
while the session is idle is discarded. ``exit`` (or anything else that
ends the shell) ends the session: that run reports the shell's exit status
with ``session_ended`` set, and later calls fail with ``SESSION_DEAD``.

Interrupts and timeouts
-----------------------

``sessions.interrupt`` sends SIGINT to the foreground command: processes the
command started in the foreground die as on a terminal's Ctrl-C, background
jobs (which ignore SIGINT) and the shell survive, and the rest of the
command text is skipped (exit status 130). A command running past
``timeout`` is interrupted the same way; whatever it started that is still
alive ``kill_grace`` seconds later is killed with SIGKILL (background jobs of
earlier commands are spared). If even that does not end it, the session is
killed (``session_ended``).

Methods
-------

* ``sessions.open`` (:class:`OpenParams` -> :class:`SessionInfo`): start a
  session (``SESSION_EXISTS`` while one of that name is alive; a dead one is
  replaced; ``LIMIT_EXCEEDED`` beyond the daemon's limit, once no dead
  session is left to make room).
* ``sessions.run`` (:class:`RunParams` -> :class:`RunResult`): run one
  command; ``SESSION_BUSY`` while another runs, ``SESSION_DEAD`` once the
  shell has ended, ``NO_SUCH_SESSION`` for an unknown name.
* ``sessions.interrupt`` (:class:`InterruptParams` -> :class:`InterruptResult`).
* ``sessions.close`` (:class:`CloseParams` -> :class:`CloseResult`): kill the
  shell and everything it started (its process group, and every process
  that inherited the session's sub-marker variable, whatever its group), and
  forget the session.
* ``sessions.list`` (:class:`ListParams` -> :class:`ListResult`).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from protocol.rpc import Rpc, Schema
from protocol.rpc.resources import LimitName, Limits, Mechanism, ProcessEnd
from protocol.rpc.types import Command, Count, Env, OutputCap, PathStr, Seconds, Stdin, Unset

NAME_PATTERN: Final = r"^[A-Za-z0-9_.-]{1,64}$"
"""What a session name looks like."""

Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
SessionState = Literal["idle", "busy", "dead"]


class OpenParams(Schema):
    """Open a session whose shell starts in ``cwd`` with ``env`` added to the base environment."""

    name: Name
    cwd: PathStr | None = None
    env: Env | None = None
    unset: Unset | None = None
    #: Resource limits of the shell and everything it runs (``protocol.rpc.resources``).
    limits: Limits | None = None


class SessionInfo(ProcessEnd):
    """What is known about one session.

    ``cwd`` is the shell's current working directory (physical path), absent
    once it has ended. ``commands`` counts the commands run. For a dead
    session, ``exit_code`` or ``signal`` tells how the shell ended.
    """

    name: str
    pid: int
    state: SessionState
    created: float
    cwd: str | None = None
    commands: Count = 0


class RunParams(Schema):
    """Run ``command`` in the session.

    ``stdin`` bytes are the command's stdin (default ``/dev/null``).
    ``timeout`` bounds its run (default none); ``kill_grace`` is the wait
    after the interrupt before leftovers are killed (daemon default);
    ``output_cap`` caps each output stream (daemon default and maximum).
    """

    name: Name
    command: Command
    stdin: Stdin | None = None
    timeout: Seconds | None = None
    kill_grace: Seconds | None = None
    output_cap: OutputCap | None = None


class RunResult(Schema):
    """Outcome of one command.

    ``exit_code`` is the command's exit status (130 after an interrupt);
    when the command ended the shell, it is the shell's exit status, or
    ``signal`` is the signal that killed the shell, and ``session_ended``
    is set. ``cwd`` is the shell's working directory afterwards.
    ``interrupted``: an interrupt (or the timeout) was sent; ``timed_out``:
    the command ran past ``timeout``. ``stdout_dropped``/``stderr_dropped``
    count bytes lost between head and tail. ``duration`` is in seconds.
    ``limit_exceeded`` names the session's limit this command ran into (see
    :mod:`protocol.rpc.resources`), judged from this command alone (its exit
    status, the cgroup events counted while it ran) or, when the command
    ended the shell, from how the shell ended.
    """

    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_dropped: Count = 0
    stderr_dropped: Count = 0
    cwd: str | None = None
    timed_out: bool = False
    interrupted: bool = False
    session_ended: bool = False
    duration: float = 0.0
    #: The session's limit this command ran into, where it can be told (``protocol.rpc.resources``).
    limit_exceeded: LimitName | None = None
    #: How each limit of the session is enforced (as in its :class:`SessionInfo`).
    limits: dict[LimitName, Mechanism] | None = None


class InterruptParams(Schema):
    """``sessions.interrupt``: SIGINT to the running command of a session."""

    name: Name


class InterruptResult(Schema):
    """``sent`` is false when no command was running."""

    sent: bool


class CloseParams(Schema):
    """``sessions.close``: kill the session and everything it started."""

    name: Name


class CloseResult(Schema):
    """The session's last state, processes killed, and any marked process left alive."""

    info: SessionInfo
    killed: Count = 0
    remaining: list[int] = msgspec.field(default_factory=list)


class ListParams(Schema):
    """``sessions.list`` takes no parameters."""


class ListResult(Schema):
    """Every session, in open order."""

    sessions: list[SessionInfo]
    #: Set when more remained than fit one reply frame to the client (the first are listed).
    truncated: bool = False


# -- the methods --------------------------------------------------------------
OPEN: Final = Rpc("sessions.open", OpenParams, SessionInfo)
RUN: Final = Rpc("sessions.run", RunParams, RunResult)
INTERRUPT: Final = Rpc("sessions.interrupt", InterruptParams, InterruptResult)
CLOSE: Final = Rpc("sessions.close", CloseParams, CloseResult)
LIST: Final = Rpc("sessions.list", ListParams, ListResult)

RPCS: Final = (OPEN, RUN, INTERRUPT, CLOSE, LIST)
