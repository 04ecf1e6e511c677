"""What the declared params of each method refuse: values of the wrong type, or out of bounds.

Read from the params Structs of :mod:`protocol.rpc` through
:mod:`msgspec.inspect`, so the catalogue's section 15 cases and the
hypothesis strategies of invalid params follow every declaration as it is.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from protocol.rpc import Rpc

#: Values tried, in order, as a field's wrong type: the first its type refuses is used.
WRONG_VALUES: Final[tuple[Any, ...]] = ({"zz": 1}, [[1]], "x", 12345, True)

_ACCEPTS: Final[dict[type[msgspec.inspect.Type], tuple[type, ...]]] = {
    msgspec.inspect.StrType: (str,),
    msgspec.inspect.IntType: (int,),
    msgspec.inspect.FloatType: (int, float),
    msgspec.inspect.BoolType: (bool,),
    msgspec.inspect.BytesType: (),
    msgspec.inspect.NoneType: (),
    msgspec.inspect.ListType: (list,),
    msgspec.inspect.DictType: (dict,),
    msgspec.inspect.StructType: (dict,),
    msgspec.inspect.LiteralType: (),
}


def params_fields(rpc: Rpc[Any, Any]) -> list[msgspec.inspect.Field]:
    """The fields of a method's params Struct (none for a type that is not a Struct)."""
    info = msgspec.inspect.type_info(rpc.params)
    return list(info.fields) if isinstance(info, msgspec.inspect.StructType) else []


def rejects(value: Any, field_type: msgspec.inspect.Type) -> bool:
    """Whether ``field_type`` certainly refuses ``value`` (a plain JSON-like value)."""
    if isinstance(field_type, msgspec.inspect.UnionType):
        return all(rejects(value, t) for t in field_type.types)
    accepted = _ACCEPTS.get(type(field_type))
    if accepted is None:
        return False  # a type this module does not know (Any, Raw...): never certain
    if isinstance(value, bool) and bool not in accepted:
        return True
    return not isinstance(value, accepted)


def wrong_value(field_type: msgspec.inspect.Type) -> Any:
    """A value ``field_type`` refuses for its type, or None when there is none sure."""
    return next((v for v in WRONG_VALUES if rejects(v, field_type)), None)


def out_of_bounds(field_type: msgspec.inspect.Type) -> Any:
    """A value of the field's own kind just outside its declared bounds, or None.

    Binary values come back as ``bytes``.
    """
    types = field_type.types if isinstance(field_type, msgspec.inspect.UnionType) else (field_type,)
    for t in types:
        if isinstance(t, msgspec.inspect.IntType):
            if t.le is not None:
                return t.le + 1
            if t.ge is not None:
                return t.ge - 1
        elif isinstance(t, msgspec.inspect.FloatType):
            if t.le is not None:
                return t.le * 2 + 1.0
            if t.ge is not None:
                return t.ge - 1.0
        elif isinstance(t, msgspec.inspect.StrType):
            if t.max_length is not None and t.max_length <= 1 << 16:
                return "x" * (t.max_length + 1)
            if t.min_length:
                return ""
            if t.pattern is not None:
                return " /bad name/ "
        elif isinstance(t, msgspec.inspect.BytesType):
            if t.max_length is not None and t.max_length <= 1 << 16:
                return bytes(t.max_length + 1)
            if t.min_length:
                return b""
        elif isinstance(t, msgspec.inspect.LiteralType):
            return "not-one-of-them"
    return None


def refused_params(rpc: Rpc[Any, Any]) -> list[tuple[str, Any]]:
    """Params every server must refuse for ``rpc``, each with a name for what is wrong.

    Params not a map; empty params when a field is required; the first field
    that has a sure wrong type, given that; the first field with declared
    bounds, given a value just outside them.
    """
    fields = params_fields(rpc)
    found: list[tuple[str, Any]] = [("not-a-map", [1])]
    if any(f.required for f in fields):
        found.append(("missing", {}))
    for field in fields:
        wrong = wrong_value(field.type)
        if wrong is not None:
            found.append((f"type-{field.encode_name}", {field.encode_name: wrong}))
            break
    for field in fields:
        bad = out_of_bounds(field.type)
        if bad is not None:
            found.append((f"bounds-{field.encode_name}", {field.encode_name: bad}))
            break
    return found
