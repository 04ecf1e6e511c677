"""How deeply a msgpack value nests, found without recursion, and the values it is held for.

The *depth* of a msgpack value (PROTOCOL.md section 3) is 0 for anything but
an array or a map, and one more than its deepest item (keys and values alike)
for an array or a map, so 1 for an empty one. A received message may nest
:data:`~protocol.limits.MAX_NESTING` levels: its body map is level one.

msgspec's decoder recurses as it nests and gives up near the interpreter's
recursion limit, which depends on the stack it was called from, so it is not
what holds a message to the bound. Everything here walks a value iteratively
(:func:`measure`), in steps bounded by a :class:`Budget` of items, so that a
huge hostile value costs a bounded amount of work:

* :func:`check_skipped` holds a value that the decoder skips (an unknown
  field) to a depth, within the budget of items;
* :class:`Shape` finds the keys a Struct's decoder skips in an encoded
  value of it (at every Struct level, through unions of tagged Structs)
  and holds each to the depth its place allows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import msgspec
import msgspec.inspect as mi

from protocol import limits

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

#: An encoded map decoded one level deep: its keys, each value kept encoded.
_PEEL: Final = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


class Malformed(ValueError):
    """The bytes are not one complete, valid msgpack value."""


class TooDeep(ValueError):
    """A value nests deeper than allowed."""


class TooManyItems(ValueError):
    """The budget of items to look at ran out before the value's end."""


class Budget:
    """How many more msgpack items a walk may look at."""

    __slots__ = ("left",)

    def __init__(self, items: int = limits.MAX_INSPECTED_ITEMS) -> None:
        self.left = items


def measure(
    buf: bytes | memoryview, pos: int, budget: Budget, limit: int | None = None
) -> tuple[int, int]:
    """End offset and depth of the msgpack value at ``pos``, without recursion.

    Raises :class:`Malformed` for a truncated or invalid value,
    :class:`TooManyItems` when ``budget`` runs out, and :class:`TooDeep` as
    soon as the value nests deeper than ``limit`` (when given).
    """
    size = len(buf)
    open_items: list[int] = []  # items still expected by each open container
    depth = 0
    while True:
        budget.left -= 1
        if budget.left < 0:
            raise TooManyItems(f"more than {limits.MAX_INSPECTED_ITEMS} items")
        if pos >= size:
            raise Malformed("truncated value")
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
            raise Malformed(f"invalid byte 0x{byte:02x}")
        if limit is not None and depth > limit:
            raise TooDeep(f"nested deeper than {limit} levels")
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
                raise Malformed("truncated value")
            return pos, depth


def depth_of(value: bytes | memoryview, budget: Budget) -> int:
    """The depth of ``value``, one complete msgpack value (see :func:`measure`)."""
    end, depth = measure(value, 0, budget)
    if end != len(value):
        raise Malformed("trailing bytes")
    return depth


def check_skipped(value: bytes | msgspec.Raw, levels: int, budget: Budget) -> None:
    """Hold a value that the decoder skips to ``levels`` of nesting, within ``budget``.

    A value of ``n`` bytes nests at most ``n`` levels: one no longer than
    ``levels`` costs nothing. Raises :class:`TooDeep` or :class:`TooManyItems`.
    """
    if len(value) > levels:
        measure(memoryview(value), 0, budget, levels)


def map_header(count: int) -> bytes:
    """The msgpack header of a map of ``count`` entries."""
    if count < 16:
        return bytes((0x80 | count,))
    if count < 1 << 16:
        return b"\xde" + count.to_bytes(2, "big")
    return b"\xdf" + count.to_bytes(4, "big")


def peel(value: bytes | bytearray | memoryview | msgspec.Raw) -> dict[str, msgspec.Raw]:
    """An encoded map with string keys, one level deep: each value stays encoded.

    Raises ``msgspec.DecodeError`` when ``value`` is not such a map, and
    RecursionError when the decoder cannot follow one of its values.
    """
    return _PEEL.decode(value)


class Shape:
    """Where the decoder of a Struct type skips keys of an encoded value of it.

    ``known``: the keys it decodes (the tag field's too); ``nested``: for a
    field that may hold Structs (alone, or in a union of Structs told apart
    by their tag), the shape of each, by tag (``None`` for an untagged one).
    Keys inside lists or dicts of Structs are not looked into: no declared
    params type has such a field (a test holds them to that).
    """

    __slots__ = ("known", "nested", "tag_field")

    def __init__(self, info: mi.StructType) -> None:
        self.tag_field = info.tag_field
        self.known = frozenset(f.encode_name for f in info.fields) | (
            {info.tag_field} if info.tag_field else set()
        )
        self.nested: dict[str, dict[Any, Shape]] = {}
        for f in info.fields:
            variants = {s.tag: Shape(s) for s in _structs_in(f.type)}
            if variants:
                self.nested[f.encode_name] = variants

    @staticmethod
    def of(kind: Any) -> Shape | None:
        """The shape of Struct type ``kind`` (None for anything but a Struct type)."""
        info = mi.type_info(kind)
        return Shape(info) if isinstance(info, mi.StructType) else None

    def check(self, value: bytes | msgspec.Raw, levels: int, budget: Budget) -> None:
        """Hold every key the decoder skips in ``value`` (an encoded value of this Struct).

        ``value`` may nest ``levels`` levels, so a key it skips ``levels - 1``;
        a value no longer than ``levels`` bytes cannot nest deeper. Raises
        :class:`TooDeep` or :class:`TooManyItems`; anything but a map is left
        to the decoder, which refused it already.
        """
        if len(value) <= levels:
            return
        try:
            entries = _PEEL.decode(value)
        except msgspec.DecodeError:
            return
        for key, item in entries.items():
            if key not in self.known:
                check_skipped(item, levels - 1, budget)
            elif key in self.nested:
                shape = self._variant(self.nested[key], item)
                if shape is not None:
                    shape.check(item, levels - 1, budget)

    @staticmethod
    def _variant(variants: dict[Any, Shape], value: msgspec.Raw) -> Shape | None:
        """The shape of the Struct that ``value`` is decoded as, of ``variants`` by tag."""
        if len(variants) == 1:
            return next(iter(variants.values()))
        some = next(iter(variants.values()))
        try:
            tag = peel(value).get(some.tag_field or "")
            chosen = msgspec.msgpack.decode(tag) if tag is not None else None
        except (msgspec.DecodeError, TypeError):
            return None
        try:
            return variants.get(chosen)
        except TypeError:  # an unhashable tag: the decoder refused it already
            return None


def _structs_in(kind: mi.Type) -> Iterator[mi.StructType]:
    """The Struct types a field of type ``kind`` holds directly (alone or in a union)."""
    if isinstance(kind, mi.StructType):
        yield kind
    elif isinstance(kind, mi.UnionType):
        for member in kind.types:
            yield from _structs_in(member)
    elif isinstance(kind, mi.Metadata):
        yield from _structs_in(kind.type)
