"""Cases of section 15 (RPC methods), derived from the declarations, and 16 (test vectors).

For every method declared in :mod:`protocol.rpc` the catalogue sends params
that can never be run: not a map, a required field missing, a field of the
wrong type, a field out of its bounds. Each must fail with INVALID_PARAMS
(101) while the connection lives. These cases are named, not numbered
(``15.files.read/missing``), so that a new method adds cases without moving
any other.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.fuzz import script as s
from protocol.fuzz.cases import Case, Facts, Group, alive, bin_, call, expect, post, pre
from protocol.rpc import Rpc, all_rpcs

#: Values tried, in order, as a field's wrong type: the first its type refuses is used.
_WRONG: tuple[Any, ...] = ({"zz": 1}, [[1]], "x", 12345, True)


def _fields(rpc: Rpc[Any, Any]) -> list[msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(rpc.params)
    return list(info.fields) if isinstance(info, msgspec.inspect.StructType) else []


def _refused(value: Any, field_type: msgspec.inspect.Type) -> bool:
    return isinstance(field_type, msgspec.inspect.AnyType) is False and _rejects(value, field_type)


def _rejects(value: Any, field_type: msgspec.inspect.Type) -> bool:
    if isinstance(field_type, msgspec.inspect.UnionType):
        return all(_rejects(value, t) for t in field_type.types)
    kinds: dict[type[msgspec.inspect.Type], tuple[type, ...]] = {
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
    accepted = kinds.get(type(field_type))
    if accepted is None:
        return False  # a type this derivation does not know: not a safe wrong value
    if isinstance(value, bool) and bool not in accepted:
        return True
    return not isinstance(value, accepted)


def _out_of_bounds(field_type: msgspec.inspect.Type) -> Any:
    """A value of the field's own type just outside its declared bounds, or None."""
    types = field_type.types if isinstance(field_type, msgspec.inspect.UnionType) else (field_type,)
    for t in types:
        if isinstance(t, msgspec.inspect.IntType):
            if t.le is not None:
                return t.le + 1
            if t.ge is not None:
                return t.ge - 1
        if isinstance(t, msgspec.inspect.FloatType):
            if t.le is not None:
                return t.le * 2 + 1.0
            if t.ge is not None:
                return t.ge - 1.0
        if isinstance(t, msgspec.inspect.StrType):
            if t.max_length is not None and t.max_length <= 1 << 16:
                return "x" * (t.max_length + 1)
            if t.min_length:
                return ""
            if t.pattern is not None:
                return " /bad name/ "
        if isinstance(t, msgspec.inspect.BytesType):
            if t.max_length is not None and t.max_length <= 1 << 16:
                return bin_(bytes(t.max_length + 1))
            if t.min_length:
                return bin_(b"")
        if isinstance(t, msgspec.inspect.LiteralType):
            return "not-one-of-them"
    return None


def _refuses(method: str, params: Any) -> s.Script:
    return post(
        s.Send(body=call(1, method, params)), expect(s.ErrorWant(id=1, codes=[101])), alive()
    )


def _method_cases(g: Group) -> None:
    for rpc in all_rpcs():
        fields = _fields(rpc)
        methods = (rpc.name,)
        g.add(
            "15.1",
            f"{rpc.name}: params not a map",
            f"a {rpc.name} Call whose params are the array [1]",
            "Error INVALID_PARAMS (101), the connection lives",
            _refuses(rpc.name, [1]),
            methods=methods,
            name=f"{rpc.name}/not-a-map",
        )
        required = [f for f in fields if f.required]
        if required:
            g.add(
                "15.1",
                f"{rpc.name}: required params missing",
                f"a {rpc.name} Call with empty params (it requires "
                f"{', '.join(f.encode_name for f in required)})",
                "Error INVALID_PARAMS (101), the connection lives",
                _refuses(rpc.name, {}),
                methods=methods,
                name=f"{rpc.name}/missing",
            )
        for field in fields:
            wrong = next((v for v in _WRONG if _refused(v, field.type)), None)
            if wrong is None:
                continue
            g.add(
                "15.1",
                f"{rpc.name}: {field.encode_name} of the wrong type",
                f"a {rpc.name} Call whose {field.encode_name} is {wrong!r}",
                "Error INVALID_PARAMS (101), the connection lives",
                _refuses(rpc.name, {field.encode_name: wrong}),
                methods=methods,
                name=f"{rpc.name}/type-{field.encode_name}",
            )
            break
        for field in fields:
            bad = _out_of_bounds(field.type)
            if bad is None:
                continue
            g.add(
                "15.1",
                f"{rpc.name}: {field.encode_name} out of bounds",
                f"a {rpc.name} Call whose {field.encode_name} is just outside its bounds",
                "Error INVALID_PARAMS (101), the connection lives",
                _refuses(rpc.name, {field.encode_name: bad}),
                methods=methods,
                name=f"{rpc.name}/bounds-{field.encode_name}",
            )
            break


def _section15() -> Group:
    g = Group(15)
    g.add(
        "15.1",
        "unknown params keys are ignored",
        'a server.echo Call with data and an extra key "zz"',
        "a Reply with the data",
        post(
            s.Send(body=call(1, "server.echo", {"data": bin_(b"echo"), "zz": [1, {"a": None}]})),
            expect(s.ReplyWant(id=1, result=bin_(b"echo"), check_result=True)),
        ),
        methods=("server.echo",),
    )
    g.add(
        "15.2",
        "server.info",
        "a server.info Call",
        "a Reply that decodes as ServerInfo (checked for every reply of a declared method)",
        post(s.Send(body=call(1, "server.info")), expect(s.ReplyWant(id=1))),
        methods=("server.info",),
    )
    g.add(
        "15.2",
        "server.echo returns bin",
        "a server.echo Call of 1000 bytes",
        "a Reply whose result is those bytes as a msgpack bin",
        post(
            s.Send(body=call(1, "server.echo", {"data": {"$fill": 1000}})),
            expect(s.ReplyWant(id=1, result={"$fill": 1000}, check_result=True)),
        ),
        methods=("server.echo",),
    )
    _method_cases(g)
    return g


def _section16() -> Group:
    g = Group(16)
    g.add(
        "16",
        "the section 16 Hello",
        "the Hello frame of section 16's first test vector, byte for byte",
        "a Challenge choosing one of its ciphers",
        _vector_hello,
    )
    g.add(
        "16.1",
        "the section 16.1 call with a request id",
        "the body of section 16.1's server.noop Call (id 7, request id a0..af)",
        "a Reply (the same nil result on every run: a second run attaches)",
        _vector_call,
        methods=("server.noop",),
    )
    return g


def _vector_hello(_: Facts) -> s.Script:
    from protocol.vectors import all_vectors

    return pre(s.SendBytes(hex=all_vectors()[0].hello_frame.hex()), expect(s.ChallengeWant()))


def _vector_call(_: Facts) -> s.Script:
    from protocol.codec import encode_message
    from protocol.vectors import message_vectors

    body = encode_message(message_vectors()[0][1])
    return post(s.SendBody(hex=body.hex()), expect(s.ReplyWant(id=7)))


def cases() -> list[Case]:
    """The cases of sections 15 and 16."""
    return _section15().cases + _section16().cases
