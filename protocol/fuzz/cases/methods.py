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

from protocol.fuzz import script as s
from protocol.fuzz.cases import Case, Facts, Group, alive, bin_, call, expect, post, pre
from protocol.fuzz.schema import refused_params
from protocol.fuzz.script import to_json_value
from protocol.rpc import all_rpcs


def _refuses(method: str, params: Any) -> s.Script:
    return post(
        s.Send(body=call(1, method, params)), expect(s.ErrorWant(id=1, codes=[101])), alive()
    )


_WHAT = {
    "not-a-map": ("params not a map", "whose params are the array [1]"),
    "missing": ("required params missing", "with empty params"),
    "type": ("{field} of the wrong type", "whose {field} is of another type"),
    "bounds": ("{field} out of bounds", "whose {field} is just outside its declared bounds"),
}


def _method_cases(g: Group) -> None:
    for rpc in all_rpcs():
        for name, params in refused_params(rpc):
            kind, _, field = ("not-a-map", "", "") if name == "not-a-map" else name.partition("-")
            title, sends = (text.format(field=field) for text in _WHAT[kind])
            g.add(
                "15.1",
                f"{rpc.name}: {title}",
                f"a {rpc.name} Call {sends}",
                "Error INVALID_PARAMS (101), the connection lives",
                _refuses(rpc.name, to_json_value(params)),
                methods=(rpc.name,),
                name=f"{rpc.name}/{name}",
            )


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
