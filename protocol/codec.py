"""Body <-> message conversion with typed errors, and helpers for Raw payloads.

One reusable :class:`msgspec.msgpack.Encoder` and one Decoder for the message
union serve every connection. Decoding never lets a msgspec exception escape:
bytes that are not msgpack become :class:`~protocol.errors.MalformedMessage`, an unknown tag
:class:`~protocol.errors.UnknownMessageType`, and a bad field
:class:`~protocol.errors.InvalidMessage`.

Nesting. The decoder recurses into nested arrays and maps (also when it skips
an unknown field or captures an ``any`` field as Raw) and gives up with a
RecursionError near the interpreter's recursion limit (a few hundred levels
below 1000). That is caught here, off the hot path: a message nested too
deeply is an :class:`~protocol.errors.InvalidMessage`, except a Call whose only deep part is
its params. That Call is decoded with the params kept raw, so the call itself
can be answered: :func:`decode_payload` then refuses the params with
:class:`NestingTooDeep`, a ``msgspec.ValidationError`` (INVALID_PARAMS for the
server). Finding the deep field takes an iterative walk over the body
(:func:`_walk`), bounded in steps so that a huge hostile frame cannot pin the
CPU.
"""

from __future__ import annotations

from typing import Any, Final, TypeVar

import msgspec

from protocol.errors import InvalidMessage, MalformedMessage, UnknownMessageType
from protocol.messages import MESSAGE_TYPES, AnyMessage, Call, Message, tag_of

T = TypeVar("T")

ENCODER: Final = msgspec.msgpack.Encoder()


class _FirstDecode:
    """Stands in for the message decoder until the first frame: then builds it and steps aside.

    Building it resolves every message type's fields, a few milliseconds that
    execd's cold start would pay before it could listen.
    """

    def decode(self, body: bytes | bytearray | memoryview) -> Message:
        global _DECODER
        _DECODER = msgspec.msgpack.Decoder(AnyMessage)
        message: Message = _DECODER.decode(body)
        return message


_DECODER: msgspec.msgpack.Decoder[AnyMessage] | _FirstDecode = _FirstDecode()
_KNOWN_TAGS: Final = frozenset(tag_of(cls) for cls in MESSAGE_TYPES)
#: Most msgpack items :func:`_walk` looks at in one body before giving up on it.
WALK_BUDGET: Final = 1 << 16
#: Nesting that certainly did not make the decoder give up.
_SHALLOW: Final = 64
TOO_DEEP: Final = "nested too deeply"


class _TagOnly(msgspec.Struct, forbid_unknown_fields=False):
    t: str


class NestingTooDeep(msgspec.ValidationError):
    """A payload nests arrays and maps deeper than the decoder can follow."""


def decode_message(body: bytes | bytearray | memoryview) -> Message:
    """Decode one frame body into its message; raise a typed RemoteProtocolError otherwise."""
    try:
        message: Message = _DECODER.decode(body)
        return message
    except msgspec.ValidationError as exc:
        raise _classify(body, exc) from None
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"frame body is not valid msgpack: {exc}") from None
    except RecursionError:
        return _decode_deep(bytes(body))


def _classify(body: bytes | bytearray | memoryview, exc: msgspec.ValidationError) -> Exception:
    try:
        tag = msgspec.msgpack.decode(body, type=_TagOnly).t
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return InvalidMessage(f"frame body is not a tagged message: {exc}")
    if tag not in _KNOWN_TAGS:
        return UnknownMessageType(f"unknown message type {tag[:64]!r}")
    return InvalidMessage(f"invalid {tag!r} message: {exc}")


def decode_payload(decoder: msgspec.msgpack.Decoder[T], raw: msgspec.Raw | bytes) -> T:
    """Decode a Raw payload with ``decoder``; too deep a payload is a ValidationError.

    Every failure is a ``msgspec.DecodeError`` (a ValidationError for a bad or
    too deeply nested value), so one ``except`` covers them all.
    """
    try:
        return decoder.decode(raw)
    except RecursionError:
        raise NestingTooDeep(f"value {TOO_DEEP}") from None


def encode_message(message: Message) -> bytes:
    """Encode a message body without a frame header (tests, transcripts)."""
    return ENCODER.encode(message)


def to_raw(value: Any) -> msgspec.Raw:
    """Pre-encode a params/result/data value for a Call, Reply, Error or Event."""
    return msgspec.Raw(ENCODER.encode(value))


def from_raw(raw: msgspec.Raw | bytes, type: type[T]) -> T:
    """Decode a Raw payload into ``type``; msgspec errors propagate to the caller.

    The caller decides what a bad payload means (INVALID_PARAMS on the server,
    a malformed reply on the client). A payload nested too deeply raises
    :class:`NestingTooDeep`, a ``msgspec.ValidationError`` like any other.
    Each type's decoder is made once (up to :data:`_MAX_DECODERS` types).
    """
    try:
        decoder = _decoders.get(type)
    except TypeError:  # an unhashable type (an Annotated with unhashable metadata)
        decoder = msgspec.msgpack.Decoder(type)
    if decoder is None:
        decoder = msgspec.msgpack.Decoder(type)
        if len(_decoders) < _MAX_DECODERS:
            _decoders[type] = decoder
    try:
        value: T = decoder.decode(raw)
    except RecursionError:
        raise NestingTooDeep(f"value {TOO_DEEP}") from None
    return value


#: Result types whose decoders :func:`from_raw` keeps (the declared RPCs' are far fewer).
_MAX_DECODERS: Final = 512
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


# -- locating the deep part of a body ----------------------------------------------------

# Bytes that follow a header byte, for the fixed-size kinds: nil, bool, floats, ints, fixext.
_FIXED: Final = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8,
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
    0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,
}  # fmt: skip
# Kinds with a length field: byte width of the length, and bytes after it (ext type).
_SIZED: Final = {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),
    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),
}  # fmt: skip
# Containers with a count field: byte width of the count, and items per count.
_COUNTED: Final = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


class _Budget:
    __slots__ = ("left",)

    def __init__(self, steps: int) -> None:
        self.left = steps


def _walk(buf: bytes, pos: int, budget: _Budget) -> tuple[int, int]:
    """End offset and nesting depth of the msgpack value at ``pos``, without recursion.

    Raises ValueError for a truncated or invalid value, or when ``budget``
    runs out.
    """
    size = len(buf)
    open_items: list[int] = []  # items still expected by each open container
    depth = 0
    while True:
        budget.left -= 1
        if budget.left < 0:
            raise ValueError("too many items to inspect")
        if pos >= size:
            raise ValueError("truncated value")
        byte = buf[pos]
        pos += 1
        items = 0
        if byte <= 0x7F or byte >= 0xE0:
            pass
        elif byte <= 0x8F:
            items = 2 * (byte & 0x0F)
            depth = max(depth, len(open_items) + 1)
        elif byte <= 0x9F:
            items = byte & 0x0F
            depth = max(depth, len(open_items) + 1)
        elif byte <= 0xBF:
            pos += byte & 0x1F
        elif byte in _FIXED:
            pos += _FIXED[byte]
        elif byte in _SIZED:
            width, extra = _SIZED[byte]
            pos += width + extra + int.from_bytes(buf[pos : pos + width], "big")
        elif byte in _COUNTED:
            width, per = _COUNTED[byte]
            items = per * int.from_bytes(buf[pos : pos + width], "big")
            pos += width
            depth = max(depth, len(open_items) + 1)
        else:
            raise ValueError(f"invalid byte 0x{byte:02x}")
        if items:
            open_items.append(items)
            continue
        # One item is complete: close every container it completes.
        while open_items:
            open_items[-1] -= 1
            if open_items[-1]:
                break
            open_items.pop()
        if not open_items:
            if pos > size:
                raise ValueError("truncated value")
            return pos, depth


def _fields(body: bytes) -> dict[str, tuple[int, int, int, int]]:
    """Top-level map entries: key -> (entry start, value start, value end, value depth)."""
    budget = _Budget(WALK_BUDGET)
    if not body:
        raise ValueError("empty body")
    first = body[0]
    if 0x80 <= first <= 0x8F:
        count, pos = first & 0x0F, 1
    elif first in (0xDE, 0xDF):
        width = 2 if first == 0xDE else 4
        count, pos = int.from_bytes(body[1 : 1 + width], "big"), 1 + width
    else:
        raise ValueError("not a map")
    fields: dict[str, tuple[int, int, int, int]] = {}
    for _ in range(count):
        key_start = pos
        key_end, _ = _walk(body, pos, budget)
        try:
            key = msgspec.msgpack.decode(body[key_start:key_end], type=str)
        except msgspec.DecodeError:
            raise ValueError("a key is not a string") from None
        end, depth = _walk(body, key_end, budget)
        fields[key] = (key_start, key_end, end, depth)
        pos = end
    if pos != len(body):
        raise ValueError("trailing bytes")
    return fields


def _map_header(count: int) -> bytes:
    if count < 16:
        return bytes((0x80 | count,))
    if count < 1 << 16:
        return b"\xde" + count.to_bytes(2, "big")
    return b"\xdf" + count.to_bytes(4, "big")


def _decode_deep(body: bytes) -> Message:
    """The decoder gave up on ``body``'s nesting: a Call with deep params, or invalid."""
    try:
        fields = _fields(body)
    except ValueError as exc:
        raise InvalidMessage(f"message {TOO_DEEP} ({exc})") from None
    deep = [key for key, (_, _, _, depth) in fields.items() if depth >= _SHALLOW]
    if deep != ["params"]:
        raise InvalidMessage(f"message {TOO_DEEP}")
    rest = [entry for key, entry in fields.items() if key != "params"]
    shallow = _map_header(len(rest)) + b"".join(body[start:end] for start, _, end, _ in rest)
    message = decode_message(shallow)
    if type(message) is not Call:
        raise InvalidMessage(f"message {TOO_DEEP}")
    _, start, end, _ = fields["params"]
    return msgspec.structs.replace(message, params=msgspec.Raw(body[start:end]))
