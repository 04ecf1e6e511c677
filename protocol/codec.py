"""Body <-> message conversion with typed errors, and helpers for Raw payloads.

One reusable :class:`msgspec.msgpack.Encoder` and one Decoder for the message
union serve every connection. Decoding never lets a msgspec exception escape:
bytes that are not msgpack become :class:`MalformedMessage`, an unknown tag
:class:`UnknownMessageType`, and a bad field :class:`InvalidMessage`.
"""

from __future__ import annotations

from typing import Any, Final, TypeVar

import msgspec

from protocol.errors import InvalidMessage, MalformedMessage, UnknownMessageType
from protocol.messages import MESSAGE_TYPES, AnyMessage, Message, tag_of

T = TypeVar("T")

ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(AnyMessage)
_KNOWN_TAGS: Final = frozenset(tag_of(cls) for cls in MESSAGE_TYPES)


class _TagOnly(msgspec.Struct, forbid_unknown_fields=False):
    t: str


def decode_message(body: bytes | bytearray | memoryview) -> Message:
    """Decode one frame body into its message; raise a typed RemoteProtocolError otherwise."""
    try:
        message: Message = _DECODER.decode(body)
        return message
    except msgspec.ValidationError as exc:
        raise _classify(body, exc) from None
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"frame body is not valid msgpack: {exc}") from None


def _classify(body: bytes | bytearray | memoryview, exc: msgspec.ValidationError) -> Exception:
    try:
        tag = msgspec.msgpack.decode(body, type=_TagOnly).t
    except (msgspec.ValidationError, msgspec.DecodeError):
        return InvalidMessage(f"frame body is not a tagged message: {exc}")
    if tag not in _KNOWN_TAGS:
        return UnknownMessageType(f"unknown message type {tag[:64]!r}")
    return InvalidMessage(f"invalid {tag!r} message: {exc}")


def encode_message(message: Message) -> bytes:
    """Encode a message body without a frame header (tests, transcripts)."""
    return ENCODER.encode(message)


def to_raw(value: Any) -> msgspec.Raw:
    """Pre-encode a params/result/data value for a Call, Reply, Error or Event."""
    return msgspec.Raw(ENCODER.encode(value))


def from_raw(raw: msgspec.Raw | bytes, type: type[T]) -> T:
    """Decode a Raw payload into ``type``; msgspec errors propagate to the caller.

    The caller decides what a bad payload means (INVALID_PARAMS on the server,
    a malformed reply on the client).
    """
    return msgspec.msgpack.decode(raw, type=type)
