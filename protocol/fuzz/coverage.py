"""Coverage-guided fuzzing of the sans-I/O decoders with atheris (needs the ``atheris`` extra).

``python -m protocol.fuzz.coverage TARGET [libFuzzer options]``, TARGET one of:

``frames``
    :class:`~protocol.framing.FrameReader` fed arbitrary bytes in arbitrary pieces;
``messages``
    :func:`~protocol.codec.decode_message` of an arbitrary body;
``handshake``
    a :class:`~protocol.connection.ServerConnection` and a
    :class:`~protocol.connection.ClientConnection` fed arbitrary bytes.

Each target is a hypothesis test (so its inputs come from the strategies of
:mod:`protocol.fuzz.strategies`, and a failure shrinks and replays like any
hypothesis failure); atheris drives it through ``fuzz_one_input`` with the
protocol package's code instrumented for coverage. The property every target
checks: nothing but a :class:`~protocol.errors.RemoteProtocolError` escapes,
and a reader never holds more than a header and one capped body.
libFuzzer's options pass through, e.g. ``-runs=100000`` or ``-max_total_time=60``.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable
from typing import Any, Final

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import limits
from protocol.codec import decode_message
from protocol.connection import ClientConnection, ServerConnection, State
from protocol.errors import RemoteProtocolError
from protocol.framing import FrameReader
from protocol.fuzz import strategies as fz
from protocol.messages import Message

_TOKEN: Final = b"coverage-guided-token-of-32-byte"
_SETTINGS: Final = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
_pieces = st.lists(st.integers(0, 1 << 16), max_size=8)
_inputs = st.one_of(st.binary(max_size=4096), fz.frame_streams(max_size=4))


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@_SETTINGS
@given(data=_inputs, cuts=_pieces, cap=st.sampled_from([0, 16, limits.PREAUTH_MAX_FRAME]))
def frames(data: bytes, cuts: list[int], cap: int) -> None:
    """Frames from any bytes, any pieces: bodies or FrameTooLarge, the buffer bounded."""
    reader = FrameReader(cap)
    try:
        for piece in _split(data, cuts):
            reader.feed(piece)
            while reader.next_frame() is not None:
                pass
            assert reader.buffered <= limits.HEADER_SIZE + cap
    except RemoteProtocolError:
        pass


@_SETTINGS
@given(body=st.one_of(st.binary(max_size=2048), fz.any_message.map(lambda m: _encode(m))))
def messages(body: bytes) -> None:
    """A body decodes to a message or raises a RemoteProtocolError, nothing else."""
    with contextlib.suppress(RemoteProtocolError):
        assert isinstance(decode_message(body), Message)


@_SETTINGS
@given(data=_inputs, cuts=_pieces, client=st.booleans())
def handshake(data: bytes, cuts: list[int], client: bool) -> None:
    """A connection machine fed any bytes raises only RemoteProtocolError and ends CLOSED then."""
    conn: ClientConnection | ServerConnection = (
        ClientConnection(_TOKEN) if client else ServerConnection(_TOKEN, max_frame=1 << 16)
    )
    for piece in _split(data, cuts):
        try:
            conn.receive_data(piece)
        except RemoteProtocolError:
            assert conn.state is State.CLOSED
            return
        conn.data_to_send()
        cap = limits.PREAUTH_MAX_FRAME if conn.state is State.HANDSHAKE else conn.max_frame
        assert conn.buffered <= limits.HEADER_SIZE + cap


def _encode(message: Message) -> bytes:
    from protocol.codec import encode_message

    return encode_message(message)


TARGETS: Final[dict[str, Callable[..., None]]] = {
    "frames": frames,
    "messages": messages,
    "handshake": handshake,
}


def _instrument_protocol(atheris: Any) -> None:
    """Instrument the functions of the protocol package only (all code would take minutes)."""
    import inspect

    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not (name == "protocol" or name.startswith("protocol.")) or name.startswith(
            "protocol.fuzz"
        ):
            continue
        for value in vars(module).values():
            members = [value]
            if inspect.isclass(value) and value.__module__ == name:
                members = [m for m in vars(value).values() if inspect.isfunction(m)]
            for member in members:
                if (
                    inspect.isfunction(member)
                    and member.__module__ == name
                    and id(member) not in seen
                ):
                    seen.add(id(member))
                    atheris.instrument_func(member)


def main(argv: list[str]) -> int:
    """Run one target under atheris; the remaining arguments go to libFuzzer."""
    if not argv or argv[0] not in TARGETS:
        print(
            f"usage: python -m protocol.fuzz.coverage {{{','.join(TARGETS)}}} [libFuzzer options]"
        )
        return 2
    try:
        import atheris
    except ImportError:
        print(
            "protocol.fuzz.coverage needs atheris: pip install 'splitexec[atheris]'",
            file=sys.stderr,
        )
        return 2
    target: Any = TARGETS[argv[0]]
    _instrument_protocol(atheris)
    atheris.Setup([sys.argv[0], *argv[1:]], target.hypothesis.fuzz_one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
