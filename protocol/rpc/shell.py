"""Parameter and result shapes of the ``shell.*`` methods.

``shell.run`` runs one command: ``argv`` directly, or a ``command`` string
through ``/bin/sh -c``. Every command leads its own session and process
group; stopping it (timeout, idle timeout, cancel, lost connection) sends
SIGTERM to the whole group and SIGKILL after ``kill_grace``.

Streams: with ``stream=True`` output goes live to the client on the streams
:data:`STDOUT_STREAM` and :data:`STDERR_STREAM` (each ended before the
result); otherwise it is collected, each stream capped at ``output_cap``
bytes of which the first half (head) and the last half (tail) are kept, and
both captures are cut together by the same rule to fit one reply frame to the
client (PROTOCOL.md, section 15.4). With
``stdin_stream=True`` the command's stdin is fed from the client's
:data:`STDIN_STREAM`; with ``stdin`` bytes it reads those; otherwise it reads
``/dev/null``.

Detached commands (``detached=True``) outlive the connection. ``shell.run``
returns at once with their ``command_id``; ``shell.list``, ``shell.attach``,
``shell.status``, ``shell.wait`` and ``shell.signal`` address them by it. A
finished detached command is forgotten once a client has read its final
status, or after the daemon's retention period.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from protocol.messages import CallId, RequestId
from protocol.rpc import Rpc, Schema
from protocol.rpc.resources import LimitName, Limits, Mechanism, ProcessEnd
from protocol.rpc.types import (
    Argv,
    Command,
    Count,
    Env,
    OutputCap,
    PathStr,
    Seconds,
    Stdin,
    Unset,
)

#: The stream of a command's standard output.
STDOUT_STREAM: Final = "stdout"
#: The stream of a command's standard error.
STDERR_STREAM: Final = "stderr"
#: The stream the client sends a command's standard input on.
STDIN_STREAM: Final = "stdin"

MAX_COMMAND_ID: Final = 64
"""Longest command id."""

MAX_TITLE: Final = 1024
"""Longest ``CommandInfo.title``; longer command lines are truncated."""

Signal = Annotated[int, msgspec.Meta(ge=0, le=64)]
CommandId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_COMMAND_ID)]
CommandState = Literal["running", "exited"]


# -- shell.run -------------------------------------------------------------------


class RunParams(Schema):
    """Run one command; exactly one of ``argv`` and ``command`` is required.

    ``env`` overrides and ``unset`` removes variables of the daemon's base
    environment (the daemon's marker variable can be neither). ``timeout``
    bounds the command's run; ``idle_timeout`` stops it after that many
    seconds without output. ``output_cap`` (collected mode) caps each stream;
    ``drain_grace`` is how long output may keep flowing after the command
    exits (a background child holding the pipes cannot hold the reply longer);
    ``kill_grace`` is the wait between SIGTERM and SIGKILL. Unset values take
    the daemon's defaults.
    """

    argv: Argv | None = None
    command: Command | None = None
    cwd: PathStr | None = None
    env: Env | None = None
    unset: Unset | None = None
    stdin: Stdin | None = None
    stdin_stream: bool = False
    timeout: Seconds | None = None
    idle_timeout: Seconds | None = None
    stream: bool = False
    output_cap: OutputCap | None = None
    drain_grace: Seconds | None = None
    kill_grace: Seconds | None = None
    detached: bool = False
    limits: Limits | None = None


class RunResult(Schema):
    """Outcome of ``shell.run``.

    A detached run returns at once with ``command_id`` and ``pid`` only.
    Otherwise exactly one of ``exit_code`` and ``signal`` is set (``signal``:
    the command was killed by that signal). ``timed_out``/``idle_out`` say the
    daemon stopped it. In collected mode ``stdout``/``stderr`` hold the output
    (partial after a timeout); when ``stdout_dropped`` is positive, the first
    ``len(stdout) // 2`` bytes of ``stdout`` are its head and the rest its
    tail, with ``stdout_dropped`` bytes lost between them (same for stderr).
    ``pipes_held_open``: something the command left behind still held its
    output pipes when the drain grace ran out; output after that is lost.
    ``duration`` is seconds from spawn to exit.
    """

    pid: int
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    idle_out: bool = False
    duration: float = 0.0
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_dropped: Count = 0
    stderr_dropped: Count = 0
    pipes_held_open: bool = False
    command_id: str | None = None
    #: The limit that ended the command, where it can be told (``protocol.rpc.resources``).
    limit_exceeded: LimitName | None = None
    #: How each limit of the command was enforced.
    limits: dict[LimitName, Mechanism] | None = None


# -- shell.signal ----------------------------------------------------------------


class SignalParams(Schema):
    """Send ``signal`` to a running command: exactly one of the three ids.

    ``call_id`` names a running non-detached ``shell.run`` call on the same
    connection; ``rid`` one by its request id (PROTOCOL.md section 8.1),
    from any connection, also once another connection has taken it on
    (``request.attach``); ``command_id`` a detached command. With ``group``
    (default) the whole process group gets the signal. Unless it is a stop signal,
    SIGCONT follows so a stopped command wakes up to receive it. Signal 0
    only checks that the target exists.
    """

    signal: Signal
    call_id: CallId | None = None
    command_id: CommandId | None = None
    group: bool = True
    rid: RequestId | None = None


class SignalResult(Schema):
    """``shell.signal`` delivered the signal to the command with this pid."""

    pid: int


# -- detached commands -----------------------------------------------------------


class CommandInfo(ProcessEnd):
    """What is known about one detached command.

    ``title`` is the command line, truncated to :data:`MAX_TITLE`
    characters. ``started``/``finished`` are Unix times. ``stdout_bytes`` and
    ``stderr_bytes`` count all output produced so far, kept or not.
    """

    command_id: str
    pid: int
    title: str
    state: CommandState
    started: float
    cwd: str | None = None
    finished: float | None = None
    timed_out: bool = False
    idle_out: bool = False
    duration: float | None = None
    stdout_bytes: Count = 0
    stderr_bytes: Count = 0
    pipes_held_open: bool = False
    attached: bool = False


class ListParams(Schema):
    """``shell.list`` takes no parameters."""


class ListResult(Schema):
    """Every detached command the daemon remembers, oldest first."""

    commands: list[CommandInfo]
    #: Set when more remained than fit one reply frame to the client (the first are listed).
    truncated: bool = False


class StatusParams(Schema):
    """``shell.status``: the state of one detached command, without waiting."""

    command_id: CommandId


class WaitParams(Schema):
    """``shell.wait``: wait until the command exits or ``timeout`` passes.

    On timeout the reply is the still-running command's info.
    """

    command_id: CommandId
    timeout: Seconds | None = None


class AttachParams(Schema):
    """``shell.attach``: replay the retained output, then follow it live.

    The replay comes from a bounded ring per stream; bytes that fell off it
    are counted in the result. With ``follow`` false the call returns after
    the replay. One client at a time may be attached to a command.
    """

    command_id: CommandId
    follow: bool = True


class AttachResult(Schema):
    """``shell.attach`` finished: the command's info and bytes lost off the rings."""

    info: CommandInfo
    stdout_lost: Count = 0
    stderr_lost: Count = 0


# -- the methods --------------------------------------------------------------
RUN: Final = Rpc("shell.run", RunParams, RunResult)
SIGNAL: Final = Rpc("shell.signal", SignalParams, SignalResult)
LIST: Final = Rpc("shell.list", ListParams, ListResult)
STATUS: Final = Rpc("shell.status", StatusParams, CommandInfo)
WAIT: Final = Rpc("shell.wait", WaitParams, CommandInfo)
ATTACH: Final = Rpc("shell.attach", AttachParams, AttachResult)

RPCS: Final = (RUN, SIGNAL, LIST, STATUS, WAIT, ATTACH)
