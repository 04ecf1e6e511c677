"""Framing under any chunking, and arbitrary input: messages or RemoteProtocolError, nothing else."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import limits
from protocol.codec import ENCODER, decode_message
from protocol.connection import ClientConnection, ServerConnection, State
from protocol.errors import RemoteProtocolError
from protocol.framing import FrameReader, encode_frame
from protocol.fuzz.strategies import any_message, property_settings, session_messages
from protocol.messages import Call, Chunk, Message, Ping

TOKEN = b"\x07" * 32
CAP = 64 * 1024
PROPERTY_SETTINGS = property_settings(40)


def encode_stream(messages: list[Message]) -> bytes:
    return b"".join(bytes(encode_frame(ENCODER, m, limits.MAX_MAX_FRAME)) for m in messages)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def read_all(pieces: list[bytes], cap: int) -> list[Message]:
    """Messages of ``pieces`` fed one by one; the buffer never exceeds header + cap."""
    reader = FrameReader(cap)
    out: list[Message] = []
    for piece in pieces:
        reader.feed(piece)
        while (body := reader.next_frame()) is not None:
            out.append(decode_message(body))
        assert reader.buffered <= limits.HEADER_SIZE + cap
    assert reader.buffered == 0
    return out


@PROPERTY_SETTINGS
@given(
    messages=st.lists(any_message, max_size=12), cuts=st.lists(st.integers(0, 2**20), max_size=30)
)
def test_any_chunking_yields_the_same_messages(messages: list[Message], cuts: list[int]) -> None:
    stream = encode_stream(messages)
    assert read_all(split_at(stream, cuts), limits.MAX_MAX_FRAME) == messages


@PROPERTY_SETTINGS
@given(messages=st.lists(any_message, min_size=1, max_size=4))
def test_one_byte_at_a_time(messages: list[Message]) -> None:
    stream = encode_stream(messages)
    pieces = [stream[i : i + 1] for i in range(len(stream))]
    assert read_all(pieces, limits.MAX_MAX_FRAME) == messages


@PROPERTY_SETTINGS
@given(
    size=st.integers(64 * 1024, 300 * 1024),
    before=st.lists(any_message, max_size=3),
    cuts=st.lists(st.integers(0, 2**20), max_size=12),
)
def test_large_frames_survive_any_chunking(
    size: int, before: list[Message], cuts: list[int]
) -> None:
    big = Chunk(id=1, stream="data", seq=0, data=bytes(i % 251 for i in range(size)))
    messages = [*before, big, Ping(seq=1)]
    assert read_all(split_at(encode_stream(messages), cuts), 512 * 1024) == messages


def feed_reader(pieces: list[bytes], cap: int) -> None:
    """Push pieces through a reader and the decoder; only RemoteProtocolError may escape."""
    reader = FrameReader(cap)
    try:
        for piece in pieces:
            reader.feed(piece)
            while (body := reader.next_frame()) is not None:
                assert isinstance(decode_message(body), Message)
            assert reader.buffered <= limits.HEADER_SIZE + cap
    except RemoteProtocolError:
        pass


@PROPERTY_SETTINGS
@given(
    data=st.binary(max_size=3000),
    cuts=st.lists(st.integers(0, 4000), max_size=10),
    cap=st.sampled_from([0, 1, 16, limits.PREAUTH_MAX_FRAME]),
)
def test_arbitrary_bytes_give_messages_or_protocol_errors(
    data: bytes, cuts: list[int], cap: int
) -> None:
    feed_reader(split_at(data, cuts), cap)


@PROPERTY_SETTINGS
@given(
    messages=st.lists(any_message, min_size=1, max_size=5),
    flips=st.lists(st.tuples(st.integers(0, 2**20), st.integers(1, 255)), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 2**20), max_size=6),
)
def test_corrupted_valid_streams_give_messages_or_protocol_errors(
    messages: list[Message], flips: list[tuple[int, int]], cuts: list[int]
) -> None:
    stream = bytearray(encode_stream(messages))
    for position, mask in flips:
        stream[position % len(stream)] ^= mask
    feed_reader(split_at(bytes(stream), cuts), limits.PREAUTH_MAX_FRAME)


def feed_connection(conn: ClientConnection | ServerConnection, pieces: list[bytes]) -> None:
    """Feed pieces; only RemoteProtocolError may escape, and buffering stays bounded."""
    for piece in pieces:
        try:
            conn.receive_data(piece)
        except RemoteProtocolError:
            assert conn.state is State.CLOSED
            return
        conn.data_to_send()
        if conn.state is State.CLOSED:
            return
        cap = limits.PREAUTH_MAX_FRAME if conn.state is State.HANDSHAKE else conn.max_frame
        assert conn.buffered <= limits.HEADER_SIZE + cap


@PROPERTY_SETTINGS
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 4000), max_size=10))
def test_server_fed_arbitrary_bytes_raises_only_protocol_errors(
    data: bytes, cuts: list[int]
) -> None:
    feed_connection(ServerConnection(TOKEN, max_frame=CAP), split_at(data, cuts))


@PROPERTY_SETTINGS
@given(
    messages=st.lists(any_message, min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 2**20), max_size=8),
)
def test_server_fed_arbitrary_messages_raises_only_protocol_errors(
    messages: list[Message], cuts: list[int]
) -> None:
    feed_connection(ServerConnection(TOKEN, max_frame=CAP), split_at(encode_stream(messages), cuts))


def open_plain_pair() -> tuple[ClientConnection, ServerConnection]:
    client = ClientConnection(TOKEN, max_frame=CAP, window=limits.MIN_STREAM_WINDOW)
    server = ServerConnection(TOKEN, max_frame=CAP, window=limits.MIN_STREAM_WINDOW, max_inflight=4)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    assert client.state is State.OPEN and server.state is State.OPEN
    return client, server


@pytest.mark.parametrize("side", ["server", "client"])
@PROPERTY_SETTINGS
@given(
    messages=st.lists(session_messages, min_size=1, max_size=10),
    cuts=st.lists(st.integers(0, 2**20), max_size=8),
)
def test_an_open_side_fed_arbitrary_messages_raises_only_protocol_errors(
    side: str, messages: list[Message], cuts: list[int]
) -> None:
    client, server = open_plain_pair()
    if side == "client":
        # Calls in flight, so that replies, chunks and events can name one.
        for _ in range(3):
            server.receive_data(client.send(Call(id=client.next_call_id(), method="m")))
    fed = server if side == "server" else client
    feed_connection(fed, split_at(encode_stream(messages), cuts))


@PROPERTY_SETTINGS
@given(
    data=st.binary(max_size=2000),
    cipher=st.sampled_from([limits.CIPHER_AESGCM, limits.CIPHER_CHACHA20]),
)
def test_sealed_server_fed_arbitrary_bytes_raises_only_protocol_errors(
    data: bytes, cipher: str
) -> None:
    client = ClientConnection(TOKEN, ciphers=(cipher,), max_frame=CAP)
    server = ServerConnection(TOKEN, max_frame=CAP)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    assert server.state is State.OPEN
    feed_connection(server, [data])
