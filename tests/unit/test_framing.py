"""Framing and message codec: header layout, caps from the header alone, typed decode errors."""

from __future__ import annotations

import struct
import threading

import msgspec
import pytest

from protocol import limits
from protocol.codec import ENCODER, decode_message, encode_message, from_raw, to_raw
from protocol.errors import (
    FrameTooLarge,
    InvalidMessage,
    LocalProtocolError,
    MalformedMessage,
    ProtocolError,
    UnknownMessageType,
)
from protocol.framing import (
    SPLICE_MIN,
    FrameReader,
    SplicedFrame,
    encode_chunk,
    encode_frame,
    frame_header,
)
from protocol.messages import (
    EMPTY_MAP,
    MESSAGE_TYPES,
    NIL,
    Abort,
    Call,
    Chunk,
    Error,
    Ping,
    Reply,
    tag_of,
)

pack = msgspec.msgpack.encode


def _frames(reader: FrameReader) -> list[bytes | bytearray]:
    out: list[bytes | bytearray] = []
    while (body := reader.next_frame()) is not None:
        out.append(body)
    return out


# -- header and encode_frame ----------------------------------------------------


def test_frame_header_is_big_endian_u32() -> None:
    assert frame_header(0) == b"\x00\x00\x00\x00"
    assert frame_header(1) == b"\x00\x00\x00\x01"
    assert frame_header(0x01020304) == b"\x01\x02\x03\x04"
    assert frame_header(limits.MAX_HEADER_VALUE) == b"\xff\xff\xff\xff"


def test_encode_frame_is_header_plus_msgpack_body() -> None:
    message = Ping(seq=7)
    frame = encode_frame(ENCODER, message, limits.MIN_MAX_FRAME)
    body = encode_message(message)
    assert bytes(frame) == struct.pack(">I", len(body)) + body
    assert body == pack({"t": "ping", "seq": 7})


def test_encode_frame_refuses_bodies_over_the_peer_cap() -> None:
    message = Chunk(id=1, stream="s", seq=0, data=b"x" * 5000)
    with pytest.raises(LocalProtocolError, match="exceeds the peer's cap"):
        encode_frame(ENCODER, message, limits.MIN_MAX_FRAME)
    body_len = len(encode_message(message))
    assert len(encode_frame(ENCODER, message, body_len)) == body_len + limits.HEADER_SIZE
    with pytest.raises(LocalProtocolError):
        encode_frame(ENCODER, message, body_len - 1)


def test_default_fields_are_omitted_on_the_wire() -> None:
    assert msgspec.msgpack.decode(encode_message(Reply(id=3))) == {"t": "reply", "id": 3}
    assert msgspec.msgpack.decode(encode_message(Call(id=1, method="m"))) == {
        "t": "call",
        "id": 1,
        "method": "m",
    }
    chunk = msgspec.msgpack.decode(encode_message(Chunk(id=1, stream="s", seq=0)))
    assert chunk == {"t": "chunk", "id": 1, "stream": "s", "seq": 0}


@pytest.mark.parametrize("size", [SPLICE_MIN, SPLICE_MIN + 1, 3 * SPLICE_MIN + 17, 1 << 20])
@pytest.mark.parametrize("end", [False, True])
@pytest.mark.parametrize("view", [False, True])
def test_a_spliced_chunk_frame_is_byte_for_byte_the_encoded_one(
    size: int, end: bool, view: bool
) -> None:
    """The fast path and the ordinary one agree: same bytes, same cap check."""
    content = bytes(range(256)) * (size // 256 + 2)
    data: bytes = memoryview(content)[3 : 3 + size] if view else content[:size]  # type: ignore[assignment]
    chunk = Chunk(id=2**40 + 5, stream="data", seq=12345, data=data, end=end)
    spliced = encode_chunk(ENCODER, chunk, limits.DEFAULT_MAX_FRAME, None, True)
    assert isinstance(spliced, SplicedFrame)
    assert spliced.parts[1] is data  # written as it is, never copied
    ordinary = encode_frame(ENCODER, chunk, limits.DEFAULT_MAX_FRAME)
    assert bytes(spliced) == bytes(ordinary) and len(spliced) == len(ordinary)
    reader = FrameReader(limits.DEFAULT_MAX_FRAME)
    reader.feed(bytes(spliced))
    assert decode_message(reader.next_frame() or b"") == Chunk(
        id=chunk.id, stream="data", seq=12345, data=bytes(data), end=end
    )
    body = len(ordinary) - limits.HEADER_SIZE
    assert len(encode_chunk(ENCODER, chunk, body, None, True)) == len(ordinary)
    with pytest.raises(LocalProtocolError, match="exceeds the peer's cap"):
        encode_chunk(ENCODER, chunk, body - 1, None, True)
    with pytest.raises(LocalProtocolError, match="exceeds the peer's cap"):
        encode_frame(ENCODER, chunk, body - 1)


def test_chunks_are_spliced_only_when_large_immutable_plaintext_and_allowed() -> None:
    big = b"z" * SPLICE_MIN

    def framed(data: bytes, *, splice: bool = True, sealed: bool = False) -> object:
        chunk = Chunk(id=1, stream="s", seq=0, data=data)
        seal = (lambda header, body: body + b"\0" * limits.AEAD_TAG_SIZE) if sealed else None
        return encode_chunk(ENCODER, chunk, limits.DEFAULT_MAX_FRAME, seal, splice)

    assert isinstance(framed(big), SplicedFrame)
    assert not isinstance(framed(big, splice=False), SplicedFrame)
    assert not isinstance(framed(big, sealed=True), SplicedFrame)
    assert not isinstance(framed(big[:-1]), SplicedFrame)
    # Data that may change after the call (a bytearray or a view of one) is copied.
    assert not isinstance(framed(bytearray(big)), SplicedFrame)  # type: ignore[arg-type]
    assert not isinstance(framed(memoryview(bytearray(big))), SplicedFrame)  # type: ignore[arg-type]


# -- FrameReader -------------------------------------------------------------------


def test_reader_waits_for_a_complete_header_and_body() -> None:
    frame = bytes(encode_frame(ENCODER, Ping(seq=1), 1024))
    reader = FrameReader(1024)
    for i, byte in enumerate(frame[:-1]):
        reader.feed(bytes([byte]))
        assert reader.next_frame() is None
        assert reader.buffered == i + 1
    reader.feed(frame[-1:])
    assert reader.next_frame() == frame[4:]
    assert reader.next_frame() is None
    assert reader.buffered == 0


def test_reader_splits_many_frames_from_one_feed() -> None:
    messages = [Ping(seq=i) for i in range(50)]
    stream = b"".join(bytes(encode_frame(ENCODER, m, 1024)) for m in messages)
    reader = FrameReader(1024)
    reader.feed(stream)
    assert [decode_message(b) for b in _frames(reader)] == messages


def test_reader_rejects_an_oversized_header_before_any_body_arrives() -> None:
    reader = FrameReader(limits.PREAUTH_MAX_FRAME)
    reader.feed(frame_header(limits.PREAUTH_MAX_FRAME + 1))
    with pytest.raises(FrameTooLarge) as info:
        reader.next_frame()
    assert info.value.code.name == "FRAME_TOO_LARGE"


def test_reader_accepts_a_body_of_exactly_the_cap() -> None:
    reader = FrameReader(100)
    reader.feed(frame_header(100) + b"\x00" * 100)
    assert reader.next_frame() == b"\x00" * 100


def test_reader_cap_can_change_between_two_frames_of_one_feed() -> None:
    small = frame_header(10) + b"a" * 10
    large = frame_header(5000) + b"b" * 5000
    reader = FrameReader(limits.PREAUTH_MAX_FRAME)
    reader.feed(small + large)
    assert reader.next_frame() == b"a" * 10
    reader.max_frame = limits.DEFAULT_MAX_FRAME
    assert reader.next_frame() == b"b" * 5000


def test_reader_with_a_lower_cap_rejects_the_pending_frame() -> None:
    reader = FrameReader(10_000)
    reader.feed(frame_header(5000) + b"b" * 100)
    assert reader.next_frame() is None
    reader.max_frame = 4096
    with pytest.raises(FrameTooLarge):
        reader.next_frame()


def test_reader_compaction_keeps_every_byte() -> None:
    payloads = [bytes([i % 256]) * (i * 37 % 3000) for i in range(400)]
    stream = b"".join(frame_header(len(p)) + p for p in payloads)
    reader = FrameReader(4096)
    got: list[bytes | bytearray] = []
    step = 997
    for start in range(0, len(stream), step):
        reader.feed(stream[start : start + step])
        got.extend(_frames(reader))
        assert reader.buffered <= limits.HEADER_SIZE + 4096
    assert got == payloads
    assert reader.buffered == 0


def test_large_bodies_arrive_whole_across_many_feeds() -> None:
    large = bytes(i % 253 for i in range(300_000))
    small = b"tail"
    stream = frame_header(len(large)) + large + frame_header(len(small)) + small
    cap = 512 * 1024
    reader = FrameReader(cap)
    got: list[bytes | bytearray] = []
    for start in range(0, len(stream), 7001):
        reader.feed(memoryview(stream)[start : start + 7001])
        got.extend(_frames(reader))
        assert reader.buffered <= limits.HEADER_SIZE + cap
    assert got == [large, small]
    assert reader.buffered == 0


def _receive_in_place(reader: FrameReader, data: bytes) -> int:
    """What a transport does: write into get_buffer(), then buffer_updated(); bytes taken."""
    buffer = reader.get_buffer()
    take = min(len(buffer), len(data))
    buffer[:take] = data[:take]
    reader.buffer_updated(take)
    return take


def test_readers_of_one_thread_share_one_scratch_area_and_keep_their_bytes_apart() -> None:
    """Idle connections cost no receive buffer each; interleaved receives stay separate."""
    payloads = {
        name: [bytes([seed + i]) * (i * 101 % 5000) for i in range(60)]
        for name, seed in (("a", 1), ("b", 100))
    }
    streams = {n: b"".join(frame_header(len(p)) + p for p in ps) for n, ps in payloads.items()}
    readers = {name: FrameReader(8192) for name in payloads}
    assert readers["a"].get_buffer().obj is readers["b"].get_buffer().obj
    offsets = dict.fromkeys(payloads, 0)
    got: dict[str, list[bytes | bytearray]] = {name: [] for name in payloads}
    step = 1, 3000, 777, 9000
    turn = 0
    while any(offsets[n] < len(streams[n]) for n in payloads):
        for name, reader in readers.items():
            chunk = streams[name][offsets[name] : offsets[name] + step[turn % len(step)]]
            if chunk:
                offsets[name] += _receive_in_place(reader, chunk)
                got[name].extend(_frames(reader))
            turn += 1
    assert got == payloads


def test_frames_taken_from_the_scratch_area_are_those_fed_bytes_give() -> None:
    """Receiving in place (frames taken straight out of the scratch area) agrees with feed."""
    payloads = [bytes([i % 256]) * (i * 211 % 9000) for i in range(120)]
    stream = b"".join(frame_header(len(p)) + p for p in payloads)
    fed, in_place = FrameReader(16384), FrameReader(16384)
    fed_got: list[bytes | bytearray] = []
    got: list[bytes | bytearray] = []
    offset = 0
    steps = 5, 70_000, 3, 4096, 12_345, 1
    turn = 0
    while offset < len(stream):
        chunk = stream[offset : offset + steps[turn % len(steps)]]
        taken = _receive_in_place(in_place, chunk)
        fed.feed(chunk[:taken])
        offset += taken
        # Every other read, take one frame only: the rest waits in the reader.
        if turn % 2:
            first = in_place.next_frame()
            if first is not None:
                got.append(first)
        else:
            got.extend(_frames(in_place))
        fed_got.extend(_frames(fed))
        assert in_place.buffered + sum(map(len, got)) + 4 * len(got) == offset
        turn += 1
    got.extend(_frames(in_place))
    assert got == fed_got == payloads
    assert in_place.buffered == 0


def test_a_header_over_the_cap_in_the_scratch_area_is_refused() -> None:
    reader = FrameReader(100)
    _receive_in_place(reader, frame_header(5) + b"12345" + frame_header(101) + b"x")
    assert reader.next_frame() == b"12345"
    with pytest.raises(FrameTooLarge):
        reader.next_frame()


def test_each_thread_has_its_own_scratch_area() -> None:
    seen: list[object] = []
    thread = threading.Thread(target=lambda: seen.append(FrameReader(64).get_buffer().obj))
    thread.start()
    thread.join()
    assert seen and seen[0] is not FrameReader(64).get_buffer().obj


def test_large_body_cap_is_still_checked_from_the_header() -> None:
    reader = FrameReader(100_000)
    reader.feed(frame_header(100_001) + b"x" * 10)
    with pytest.raises(FrameTooLarge):
        reader.next_frame()


def test_zero_length_body_is_a_malformed_message() -> None:
    reader = FrameReader(100)
    reader.feed(frame_header(0))
    body = reader.next_frame()
    assert body == b""
    with pytest.raises(MalformedMessage):
        decode_message(body)


# -- decode classification -----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"\xc1", MalformedMessage),
        (pack({"t": "ping", "seq": 1}) + b"\x00", MalformedMessage),
        (pack({"t": "ping", "seq": 1})[:-1], MalformedMessage),
        (pack([1, 2, 3]), InvalidMessage),
        (pack({"seq": 1}), InvalidMessage),
        (pack({"t": 5, "seq": 1}), InvalidMessage),
        (pack({"t": "no-such-thing", "seq": 1}), UnknownMessageType),
        (pack({"t": "ping"}), InvalidMessage),
        (pack({"t": "ping", "seq": -1}), InvalidMessage),
        (pack({"t": "ping", "seq": 2**63}), InvalidMessage),
        (pack({"t": "ping", "seq": 1.0}), InvalidMessage),
        (pack({"t": "ping", "seq": True}), InvalidMessage),
        (pack({"t": "auth", "mac": "a" * 32}), InvalidMessage),
        (pack({"t": "auth", "mac": b"a" * 31}), InvalidMessage),
        (pack({"t": "credit", "id": 1, "stream": "s", "bytes": 0}), InvalidMessage),
        (pack({"t": "call", "id": 1, "method": ""}), InvalidMessage),
        (pack({"t": "call", "id": 1, "method": "m" * (limits.MAX_NAME + 1)}), InvalidMessage),
        (pack({"t": "error", "id": 1, "code": 1, "message": "x" * 4097}), InvalidMessage),
        (pack({"t": "chunk", "id": 1, "stream": "s", "seq": 0, "data": None}), InvalidMessage),
    ],
)
def test_bad_bodies_raise_the_right_protocol_error(body: bytes, error: type[ProtocolError]) -> None:
    with pytest.raises(error) as info:
        decode_message(body)
    assert type(info.value) is error
    assert info.value.code == error.code


def test_unknown_fields_are_ignored_and_the_tag_may_come_last() -> None:
    body = pack({"seq": 9, "future": {"nested": [1, 2, b"x"]}, "t": "ping"})
    assert decode_message(body) == Ping(seq=9)


def test_any_integer_width_is_accepted() -> None:
    as_uint64 = bytes.fromhex("82a174a470696e67a3736571cf0000000000000001")
    as_int64 = bytes.fromhex("82a174a470696e67a3736571d30000000000000001")
    assert decode_message(as_uint64) == Ping(seq=1)
    assert decode_message(as_int64) == Ping(seq=1)


def test_every_message_type_has_a_distinct_tag() -> None:
    tags = [tag_of(cls) for cls in MESSAGE_TYPES]
    assert len(set(tags)) == len(tags)
    assert set(tags) == {
        "hello",
        "challenge",
        "auth",
        "welcome",
        "call",
        "reply",
        "error",
        "chunk",
        "cancel",
        "credit",
        "event",
        "ping",
        "pong",
        "abort",
    }


def test_raw_payload_defaults_and_helpers() -> None:
    assert bytes(EMPTY_MAP) == pack({})
    assert bytes(NIL) == pack(None)
    call = decode_message(pack({"t": "call", "id": 1, "method": "m"}))
    assert isinstance(call, Call)
    assert from_raw(call.params, dict) == {}
    raw = to_raw({"path": "/x", "n": [1, 2]})
    decoded = decode_message(encode_message(Call(id=2, method="m", params=raw)))
    assert isinstance(decoded, Call)
    assert from_raw(decoded.params, dict) == {"path": "/x", "n": [1, 2]}
    error = decode_message(encode_message(Error(id=2, code=101, data=to_raw({"k": 1}))))
    assert isinstance(error, Error)
    assert from_raw(error.data, dict) == {"k": 1}


def test_abort_roundtrip_keeps_unknown_codes() -> None:
    frame = encode_frame(ENCODER, Abort(code=4242, message="bye"), 1024)
    reader = FrameReader(1024)
    reader.feed(frame)
    body = reader.next_frame()
    assert body is not None
    assert decode_message(body) == Abort(code=4242, message="bye")
