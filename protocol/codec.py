"""Body <-> message conversion with typed errors, and helpers for Raw payloads.

One reusable :class:`msgspec.msgpack.Encoder` and one Decoder for the message
union serve every connection. Decoding never lets a msgspec exception escape:
bytes that are not msgpack become :class:`~protocol.errors.MalformedMessage`, an unknown tag
:class:`~protocol.errors.UnknownMessageType`, and a bad field
:class:`~protocol.errors.InvalidMessage`.

Nesting (PROTOCOL.md section 3). A message may nest ``MAX_NESTING`` levels;
what holds it to that is not msgspec's recursion (which gives up where the
interpreter's stack runs out, a depth that depends on who called), but the
rules below, each applied where it can be decided exactly and cheaply:

* The messages are Structs that forbid unknown fields, so the fast path
  decodes only messages without any; their known fields nest as little as
  their types (a few levels), and the ``any`` fields (params, result, data)
  are kept raw, unlooked-into. A message with unknown fields is decoded by
  :func:`_decode_lenient`: each unknown field is held to ``MAX_NESTING - 1``
  levels (and all of them together to ``MAX_INSPECTED_ITEMS`` items) by an
  iterative walk (:mod:`protocol.nesting`), then dropped.
* A message msgspec cannot follow (RecursionError) is walked whole by
  :func:`_decode_deep`: a field other than an ``any`` field nested too deeply
  makes it an :class:`~protocol.errors.InvalidMessage`; an ``any`` field is kept raw, deep as
  it is, for whoever interprets it (a call's params are refused by
  :func:`decode_payload`, with the connection alive). A body whose walk runs
  past ``MAX_INSPECTED_ITEMS`` items is decoded once more on an empty stack
  (:func:`_on_fresh_stack`), and only if even that cannot follow it is it an
  :class:`~protocol.errors.InvalidMessage` (it is then surely deeper than the bound).
* :func:`decode_payload` holds a payload to ``MAX_NESTING - 1`` levels:
  what its Struct's decoder skips is walked (``nesting.Shape``), and a value
  msgspec cannot follow where it is called is decoded on an empty stack if
  the walk finds it within the bound.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec

from protocol import nesting
from protocol.errors import InvalidMessage, MalformedMessage, UnknownMessageType
from protocol.limits import MAX_INSPECTED_ITEMS, MAX_NESTING
from protocol.messages import MESSAGE_TYPES, AnyMessage, Message, tag_of

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
_BY_TAG: Final = {tag_of(cls): cls for cls in MESSAGE_TYPES}
#: The encoded names of each message type's fields.
_FIELDS: Final = {cls: frozenset(cls.__struct_encode_fields__) for cls in MESSAGE_TYPES}
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
        return _decode_lenient(body, exc)
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"frame body is not valid msgpack: {exc}") from None
    except RecursionError:
        return _decode_deep(bytes(body))


def _classify(body: bytes | bytearray | memoryview, exc: msgspec.ValidationError) -> Exception:
    try:
        tag = msgspec.msgpack.decode(body, type=_TagOnly).t
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return InvalidMessage(f"frame body is not a tagged message: {exc}")
    if tag not in _BY_TAG:
        return UnknownMessageType(f"unknown message type {tag[:64]!r}")
    return InvalidMessage(f"invalid {tag!r} message: {exc}")


@functools.cache
def _any_fields(kind: type[Message]) -> frozenset[str]:
    """The fields of message type ``kind`` kept raw (``any``: params, result, data)."""
    return frozenset(f.encode_name for f in msgspec.structs.fields(kind) if f.type is msgspec.Raw)


def _message_type(entries: dict[str, msgspec.Raw]) -> type[Message] | None:
    """The message type an encoded body's ``"t"`` names (None: none, or not a string)."""
    tag = entries.get("t")
    if tag is None:
        return None
    try:
        return _BY_TAG.get(msgspec.msgpack.decode(tag, type=str))
    except msgspec.DecodeError:
        return None


def _decode_lenient(body: bytes | bytearray | memoryview, exc: msgspec.ValidationError) -> Message:
    """A body the strict decoder refused: drop its unknown fields if it has any, else refuse it."""
    try:
        entries = nesting.peel(body)
    except RecursionError:
        return _decode_deep(bytes(body))
    except msgspec.DecodeError:
        raise _classify(body, exc) from None
    kind = _message_type(entries)
    if kind is None:
        raise _classify(body, exc)
    known = _FIELDS[kind]
    unknown = [key for key in entries if key not in known and key != "t"]
    if not unknown:
        raise _classify(body, exc)
    budget = nesting.Budget()
    for key in unknown:
        try:
            nesting.check_skipped(entries[key], MAX_NESTING - 1, budget)
        except nesting.TooDeep:
            raise InvalidMessage(f"unknown field {key[:64]!r} {TOO_DEEP}") from None
        except nesting.TooManyItems:
            raise InvalidMessage(
                f"unknown fields holding more than {MAX_INSPECTED_ITEMS} items"
            ) from None
        except nesting.Malformed as bad:
            raise MalformedMessage(f"frame body is not valid msgpack: {bad}") from None
    return decode_message(_without(entries, unknown))


def _without(entries: dict[str, msgspec.Raw], dropped: list[str]) -> bytes:
    """The encoded map of ``entries`` but those named in ``dropped``."""
    kept = [(key, value) for key, value in entries.items() if key not in dropped]
    parts = [nesting.map_header(len(kept))]
    for key, value in kept:
        parts += (ENCODER.encode(key), bytes(value))
    return b"".join(parts)


#: Set on the thread :func:`_on_fresh_stack` starts, while it decodes.
_fresh = threading.local()


def _on_fresh_stack(decode: Callable[[bytes], T], data: bytes) -> T:
    """``decode(data)`` on a new thread's empty stack, where the decoder follows furthest.

    Called only for a value msgspec could not follow where it was called, and
    which may still be within the bound (a caller deep in its own stack).
    """
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        _fresh.active = True
        try:
            outcome.append((True, decode(data)))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="deep-decode")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    result: T = value
    return result


def _decode_deep(body: bytes) -> Message:
    """A body msgspec could not follow: keep deep ``any`` fields raw, refuse other deep fields."""
    try:
        entries = _entries(body)
    except nesting.TooManyItems:
        entries = None
    except nesting.Malformed as exc:
        raise MalformedMessage(f"frame body is not valid msgpack: {exc}") from None
    except ValueError as exc:
        raise InvalidMessage(f"frame body is not a tagged message: {exc}") from None
    deep = [] if entries is None else [e for e in entries if e[3] > MAX_NESTING - 1]
    if not deep:
        # Within the bound, or too long to tell here: msgspec, given a whole stack, decides.
        if not getattr(_fresh, "active", False):
            return _on_fresh_stack(decode_message, body)
        if entries is None:
            raise InvalidMessage(f"message {TOO_DEEP} (more than {MAX_INSPECTED_ITEMS} items)")
        raise InvalidMessage(f"message {TOO_DEEP} for this interpreter's recursion limit")
    assert entries is not None
    kind = _message_type({key: msgspec.Raw(body[start:end]) for key, start, end, _ in entries})
    if kind is None:
        raise InvalidMessage("frame body is not a tagged message")
    for key, _, _, _ in deep:
        if key not in _any_fields(kind):
            raise InvalidMessage(f"field {key[:64]!r} of a {tag_of(kind)!r} message {TOO_DEEP}")
    kept = {key: msgspec.Raw(body[start:end]) for key, start, end, _ in entries}
    raw = {key: kept.pop(key) for key, _, _, _ in deep}
    message = decode_message(_without(kept, []))
    if type(message) is not kind:
        raise InvalidMessage(f"message {TOO_DEEP}")
    return msgspec.structs.replace(message, **raw)


def _entries(body: bytes) -> list[tuple[str, int, int, int]]:
    """The top-level map entries of ``body``: key, value start, value end, value depth.

    Walks at most ``MAX_INSPECTED_ITEMS`` items (:class:`nesting.TooManyItems`);
    ValueError if ``body`` is not one map with string keys.
    """
    budget = nesting.Budget()
    if not body:
        raise nesting.Malformed("empty body")
    first = body[0]
    if 0x80 <= first <= 0x8F:
        count, pos = first & 0x0F, 1
    elif first in (0xDE, 0xDF):
        width = 2 if first == 0xDE else 4
        count, pos = int.from_bytes(body[1 : 1 + width], "big"), 1 + width
    else:
        raise ValueError("not a map")
    entries: list[tuple[str, int, int, int]] = []
    for _ in range(count):
        key_start = pos
        pos, _ = nesting.measure(body, pos, budget)
        try:
            key = msgspec.msgpack.decode(body[key_start:pos], type=str)
        except msgspec.DecodeError:
            raise ValueError("a key is not a string") from None
        start = pos
        pos, depth = nesting.measure(body, pos, budget)
        entries.append((key, start, pos, depth))
    if pos != len(body):
        raise nesting.Malformed("trailing bytes")
    return entries


def decode_payload(
    decoder: msgspec.msgpack.Decoder[T], raw: msgspec.Raw | bytes, levels: int = MAX_NESTING - 1
) -> T:
    """Decode a Raw payload with ``decoder``, holding it to ``levels`` of nesting.

    Every failure is a ``msgspec.DecodeError`` (a ValidationError for a bad
    value, a :class:`NestingTooDeep` for one nested deeper than ``levels``),
    so one ``except`` covers them all. The default, ``MAX_NESTING - 1``, is a
    call's params' (PROTOCOL.md section 3). For a Struct type (a method's
    params) what its decoder skips is held to the bound, within
    ``MAX_INSPECTED_ITEMS`` items in all (its own fields nest no deeper than
    their types); a value of any other type is walked whole, and refused if
    it holds more items than that and is longer than ``levels`` bytes.
    """
    try:
        value = decoder.decode(raw)
        if len(raw) > levels:  # n bytes nest at most n levels: else nothing to look for
            _hold(decoder.type, raw, levels)
        return value
    except RecursionError:
        return _decode_beyond_stack(decoder, bytes(raw), levels)


def _decode_held(decoder: msgspec.msgpack.Decoder[T], raw: msgspec.Raw | bytes, levels: int) -> T:
    """``decoder.decode(raw)``, held to ``levels`` of nesting (see decode_payload)."""
    value = decoder.decode(raw)
    _hold(decoder.type, raw, levels)
    return value


def _hold(kind: Any, raw: msgspec.Raw | bytes, levels: int) -> None:
    """Refuse ``raw``, decoded as ``kind``, if it nests deeper than ``levels`` (decode_payload)."""
    shape = _shape(kind)
    try:
        if shape is not None:
            shape.check(raw, levels, nesting.Budget())
        else:
            nesting.check_skipped(raw, levels, nesting.Budget())
    except nesting.TooDeep:
        raise NestingTooDeep(f"value {TOO_DEEP}") from None
    except nesting.TooManyItems:
        what = "fields the method does not know" if shape is not None else "a value"
        raise NestingTooDeep(
            f"{what} hold more than {MAX_INSPECTED_ITEMS} items to look into for their depth"
        ) from None


def _shape(kind: Any) -> nesting.Shape | None:
    """The shape of payload type ``kind`` (None: not a Struct), kept once made."""
    try:
        shape = _shapes.get(kind, _UNKNOWN)
    except TypeError:  # an unhashable type (an Annotated with unhashable metadata)
        return nesting.Shape.of(kind)
    if shape is _UNKNOWN:
        shape = nesting.Shape.of(kind)
        if len(_shapes) < _MAX_DECODERS:
            _shapes[kind] = shape
    return shape if isinstance(shape, nesting.Shape) else None


def _decode_beyond_stack(decoder: msgspec.msgpack.Decoder[T], raw: bytes, levels: int) -> T:
    """A payload msgspec could not follow here: too deep, or decoded on an empty stack."""
    try:
        depth = nesting.depth_of(raw, nesting.Budget())
    except nesting.TooManyItems:
        depth = None
    except nesting.Malformed as exc:
        raise msgspec.DecodeError(f"invalid msgpack: {exc}") from None
    if (depth is not None and depth > levels) or getattr(_fresh, "active", False):
        raise NestingTooDeep(f"value {TOO_DEEP}")
    try:
        return _on_fresh_stack(functools.partial(_decode_held, decoder, levels=levels), raw)
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
#: The shapes of the payload types :func:`decode_payload` decoded (None: not a Struct).
_shapes: dict[Any, nesting.Shape | None] = {}
_UNKNOWN: Final = object()
