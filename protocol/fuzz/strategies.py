"""Hypothesis strategies for every layer of the protocol (needs the ``fuzz`` extra).

Stable API (names here are kept; new ones may be added):

Values and messages
    :data:`msgpack_values` (any msgpack value), :data:`raw_payloads`;
    :func:`messages` (``messages(Call)``: valid Calls within every declared
    bound), :data:`MESSAGE_STRATEGIES` (class -> strategy), :data:`any_message`,
    :data:`session_messages` (colliding ids and stream names, to reach the
    books of an open connection).
Frames and bytes
    :func:`frames` (a body with its header), :func:`frame_streams` (messages
    as one byte string), :func:`mutations` (byte-level mutations of some
    bytes: flips, insertions, deletions, cuts, boundary lengths in headers).
Handshakes
    :func:`hellos` (valid Hellos), :func:`invalid_hellos` (a Hello body and the
    Abort code the spec requires for it).
RPC params, derived from the declarations in :mod:`protocol.rpc`
    :func:`params_for` (params of a method, valid by its schema),
    :func:`invalid_params_for` (params it must refuse with INVALID_PARAMS),
    :func:`calls` (Calls of any declared method, valid or refused params),
    :func:`from_type` (a strategy for any msgspec-declared type).
Settings
    :func:`examples` scales an example count by the active hypothesis
    profile; :func:`register_profiles` registers ``splitexec-nightly`` (50 times
    the examples) and ``splitexec-quick``.

Example::

    from hypothesis import given
    from protocol.fuzz import strategies as fz
    from protocol.codec import decode_message, encode_message

    @given(fz.any_message)
    def test_roundtrip(message):
        assert decode_message(encode_message(message)) == message
"""

from __future__ import annotations

import functools
import struct
from typing import Any, Final

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from protocol import limits
from protocol.codec import to_raw
from protocol.errors import ErrorCode
from protocol.fuzz.schema import params_fields, refused_params
from protocol.messages import (
    Abort,
    Auth,
    Call,
    Cancel,
    Challenge,
    Chunk,
    Credit,
    Error,
    Event,
    Hello,
    Message,
    Ping,
    Pong,
    Reply,
    Welcome,
)
from protocol.rpc import Rpc, all_rpcs

# -- settings ---------------------------------------------------------------------------------

#: hypothesis' own default number of examples: :func:`examples` scales from it.
_BASE_EXAMPLES: Final = 100
NIGHTLY: Final = "splitexec-nightly"
QUICK: Final = "splitexec-quick"


def register_profiles() -> None:
    """Register the ``splitexec-nightly`` (x50 examples) and ``splitexec-quick`` (x0.2) profiles.

    Select one with ``pytest --hypothesis-profile=splitexec-nightly`` or the
    ``HYPOTHESIS_PROFILE`` environment variable (the test suite's conftest reads it).
    """
    settings.register_profile(NIGHTLY, max_examples=_BASE_EXAMPLES * 50, deadline=None)
    settings.register_profile(QUICK, max_examples=_BASE_EXAMPLES // 5, deadline=None)


def examples(count: int) -> int:
    """``count`` scaled by the active profile (its max_examples over hypothesis' default 100)."""
    active = settings.default
    scale = active.max_examples / _BASE_EXAMPLES if active is not None else 1.0
    return max(1, round(count * scale))


def property_settings(count: int = 40) -> settings:
    """Settings for a property test of ``count`` examples (scaled), no deadline."""
    return settings(
        max_examples=examples(count),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- values and messages ----------------------------------------------------------------------

u32 = st.integers(min_value=0, max_value=limits.MAX_HEADER_VALUE)
u63 = st.integers(min_value=0, max_value=limits.MAX_CALL_ID)
names = st.text(min_size=1, max_size=24) | st.builds(
    lambda char, count: char * count,
    st.characters(exclude_categories=["Cs"]),
    st.integers(min_value=limits.MAX_NAME - 2, max_value=limits.MAX_NAME),
)
short_names = st.one_of(
    st.sampled_from(["data", "stdout", "stderr", "stdin", "entries"]),
    st.text(min_size=1, max_size=12),
)
error_messages = st.text(max_size=100) | st.builds(
    lambda char, count: char * count,
    st.characters(exclude_categories=["Cs"]),
    st.integers(min_value=limits.MAX_ERROR_MESSAGE - 2, max_value=limits.MAX_ERROR_MESSAGE),
)
nonces = st.binary(min_size=limits.NONCE_SIZE, max_size=limits.NONCE_SIZE)
macs = st.binary(min_size=limits.MAC_SIZE, max_size=limits.MAC_SIZE)
request_ids = st.binary(min_size=limits.REQUEST_ID_SIZE, max_size=limits.REQUEST_ID_SIZE)
cipher_names = st.sampled_from(limits.KNOWN_CIPHERS) | st.text(min_size=1, max_size=32)

msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
#: Any msgpack value: scalars, and lists and maps of them a few levels deep.
msgpack_values: st.SearchStrategy[Any] = st.recursive(
    msgpack_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
#: Any msgpack value, already encoded (a params, result or data payload).
raw_payloads: st.SearchStrategy[msgspec.Raw] = msgpack_values.map(to_raw)

#: A strategy for each message class of the protocol.
MESSAGE_STRATEGIES: dict[type[Message], st.SearchStrategy[Message]] = {
    Hello: st.builds(
        Hello,
        versions=st.lists(u32, min_size=1, max_size=16),
        nonce=nonces,
        ciphers=st.lists(cipher_names, min_size=1, max_size=8),
        max_frame=u32,
        window=u32,
    ),
    Challenge: st.builds(
        Challenge, version=u32, nonce=nonces, cipher=cipher_names, max_frame=u32, window=u32
    ),
    Auth: st.builds(Auth, mac=macs),
    Welcome: st.builds(
        Welcome,
        mac=macs,
        info=st.dictionaries(
            st.text(max_size=16),
            st.text(max_size=32) | st.integers(min_value=-(2**63), max_value=2**64 - 1),
            max_size=4,
        ),
    ),
    Call: st.builds(Call, id=u63, method=names, params=raw_payloads, rid=st.none() | request_ids),
    Reply: st.builds(Reply, id=u63, result=raw_payloads),
    Error: st.builds(Error, id=u63, code=u32, message=error_messages, data=raw_payloads),
    Chunk: st.builds(
        Chunk, id=u63, stream=names, seq=u63, data=st.binary(max_size=2048), end=st.booleans()
    ),
    Cancel: st.builds(Cancel, id=u63),
    Credit: st.builds(
        Credit,
        id=u63,
        stream=names,
        bytes=st.integers(min_value=1, max_value=limits.MAX_STREAM_WINDOW),
    ),
    Event: st.builds(Event, topic=u63, name=names, data=raw_payloads),
    Ping: st.builds(Ping, seq=u63),
    Pong: st.builds(Pong, seq=u63),
    Abort: st.builds(Abort, code=u32, message=error_messages),
}

#: Any message at all.
any_message: st.SearchStrategy[Message] = st.one_of(*MESSAGE_STRATEGIES.values())


def messages(cls: type[Message]) -> st.SearchStrategy[Message]:
    """Valid messages of type ``cls``, within every bound the schema declares."""
    return MESSAGE_STRATEGIES[cls]


_few_ids = st.integers(min_value=1, max_value=5)
_few_streams = st.sampled_from(["a", "b", "c"])

#: Messages of an open session with ids and stream names that collide often,
#: so that they reach the call and stream books rather than bouncing off them.
session_messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Call, id=_few_ids, method=st.just("m")),
    st.builds(Reply, id=_few_ids),
    st.builds(Error, id=_few_ids, code=u32),
    st.builds(Cancel, id=_few_ids),
    st.builds(
        Chunk,
        id=_few_ids,
        stream=_few_streams,
        seq=st.integers(min_value=0, max_value=3),
        data=st.binary(max_size=3000),
        end=st.booleans(),
    ),
    st.builds(
        Credit,
        id=_few_ids,
        stream=_few_streams,
        bytes=st.integers(min_value=1, max_value=limits.MAX_STREAM_WINDOW),
    ),
    st.builds(Event, topic=u63, name=short_names),
    st.builds(Ping, seq=u63),
    st.builds(Pong, seq=u63),
    any_message,
)


# -- frames and bytes ---------------------------------------------------------------------------


def frames(bodies: st.SearchStrategy[bytes] | None = None) -> st.SearchStrategy[bytes]:
    """Plaintext frames (header and body) of ``bodies`` (default: any message's msgpack)."""
    source = bodies if bodies is not None else any_message.map(msgspec.msgpack.encode)
    return source.map(lambda body: struct.pack(">I", len(body)) + body)


def frame_streams(
    source: st.SearchStrategy[Message] = any_message, max_size: int = 8
) -> st.SearchStrategy[bytes]:
    """Several messages' frames as one byte string."""
    return st.lists(frames(source.map(msgspec.msgpack.encode)), max_size=max_size).map(b"".join)


def _flip(data: bytes, position: int, mask: int) -> bytes:
    if not data:
        return data
    out = bytearray(data)
    out[position % len(out)] ^= mask
    return bytes(out)


def _header(data: bytes, length: int) -> bytes:
    return struct.pack(">I", length & 0xFFFFFFFF) + data[limits.HEADER_SIZE :]


def mutations(data: bytes, cap: int = limits.PREAUTH_MAX_FRAME) -> st.SearchStrategy[bytes]:
    """Byte-level mutations of ``data`` (a frame or several): what a careless or hostile peer sends.

    Bits flipped, bytes inserted or deleted, the end cut off, a slice
    repeated, or the first header set to a boundary length (0, the body's
    length plus or minus one, ``cap``, ``cap + 1``, 2^32 - 1).
    """
    size = max(len(data), 1)
    positions = st.integers(0, size - 1)
    body = len(data) - limits.HEADER_SIZE
    lengths = st.sampled_from(sorted({0, max(body - 1, 0), body + 1, cap, cap + 1, 0xFFFFFFFF}))
    one = st.one_of(
        st.builds(_flip, st.just(data), positions, st.integers(1, 255)),
        st.builds(
            lambda p, b: data[:p] + b + data[p:], positions, st.binary(min_size=1, max_size=8)
        ),
        st.builds(lambda p, n: data[:p] + data[p + n :], positions, st.integers(1, 8)),
        st.builds(lambda p: data[:p], positions),
        st.builds(
            lambda p, n: data[:p] + data[p : p + n] * 2 + data[p + n :],
            positions,
            st.integers(1, 16),
        ),
        st.builds(lambda n: _header(data, n), lengths),
    )
    return one


# -- handshakes ------------------------------------------------------------------------------------

_LIMIT = st.integers(limits.MIN_MAX_FRAME, limits.MAX_MAX_FRAME)
_WINDOW = st.integers(limits.MIN_STREAM_WINDOW, limits.MAX_STREAM_WINDOW)


def hellos(ciphers: tuple[str, ...] = limits.KNOWN_CIPHERS) -> st.SearchStrategy[Hello]:
    """Hellos a server speaking version 1 must answer with a Challenge.

    Version 1 among others, a nonce, at least one of ``ciphers`` (the ones the
    server accepts) among unknown names, limits in range.
    """
    offered = st.lists(
        st.sampled_from(ciphers) | st.text(min_size=1, max_size=12), min_size=1, max_size=8
    ).filter(lambda names: any(n in ciphers for n in names))
    versions = st.lists(u32, max_size=15).map(lambda v: [*v, limits.PROTOCOL_VERSION])
    return st.builds(
        Hello, versions=versions, nonce=nonces, ciphers=offered, max_frame=_LIMIT, window=_WINDOW
    )


def _broken(hello: Hello, change: dict[str, Any]) -> bytes:
    fields = msgspec.to_builtins(hello)
    fields.update(change)
    return msgspec.msgpack.encode({k: v for k, v in fields.items() if v is not None})


def invalid_hellos() -> st.SearchStrategy[tuple[bytes, int]]:
    """A Hello body with one thing wrong, and the Abort code the spec requires for it."""
    invalid = int(ErrorCode.INVALID_MESSAGE)
    below = st.integers(0, limits.MIN_MAX_FRAME - 1)
    above = st.integers(limits.MAX_MAX_FRAME + 1, limits.MAX_HEADER_VALUE)
    changes: st.SearchStrategy[tuple[dict[str, Any], int]] = st.one_of(
        st.tuples(st.just({"versions": []}), st.just(invalid)),
        st.tuples(
            st.lists(st.integers(2, 2**32 - 1), min_size=1, max_size=16).map(lambda v: {"versions": v}),
            st.just(int(ErrorCode.VERSION_MISMATCH)),
        ),
        st.tuples(
            st.lists(st.text(min_size=1, max_size=32).filter(lambda n: n not in limits.KNOWN_CIPHERS), min_size=1, max_size=8).map(lambda c: {"ciphers": c}),
            st.just(int(ErrorCode.UNSUPPORTED_CIPHER)),
        ),
        st.tuples((below | above).map(lambda n: {"max_frame": n}), st.just(invalid)),
        st.tuples((below | above).map(lambda n: {"window": n}), st.just(invalid)),
        st.tuples(st.binary(max_size=31).map(lambda b: {"nonce": b}), st.just(invalid)),
        st.tuples(st.sampled_from(["versions", "nonce", "ciphers", "max_frame", "window"]).map(lambda k: {k: None}), st.just(invalid)),
        st.tuples(st.sampled_from([{"max_frame": "4096"}, {"window": 1.5}, {"nonce": "n" * 32}, {"versions": 1}]), st.just(invalid)),
    )  # fmt: skip
    return st.builds(
        lambda hello, change: (_broken(hello, change[0]), change[1]), hellos(), changes
    )


# -- RPC params, from the declarations ---------------------------------------------------------------

_MAX_TEXT: Final = 40
_MAX_ITEMS: Final = 4


def from_type(t: msgspec.inspect.Type) -> st.SearchStrategy[Any]:
    """Plain values (bytes for binaries) a msgspec type accepts, kept small."""
    i = msgspec.inspect
    if isinstance(t, i.Metadata):
        return from_type(t.type)
    if isinstance(t, i.UnionType):
        return st.one_of(*(from_type(x) for x in t.types))
    if isinstance(t, i.NoneType):
        return st.none()
    if isinstance(t, i.BoolType):
        return st.booleans()
    if isinstance(t, i.IntType):
        low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**63))
        high = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**64 - 1)
        return st.integers(low, high)
    if isinstance(t, i.FloatType):
        return st.floats(
            min_value=t.ge if t.ge is not None else t.gt,
            max_value=t.le if t.le is not None else t.lt,
            exclude_min=t.ge is None and t.gt is not None,
            exclude_max=t.le is None and t.lt is not None,
            allow_nan=False,
        )
    if isinstance(t, i.StrType):
        if t.pattern is not None:
            return st.from_regex(t.pattern, fullmatch=True).filter(lambda v: _fits(v, t))
        return st.text(
            min_size=t.min_length or 0, max_size=min(t.max_length or _MAX_TEXT, _MAX_TEXT)
        )
    if isinstance(t, i.BytesType):
        return st.binary(
            min_size=t.min_length or 0, max_size=min(t.max_length or _MAX_TEXT, _MAX_TEXT)
        )
    if isinstance(t, i.ListType):
        low = t.min_length or 0
        return st.lists(
            from_type(t.item_type),
            min_size=low,
            max_size=max(low, min(t.max_length or _MAX_ITEMS, _MAX_ITEMS)),
        )
    if isinstance(t, i.DictType):
        high = max(t.min_length or 0, min(t.max_length or _MAX_ITEMS, _MAX_ITEMS))
        return st.dictionaries(
            from_type(t.key_type),
            from_type(t.value_type),
            min_size=t.min_length or 0,
            max_size=high,
        )
    if isinstance(t, i.LiteralType):
        return st.sampled_from(list(t.values))
    if isinstance(t, i.StructType):
        return _struct(t)
    if isinstance(t, i.AnyType | i.RawType):
        return msgpack_values
    raise TypeError(f"no strategy for {t!r}")  # fmt: skip


def _fits(value: str, t: msgspec.inspect.StrType) -> bool:
    return (
        (t.min_length or 0)
        <= len(value)
        <= (t.max_length if t.max_length is not None else len(value))
    )


def _struct(t: msgspec.inspect.StructType) -> st.SearchStrategy[dict[str, Any]]:
    required = {f.encode_name: from_type(f.type) for f in t.fields if f.required}
    optional = {f.encode_name: from_type(f.type) for f in t.fields if not f.required}
    base = st.fixed_dictionaries(required, optional=optional)
    if t.tag_field is not None:
        return base.map(lambda d: {**d, t.tag_field: t.tag})
    return base


@functools.cache
def params_for(rpc: Rpc[Any, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Params of ``rpc`` its declared schema accepts (a plain map; binaries as bytes).

    Valid by the schema only: rules a method checks itself (exactly one of
    two fields, a path that exists) may still refuse them.
    """
    return _struct(msgspec.inspect.type_info(rpc.params))  # type: ignore[arg-type]


def invalid_params_for(rpc: Rpc[Any, Any]) -> st.SearchStrategy[Any]:
    """Params ``rpc`` must refuse with INVALID_PARAMS (and so never run)."""
    return st.sampled_from([params for _, params in refused_params(rpc)])


def calls(
    rpcs: tuple[Rpc[Any, Any], ...] | None = None, *, valid: bool = False
) -> st.SearchStrategy[Call]:
    """Calls of the declared methods: refused params, or (``valid``) schema-valid ones.

    Valid params run the method: give only methods safe to run on the target.
    """
    chosen = rpcs if rpcs is not None else all_rpcs()

    def one(rpc: Rpc[Any, Any]) -> st.SearchStrategy[Call]:
        params = params_for(rpc) if valid else invalid_params_for(rpc)
        return st.builds(Call, id=u63, method=st.just(rpc.name), params=params.map(to_raw))

    return st.one_of(*(one(rpc) for rpc in chosen))


def field_names(rpc: Rpc[Any, Any]) -> list[str]:
    """The wire names of ``rpc``'s params fields."""
    return [f.encode_name for f in params_fields(rpc)]


def all_message_subclasses() -> set[type[Message]]:
    """Every concrete tagged subclass of Message, found by walking the class tree."""
    found: set[type[Message]] = set()
    pending = list(Message.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__struct_config__.tag is not None:
            found.add(cls)
    return found


register_profiles()
