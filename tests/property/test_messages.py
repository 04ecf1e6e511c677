"""Every message type round-trips; unknown fields are ignored, unknown tags and bad fields fatal."""

from __future__ import annotations

import struct
import typing
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from protocol import limits
from protocol.codec import ENCODER, decode_message, encode_message
from protocol.errors import InvalidMessage, UnknownMessageType
from protocol.framing import FrameReader, encode_frame
from protocol.fuzz.strategies import (
    MESSAGE_STRATEGIES,
    all_message_subclasses,
    msgpack_values,
    property_settings,
)
from protocol.messages import MESSAGE_TYPES, AnyMessage, Message, tag_of

TYPE_IDS = [tag_of(cls) for cls in MESSAGE_TYPES]
PROPERTY_SETTINGS = property_settings(40)
#: Lighter: these tests are parametrized over all fourteen message types.
PER_TYPE_SETTINGS = property_settings(25)


def test_every_message_type_has_a_strategy() -> None:
    assert set(MESSAGE_STRATEGIES) == set(MESSAGE_TYPES)
    assert set(MESSAGE_STRATEGIES) == all_message_subclasses()
    assert set(MESSAGE_STRATEGIES) == set(typing.get_args(AnyMessage))


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=TYPE_IDS)
@PER_TYPE_SETTINGS
@given(data=st.data())
def test_roundtrip_encode_frame_read_decode(cls: type[Message], data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[cls])
    assert type(message) is cls
    body = encode_message(message)
    assert msgspec.msgpack.decode(body)["t"] == tag_of(cls)
    assert decode_message(body) == message
    frame = encode_frame(ENCODER, message, limits.MAX_MAX_FRAME)
    assert bytes(frame) == struct.pack(">I", len(body)) + body
    reader = FrameReader(limits.MAX_MAX_FRAME)
    reader.feed(frame)
    got = reader.next_frame()
    assert got is not None and reader.next_frame() is None and reader.buffered == 0
    assert decode_message(got) == message


def _map_header(count: int) -> bytes:
    if count < 16:
        return bytes([0x80 | count])
    return b"\xde" + struct.pack(">H", count)


def _with_extra_entries(body: bytes, extra: dict[str, Any]) -> bytes:
    """``body`` (one msgpack map) with more entries appended, its own bytes untouched."""
    count = len(msgspec.msgpack.decode(body))
    first = body[0]
    assert 0x80 <= first <= 0x8F, "messages encode as small maps"
    tail = b"".join(
        msgspec.msgpack.encode(key) + msgspec.msgpack.encode(value) for key, value in extra.items()
    )
    return _map_header(count + len(extra)) + body[1:] + tail


@PROPERTY_SETTINGS
@given(
    data=st.data(),
    extra=st.dictionaries(st.text(min_size=1, max_size=10), msgpack_values, min_size=1, max_size=5),
)
def test_unknown_fields_are_ignored(data: st.DataObject, extra: dict[str, Any]) -> None:
    cls = data.draw(st.sampled_from(MESSAGE_TYPES))
    message = data.draw(MESSAGE_STRATEGIES[cls])
    known = {"t", *(f.encode_name for f in msgspec.structs.fields(cls))}
    extra = {k: v for k, v in extra.items() if k not in known}
    assume(extra)
    assert decode_message(_with_extra_entries(encode_message(message), extra)) == message


@PROPERTY_SETTINGS
@given(data=st.data(), tag=st.text(max_size=20))
def test_unknown_tags_are_fatal(data: st.DataObject, tag: str) -> None:
    assume(tag not in TYPE_IDS)
    message = data.draw(st.one_of(*MESSAGE_STRATEGIES.values()))
    fields = msgspec.msgpack.decode(encode_message(message))
    fields["t"] = tag
    with pytest.raises(UnknownMessageType):
        decode_message(msgspec.msgpack.encode(fields))


def _typed_fields(cls: type[Message]) -> list[msgspec.structs.FieldInfo]:
    return [f for f in msgspec.structs.fields(cls) if f.type is not msgspec.Raw]


_WRONG_VALUES: dict[str, Any] = {
    "int": "1",
    "str": 1,
    "bytes": "not bytes",
    "bool": 0,
    "list": {"a": 1},
    "dict": [1],
}


def _wrong_value_for(field: msgspec.structs.FieldInfo) -> Any:
    for kind, value in _WRONG_VALUES.items():
        if kind in str(field.type):
            return value
    raise AssertionError(f"no wrong value known for {field.type}")


@PROPERTY_SETTINGS
@given(data=st.data())
def test_mistyped_or_missing_fields_are_invalid(data: st.DataObject) -> None:
    cls = data.draw(st.sampled_from(MESSAGE_TYPES))
    message = data.draw(MESSAGE_STRATEGIES[cls])
    field = data.draw(st.sampled_from(_typed_fields(cls)))
    fields = msgspec.msgpack.decode(encode_message(message))
    fields[field.encode_name] = _wrong_value_for(field)
    with pytest.raises(InvalidMessage):
        decode_message(msgspec.msgpack.encode(fields))
    required = [f for f in msgspec.structs.fields(cls) if f.required]
    if required:
        del fields[data.draw(st.sampled_from(required)).encode_name]
        with pytest.raises(InvalidMessage):
            decode_message(msgspec.msgpack.encode(fields))
