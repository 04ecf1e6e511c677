"""A deliberately broken execd: the real daemon with protocol bugs planted, for the fuzz kit's tests.

``python -m tests.support.broken_execd --bugs NAME,NAME ... [execd's options]`` runs
execd after replacing parts of its protocol machine with faulty ones:

``frame-off-by-one``
    the frame reader accepts a frame one byte over its cap;
``no-credit-check``
    a chunk beyond its stream's credit is taken instead of refused;
``replayed-nonce``
    the server nonce is derived from the client's, so a recorded Auth verifies again;
``crash-on-unknown-type``
    a message of an unknown type kills the whole process;
``leak-fd-per-aborted-handshake``
    every handshake that ends in a protocol error leaves a descriptor open.

With no bugs it is execd as it is, and the kit must pass it.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from typing import Final

from protocol import connection
from protocol.connection import Connection, ConnectionEvent, ServerConnection
from protocol.errors import RemoteProtocolError, UnknownMessageType
from protocol.framing import FrameReader
from protocol.messages import Chunk, Hello, Message
from protocol.states import State

_LEAKED: list[int] = []


class _OffByOneReader(FrameReader):
    """Checks the cap as ``length > cap + 1``."""

    __slots__ = ("_cap",)

    @property
    def max_frame(self) -> int:
        return self._cap + 1

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        self._cap = value


def _frame_off_by_one() -> None:
    setattr(connection, "FrameReader", _OffByOneReader)  # noqa: B010 (planting the bug)


def _no_credit_check() -> None:
    original = ServerConnection._receivers[Chunk]

    def take(self: Connection, chunk: Chunk, events: list[ConnectionEvent]) -> None:
        books = self._calls.get(chunk.id)
        stream = books.get(chunk.stream) if books is not None else None
        if stream is not None:
            stream.in_left = max(stream.in_left, len(chunk.data))
        window, self.window = self.window, 1 << 62  # a new stream starts without a bound
        try:
            original(self, chunk, events)
        finally:
            self.window = window

    ServerConnection._receivers[Chunk] = take


def _replayed_nonce() -> None:
    original = ServerConnection._handshake

    def handshake(self: ServerConnection, message: Message, events: list[ConnectionEvent]) -> None:
        if isinstance(message, Hello):
            self._nonce = hashlib.sha256(b"not fresh" + message.nonce).digest()
        original(self, message, events)

    ServerConnection._handshake = handshake  # type: ignore[method-assign]


def _crash_on_unknown_type() -> None:
    original: Callable[[bytes | bytearray | memoryview], Message] = vars(connection)[
        "decode_message"
    ]

    def decode(body: bytes | bytearray | memoryview) -> Message:
        try:
            return original(body)
        except UnknownMessageType:
            os._exit(70)

    setattr(connection, "decode_message", decode)  # noqa: B010 (planting the bug)


def _leak_fd_per_aborted_handshake() -> None:
    original = Connection._fail

    def fail(self: Connection, exc: RemoteProtocolError) -> None:
        if self.state is State.HANDSHAKE:
            _LEAKED.append(os.open(os.devnull, os.O_RDONLY))
        original(self, exc)

    Connection._fail = fail  # type: ignore[method-assign]


BUGS: Final[dict[str, Callable[[], None]]] = {
    "frame-off-by-one": _frame_off_by_one,
    "no-credit-check": _no_credit_check,
    "replayed-nonce": _replayed_nonce,
    "crash-on-unknown-type": _crash_on_unknown_type,
    "leak-fd-per-aborted-handshake": _leak_fd_per_aborted_handshake,
}


def main(argv: list[str]) -> int:
    """Plant the bugs named by ``--bugs``, then run execd with the other arguments."""
    bugs: list[str] = []
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--bugs":
            bugs = [b for b in next(args, "").split(",") if b]
        else:
            rest.append(arg)
    for bug in bugs:
        BUGS[bug]()
    from execd.__main__ import main as execd_main

    status: int = execd_main(rest)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
