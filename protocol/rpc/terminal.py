"""Parameter and result shapes of the ``terminal.*`` methods: programs that want a terminal.

``terminal.open`` starts a command as the leader of its own session with a
new pseudo-terminal as its controlling terminal and as its stdin, stdout and
stderr, and returns at once with the terminal's ``terminal_id``. The terminal
lives until its program exits and a client has read the final status, until
``terminal.close`` (a hang-up to its whole session: SIGHUP and SIGCONT,
SIGKILL after ``grace``), or until the daemon's session ends, whichever comes
first; it outlives the connection that opened it.

``terminal.attach`` streams what the program writes on :data:`OUTPUT_STREAM`:
first the retained recent output (a bounded ring; bytes that fell off it are
counted in ``lost``), then live output, flow controlled: while a client is
attached and has not taken the output, the daemon stops reading the
terminal and the program blocks on its writes. Cancelling the call detaches
(the program keeps running, its output goes to the ring again); one client at
a time may be attached. The call ends with the program's exit (after the
stream's end) or, with ``follow`` false, after the replay.

``terminal.send`` writes bytes to the terminal as keystrokes (the line
discipline applies: ``b"\\x03"`` is an interrupt, ``b"\\x04"`` end of file on
an empty line), ``terminal.resize`` sets the window size (the foreground
process group gets SIGWINCH), ``terminal.wait`` waits for the exit.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from protocol.rpc import Rpc, Schema
from protocol.rpc.resources import Limits, ProcessEnd
from protocol.rpc.shell import CommandState
from protocol.rpc.types import Argv, Command, Count, Env, PathStr, Seconds, Unset

#: The stream of what the program on the terminal writes.
OUTPUT_STREAM: Final = "output"

MAX_SEND: Final = 1024 * 1024
"""Most bytes one ``terminal.send`` carries."""

MAX_TERMINAL_ID: Final = 64

TerminalId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TERMINAL_ID)]
Rows = Annotated[int, msgspec.Meta(ge=1, le=4096)]
Cols = Annotated[int, msgspec.Meta(ge=1, le=4096)]


class OpenParams(Schema, kw_only=True):
    """Start a program on a new terminal: exactly one of ``argv`` and ``command``.

    ``env``/``unset`` as for ``shell.run``; ``TERM`` is ``xterm-256color``
    unless the call or the daemon's environment sets it. ``rows``/``cols``:
    the initial window size.
    """

    argv: Argv | None = None
    command: Command | None = None
    cwd: PathStr | None = None
    env: Env | None = None
    unset: Unset | None = None
    rows: Rows = 24
    cols: Cols = 80
    limits: Limits | None = None


class TerminalInfo(ProcessEnd, kw_only=True):
    """What is known about one terminal.

    ``tty`` is the terminal's device (``/dev/pts/N``). Once ``state`` is
    ``exited`` exactly one of ``exit_code`` and ``signal`` is set.
    ``output_bytes`` counts everything the program wrote, kept or not.
    """

    terminal_id: str
    pid: int
    tty: str
    title: str
    state: CommandState
    rows: int
    cols: int
    output_bytes: Count = 0
    attached: bool = False


class AttachParams(Schema, kw_only=True):
    """``terminal.attach``: replay the retained output, then (``follow``) stream it live."""

    terminal_id: TerminalId
    follow: bool = True


class AttachResult(Schema, kw_only=True):
    """``terminal.attach`` ended: the terminal's info and the bytes lost off the ring."""

    info: TerminalInfo
    lost: Count = 0


class SendParams(Schema, kw_only=True):
    """``terminal.send``: write ``data`` to the terminal as typed keys."""

    terminal_id: TerminalId
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_SEND)]


class ResizeParams(Schema, kw_only=True):
    """``terminal.resize``: the new window size."""

    terminal_id: TerminalId
    rows: Rows
    cols: Cols


class WaitParams(Schema, kw_only=True):
    """``terminal.wait``: wait for the program's exit, up to ``timeout`` (then its current info)."""

    terminal_id: TerminalId
    timeout: Seconds | None = None


class CloseParams(Schema, kw_only=True):
    """``terminal.close``: hang up (SIGHUP to the session), SIGKILL after ``grace`` seconds."""

    terminal_id: TerminalId
    grace: Seconds | None = None


# -- the methods --------------------------------------------------------------
OPEN: Final = Rpc("terminal.open", OpenParams, TerminalInfo)
ATTACH: Final = Rpc("terminal.attach", AttachParams, AttachResult)
SEND: Final = Rpc("terminal.send", SendParams, type(None))
RESIZE: Final = Rpc("terminal.resize", ResizeParams, type(None))
WAIT: Final = Rpc("terminal.wait", WaitParams, TerminalInfo)
CLOSE: Final = Rpc("terminal.close", CloseParams, TerminalInfo)

RPCS: Final = (OPEN, ATTACH, SEND, RESIZE, WAIT, CLOSE)
