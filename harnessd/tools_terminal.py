"""The agent's tools for interactive programs: start one on a terminal, send keys, read, stop.

A model drives a REPL, answers a prompt or steers a full-screen program with
four tools, declared like every other tool (:mod:`harnessd.toolbox`) on
:data:`TERMINAL_TOOLS`:

* ``terminal_start``: start a command on a new terminal; returns the
  terminal's name and what it printed first;
* ``terminal_send``: type text and named keys (``enter``, ``ctrl-c``, ...),
  then return what appeared, waiting up to ``wait`` seconds;
* ``terminal_read``: what appeared since the last read, waiting up to
  ``wait`` seconds, at most ``max_chars``;
* ``terminal_stop``: hang it up; its exit status.

What the model sees is the terminal's output with escape sequences (colours,
cursor movement) and carriage returns removed. A terminal whose program
exits says so with its status. Each toolbox keeps its own terminals (at
most :data:`MAX_TERMINALS`) and hangs them up when it closes.
"""

from __future__ import annotations

import contextlib
import re
from typing import Annotated, Final, Literal

import msgspec

from harnessd.terminal import Terminal
from harnessd.tool_text import ToolFailed
from harnessd.toolbox import (
    MAX_SECONDS,
    Args,
    CallContext,
    Command,
    Name,
    Toolbox,
    ToolSet,
    WorkDir,
    about,
)
from protocol.rpc import terminal as terminal_api

MAX_TERMINALS = 8
"""Terminals one toolbox keeps open at a time."""

DEFAULT_READ = 4000
"""Characters a read returns unless the model asks for fewer or more."""

Key = Literal[
    "enter", "tab", "escape", "backspace", "up", "down", "right", "left",
    "ctrl-c", "ctrl-d", "ctrl-z", "ctrl-l", "ctrl-u",
]  # fmt: skip
KEYS: dict[str, bytes] = {
    "enter": b"\r",
    "tab": b"\t",
    "escape": b"\x1b",
    "backspace": b"\x7f",
    "up": b"\x1b[A",
    "down": b"\x1b[B",
    "right": b"\x1b[C",
    "left": b"\x1b[D",
    "ctrl-c": b"\x03",
    "ctrl-d": b"\x04",
    "ctrl-z": b"\x1a",
    "ctrl-l": b"\x0c",
    "ctrl-u": b"\x15",
}
Wait = Annotated[
    float,
    msgspec.Meta(ge=0, le=MAX_SECONDS),
    about("seconds to wait for output (returns early once it pauses)"),
]
MaxChars = Annotated[
    int, msgspec.Meta(ge=1, le=1_000_000), about("most characters of output to return")
]
TerminalName = Annotated[Name, about("the terminal's name, as terminal_start returned it")]

_ESCAPES = re.compile(rb"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


class TerminalStartArgs(Args):
    """Start an interactive program (a REPL, an installer asking questions, anything that needs
    a terminal) on a new terminal. Returns the terminal's name and what it printed first; then use
    terminal_send to type, terminal_read to see more, terminal_stop to end it."""

    command: Command
    cwd: WorkDir | None = None
    rows: Annotated[int, msgspec.Meta(ge=5, le=500), about("terminal height in lines")] = 24
    cols: Annotated[int, msgspec.Meta(ge=20, le=500), about("terminal width in columns")] = 80
    wait: Wait = 1.0


class TerminalSendArgs(Args):
    """Type on a terminal: `text` first, then `keys` in order (e.g. text "6*7" and keys
    ["enter"], or keys ["ctrl-c"] to interrupt). Returns the output that appeared."""

    terminal: TerminalName
    text: Annotated[
        str, msgspec.Meta(max_length=terminal_api.MAX_SEND // 4), about("text to type as is")
    ] = ""
    keys: Annotated[
        list[Key], msgspec.Meta(max_length=64), about("named keys to press after the text")
    ] = msgspec.field(default_factory=list)
    wait: Wait = 1.0
    max_chars: MaxChars = DEFAULT_READ


class TerminalReadArgs(Args):
    """Read what a terminal's program printed since the last read, waiting for it if needed."""

    terminal: TerminalName
    wait: Wait = 1.0
    max_chars: MaxChars = DEFAULT_READ


class TerminalStopArgs(Args):
    """Stop a terminal's program (hang up its terminal) and return its exit status."""

    terminal: TerminalName


def screen_text(data: bytes) -> str:
    """Terminal output as plain text: escape sequences and carriage returns removed."""
    text = _ESCAPES.sub(b"", data).replace(b"\r\n", b"\n").replace(b"\r", b"")
    return text.decode("utf-8", "replace")


TERMINAL_TOOLS: Final = ToolSet()
"""The terminal tools, in the order they are offered."""


class _Terminals(dict[str, Terminal]):
    """One toolbox's open terminals by the name the model knows them by."""


def open_terminals(box: Toolbox) -> dict[str, Terminal]:
    """The terminals ``box``'s tools have open, by name."""
    return box.state(_Terminals)


async def _show(box: Toolbox, name: str, term: Terminal, wait: float, max_chars: int) -> str:
    """What appeared on ``term`` (at most ``max_chars``), and its status once it has exited."""
    data = await term.read(timeout=wait, max_bytes=max_chars * 4)
    text = screen_text(data)[:max_chars]
    if term.info.state == "exited":
        # The output ended with the program; the attach call brought its final status.
        open_terminals(box).pop(name, None)
        ended = f"[terminal {name} ended: {_how(term.info)}]"
        return f"{text}\n{ended}" if text else ended
    return text if text else "[no new output]"


def _how(info: terminal_api.TerminalInfo) -> str:
    how = (
        f"killed by signal {info.signal}"
        if info.signal is not None
        else f"exit code {info.exit_code}"
    )
    if info.limit_exceeded is not None:
        how += f"; stopped by its {info.limit_exceeded} limit"
    return how


def _terminal(box: Toolbox, name: str) -> Terminal:
    term = open_terminals(box).get(name)
    if term is None:
        known = ", ".join(sorted(open_terminals(box))) or "none"
        raise ToolFailed(f"no open terminal {name!r} (open: {known})")
    return term


@TERMINAL_TOOLS.tool("terminal_start", TerminalStartArgs)
async def _terminal_start(box: Toolbox, args: TerminalStartArgs, context: CallContext) -> str:
    terminals = open_terminals(box)
    if len(terminals) >= MAX_TERMINALS:
        raise ToolFailed(f"{MAX_TERMINALS} terminals are open; stop one first")
    term = await box.client().open_terminal(
        command=args.command,
        cwd=box.cwd(args.cwd),
        rows=args.rows,
        cols=args.cols,
        limits=box.config.limits,
    )
    name = f"t{term.terminal_id[:6]}"
    terminals[name] = term
    shown = await _show(box, name, term, args.wait, DEFAULT_READ)
    return f"terminal {name} started (pid {term.info.pid})\n{shown}"


@TERMINAL_TOOLS.tool("terminal_send", TerminalSendArgs)
async def _terminal_send(box: Toolbox, args: TerminalSendArgs, context: CallContext) -> str:
    term = _terminal(box, args.terminal)
    data = args.text.encode() + b"".join(KEYS[key] for key in args.keys)
    if data:
        await term.send(data)
    return await _show(box, args.terminal, term, args.wait, args.max_chars)


@TERMINAL_TOOLS.tool("terminal_read", TerminalReadArgs)
async def _terminal_read(box: Toolbox, args: TerminalReadArgs, context: CallContext) -> str:
    term = _terminal(box, args.terminal)
    return await _show(box, args.terminal, term, args.wait, args.max_chars)


@TERMINAL_TOOLS.tool("terminal_stop", TerminalStopArgs)
async def _terminal_stop(box: Toolbox, args: TerminalStopArgs, context: CallContext) -> str:
    term = _terminal(box, args.terminal)
    open_terminals(box).pop(args.terminal, None)
    info = await term.close(grace=2.0)
    return f"terminal {args.terminal} stopped: {_how(info)}"


@TERMINAL_TOOLS.closer
async def close_terminals(box: Toolbox) -> None:
    """Hang up every terminal the toolbox still has open."""
    terminals = open_terminals(box)
    while terminals:
        _, term = terminals.popitem()
        # Closing what is left: the connection may be gone already.
        with contextlib.suppress(Exception):
            await term.close(grace=1.0)
