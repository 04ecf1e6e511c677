"""Test vectors of the terminal and resource-limit messages, computed from fixed values.

``python -m protocol.api_vectors`` prints the block PROTOCOL.md holds in
section 15.10; ``tests/unit/test_api_vectors.py`` checks the spec's copy
against this computation and decodes every body back into its message.
Computing them performs no I/O; only :func:`main` writes (to stdout).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from protocol import limits
from protocol.codec import ENCODER, to_raw
from protocol.framing import encode_frame
from protocol.messages import Call, Chunk, Message, Reply
from protocol.rpc import shell, terminal
from protocol.rpc.resources import Limits

_INFO = terminal.TerminalInfo(
    terminal_id="0011223344556677",
    pid=4242,
    tty="/dev/pts/3",
    title="python3 -i",
    state="running",
    rows=24,
    cols=80,
)

_OPEN = terminal.OpenParams(argv=["python3", "-i"], limits=Limits(cpu=60.0))
_SEND = terminal.SendParams(terminal_id=_INFO.terminal_id, data=b"6*7\r")
_RESIZE = terminal.ResizeParams(terminal_id=_INFO.terminal_id, rows=40, cols=132)
_RUN = shell.RunParams(
    argv=["make"], limits=Limits(memory=256 << 20, processes=64, file_size=64 << 20)
)
_RESULT = shell.RunResult(
    pid=4243,
    signal=9,
    duration=0.5,
    limit_exceeded="memory",
    limits={"memory": "cgroup-v1", "processes": "cgroup-v1", "file_size": "rlimit"},
)

#: (label, message, the params or result value it carries, or None) of every vector.
CASES: list[tuple[str, Message, Any]] = [
    ("terminal.open call", Call(id=7, method=terminal.OPEN.name, params=to_raw(_OPEN)), _OPEN),
    ("terminal.open reply", Reply(id=7, result=to_raw(_INFO)), _INFO),
    ("terminal.send call", Call(id=8, method=terminal.SEND.name, params=to_raw(_SEND)), _SEND),
    (
        "terminal.resize call",
        Call(id=9, method=terminal.RESIZE.name, params=to_raw(_RESIZE)),
        _RESIZE,
    ),
    (
        "terminal.attach output chunk",
        Chunk(id=10, stream=terminal.OUTPUT_STREAM, seq=0, data=b"42\r\n>>> "),
        None,
    ),
    ("shell.run call with limits", Call(id=11, method=shell.RUN.name, params=to_raw(_RUN)), _RUN),
    ("shell.run reply, limit exceeded", Reply(id=11, result=to_raw(_RESULT)), _RESULT),
]


def frame_of(message: Message) -> bytes:
    """The message as one frame (header and msgpack body)."""
    return bytes(encode_frame(ENCODER, message, limits.DEFAULT_MAX_FRAME))


def render() -> str:
    """The spec's block: one labelled frame per case, in hex, 64 digits a line."""
    out = ["```text"]
    for label, message, _ in CASES:
        text = frame_of(message).hex()
        out.append(f"{label}:")
        out.extend("    " + text[i : i + 64] for i in range(0, len(text), 64))
    out.append("```")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the block for PROTOCOL.md."""
    del argv
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
