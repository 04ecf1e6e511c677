"""Decoding hostile nesting: the exact bound of PROTOCOL.md section 3, wherever the decoder runs.

``MAX_NESTING`` holds whatever the stack the decoder is called on: the same
bodies are decoded at the top of the stack and from deep inside it, where
msgspec alone would give up hundreds of levels earlier.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import limits, nesting
from protocol.codec import (
    NestingTooDeep,
    decode_message,
    decode_payload,
    encode_message,
    from_raw,
)
from protocol.connection import ClientConnection, ServerConnection
from protocol.errors import ErrorCode, InvalidMessage, MalformedMessage, ProtocolError
from protocol.framing import frame_header
from protocol.messages import Abort, Call, Event, Hello, Ping, Reply
from protocol.rpc import all_rpcs
from protocol.rpc.core import EchoParams
from protocol.rpc.ledger import MAX_BATCH_ENTRIES, AppendParams
from protocol.rpc.services import StartParams
from protocol.rpc.shell import RunParams

TOKEN = b"\x42" * 32
BOUND = limits.MAX_NESTING
DEPTHS = (2000, 5000, 60000)
"""Past the decoder's own limit, far past it, and close to what the walk inspects."""
STACKS = (0, 500, 900)
"""Frames below the caller: at 900 msgspec alone follows a few dozen levels."""

T = TypeVar("T")


def nested(depth: int) -> bytes:
    """A msgpack value nested exactly ``depth`` levels: arrays of one, around an empty array."""
    return b"\x91" * (depth - 1) + b"\x90" if depth else b"\xc0"


def with_field(message: Any, name: str, value: bytes) -> bytes:
    """``message`` encoded as a map with one more entry, ``name`` -> ``value`` (raw msgpack)."""
    body = encode_message(message)
    assert 0x80 <= body[0] < 0x8F
    return bytes((body[0] + 1,)) + body[1:] + msgspec.msgpack.encode(name) + value


def hello() -> Hello:
    conn = ClientConnection(TOKEN)
    frame = conn.data_to_send()
    message = decode_message(frame[4:])
    assert isinstance(message, Hello)
    return message


def below(frames: int, fn: Callable[[], T]) -> T:
    """``fn()`` called ``frames`` Python frames deeper than here."""

    def down(left: int) -> T:
        return down(left - 1) if left else fn()

    return down(frames)


def outcome(fn: Callable[[], object]) -> str:
    try:
        fn()
    except (InvalidMessage, NestingTooDeep) as exc:
        return type(exc).__name__
    return "decoded"


MESSAGES = [hello(), Ping(seq=1), Call(id=7, method="server.noop")]


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_an_unknown_field_is_ignored_up_to_the_bound_and_refused_past_it(
    message: Any, stack: int
) -> None:
    # The field's value one level below the body: the body nests one level more.
    fits, deeper = (with_field(message, "x", nested(d)) for d in (BOUND - 1, BOUND))
    assert below(stack, lambda: decode_message(fits)) == message
    assert below(stack, lambda: outcome(lambda: decode_message(deeper))) == "InvalidMessage"


@pytest.mark.parametrize("stack", STACKS)
def test_params_are_held_to_one_level_less_wherever_their_decoder_skips(stack: int) -> None:
    """Params nest ``BOUND - 1`` levels: deeper, the call is INVALID_PARAMS, not a violation."""
    run = msgspec.msgpack.Decoder(RunParams)
    start = msgspec.msgpack.Decoder(StartParams)
    for depth, expected in ((BOUND - 1, "decoded"), (BOUND, "NestingTooDeep")):
        # An unknown key of the params (its value sits one level below them) ...
        params = b"\x82\xa7command\xa4true\xa1z" + nested(depth - 1)
        call = decode_message(encode_message(Call(id=1, method="m", params=msgspec.Raw(params))))
        assert isinstance(call, Call)
        raw = call.params
        assert below(stack, lambda: outcome(lambda: decode_payload(run, raw))) == expected  # noqa: B023
        # ... and one of a tagged Struct inside them (two levels below).
        probe = b"\x83\xa4type\xa3tcp\xa4port\x01\xa1z" + nested(depth - 2)
        params = b"\x83\xa4name\xa1s\xa7command\xa4true\xa5probe" + probe
        assert (
            below(stack, lambda: outcome(lambda: decode_payload(start, params)))  # noqa: B023
            == expected
        )
    # A value of any type nests as deep as the bound allows, and no deeper.
    anything = msgspec.msgpack.Decoder(Any)
    assert below(stack, lambda: outcome(lambda: decode_payload(anything, nested(BOUND - 1))))
    assert below(stack, lambda: outcome(lambda: decode_payload(anything, nested(BOUND)))) == (
        "NestingTooDeep"
    )


def test_a_key_the_decoder_skips_may_not_hold_more_than_the_items_inspected() -> None:
    many = msgspec.msgpack.encode(list(range(limits.MAX_INSPECTED_ITEMS)))
    fits = msgspec.msgpack.encode(list(range(limits.MAX_INSPECTED_ITEMS - 2)))
    run = msgspec.msgpack.Decoder(RunParams)
    for value, expected in ((fits, "decoded"), (many, "NestingTooDeep")):
        params = b"\x82\xa7command\xa4true\xa1z" + value
        assert outcome(lambda: decode_payload(run, params)) == expected  # noqa: B023
    for value, expected in ((fits, "decoded"), (many, "InvalidMessage")):
        body = with_field(Ping(seq=1), "x", value)
        assert outcome(lambda: decode_message(body)) == expected  # noqa: B023
    # What the params' own fields hold is not counted: they are decoded, not skipped.
    batch = AppendParams(
        session="s",
        first_seq=1,
        prev_hash=bytes(32),
        entries=[b"e"] * MAX_BATCH_ENTRIES,
        hashes=[bytes(32)] * MAX_BATCH_ENTRIES,
    )
    append = msgspec.msgpack.Decoder(AppendParams)
    decoded = decode_payload(append, msgspec.msgpack.encode(batch))
    assert len(decoded.entries) + len(decoded.hashes or ()) > limits.MAX_INSPECTED_ITEMS


def test_no_declared_params_hide_structs_where_their_shape_does_not_look() -> None:
    """nesting.Shape looks into Struct fields and unions of them, not lists or dicts of them."""

    def hidden(kind: mi.Type, inside: bool) -> bool:
        if isinstance(kind, mi.StructType):
            return inside or any(hidden(f.type, False) for f in kind.fields)
        if isinstance(kind, mi.UnionType):
            return any(hidden(t, inside) for t in kind.types)
        if isinstance(kind, mi.Metadata):
            return hidden(kind.type, inside)
        items = [
            getattr(kind, a) for a in ("item_type", "key_type", "value_type") if hasattr(kind, a)
        ]
        items += list(getattr(kind, "item_types", ()))
        return any(hidden(t, True) for t in items)

    for rpc in all_rpcs():
        assert not hidden(mi.type_info(rpc.params), False), rpc.name


@pytest.mark.parametrize("depth", DEPTHS)
def test_deep_unknown_field_of_a_hello_is_invalid_message(depth: int) -> None:
    with pytest.raises(InvalidMessage):
        decode_message(with_field(hello(), "extra", nested(depth)))


@pytest.mark.parametrize("depth", (BOUND, *DEPTHS))
def test_server_aborts_a_deep_hello_with_invalid_message(depth: int) -> None:
    server = ServerConnection(TOKEN, max_frame=limits.DEFAULT_MAX_FRAME, window=1 << 20)
    body = with_field(hello(), "extra", nested(depth))
    if len(body) > limits.PREAUTH_MAX_FRAME:
        body = with_field(hello(), "extra", nested(limits.PREAUTH_MAX_FRAME - 300))
    with pytest.raises(ProtocolError) as caught:
        server.receive_data(frame_header(len(body)) + body)
    assert caught.value.code == ErrorCode.INVALID_MESSAGE
    out = server.data_to_send()
    abort = decode_message(out[4:])
    assert isinstance(abort, Abort) and abort.code == ErrorCode.INVALID_MESSAGE


def test_a_hello_nested_to_the_bound_is_answered() -> None:
    server = ServerConnection(TOKEN, max_frame=limits.DEFAULT_MAX_FRAME, window=1 << 20)
    body = with_field(hello(), "extra", nested(BOUND - 1))
    server.receive_data(frame_header(len(body)) + body)
    assert server.data_to_send(), "no Challenge for a Hello nested to the bound"


@pytest.mark.parametrize("depth", (BOUND, *DEPTHS[:2]))
def test_call_with_deep_params_decodes_and_its_params_are_refused(depth: int) -> None:
    body = encode_message(Call(id=7, method="server.echo", params=msgspec.Raw(nested(depth))))
    call = decode_message(body)
    assert isinstance(call, Call) and call.id == 7 and call.method == "server.echo"
    assert bytes(call.params) == nested(depth)
    deep_map = b"\x81\xa4data" + nested(depth)
    with pytest.raises(msgspec.ValidationError):
        decode_payload(msgspec.msgpack.Decoder(EchoParams), deep_map)
    with pytest.raises(NestingTooDeep):
        decode_payload(msgspec.msgpack.Decoder(Any), nested(depth))
    with pytest.raises(NestingTooDeep):
        from_raw(nested(depth * 2), Any)


@pytest.mark.parametrize("depth", DEPTHS[:2])
def test_deep_results_and_data_are_kept_raw_for_the_client(depth: int) -> None:
    for message in (
        Reply(id=3, result=msgspec.Raw(nested(depth))),
        Event(topic=1, name="e", data=msgspec.Raw(nested(depth))),
    ):
        decoded = decode_message(encode_message(message))
        assert decoded == message


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


def test_from_raw_decodes_and_validates_alike_with_a_kept_decoder_or_without() -> None:
    # A hashable type's decoder is kept after its first use; an unhashable one is made each time.
    # An Annotated form is no class; its static type is Any, as msgspec's own Decoder takes it.
    kinds: tuple[Any, ...] = (Annotated[int, msgspec.Meta(ge=0)], Annotated[int, _Unhashable()])
    for kind in kinds:
        for _ in range(2):
            assert from_raw(b"\x05", kind) == 5
            with pytest.raises(msgspec.ValidationError):
                from_raw(b"\xa1x", kind)
    assert from_raw(msgspec.Raw(b"\x91\x01"), list[int]) == [1]


def test_call_too_deep_and_too_long_to_inspect_is_invalid_message() -> None:
    depth = limits.MAX_INSPECTED_ITEMS + 10
    body = encode_message(Call(id=7, method="m", params=msgspec.Raw(nested(depth))))
    with pytest.raises(InvalidMessage):
        decode_message(body)


def test_deep_unknown_field_of_a_call_is_invalid_message() -> None:
    body = with_field(Call(id=7, method="m", params=msgspec.Raw(b"\x80")), "x", nested(5000))
    with pytest.raises(InvalidMessage):
        decode_message(body)


def test_a_deep_body_cut_short_is_malformed() -> None:
    body = with_field(Ping(seq=1), "x", nested(5000))[:-1]
    with pytest.raises(MalformedMessage):
        decode_message(body)


def test_shallow_messages_are_untouched_by_the_walk() -> None:
    params = msgspec.Raw(msgspec.msgpack.encode({"a": [[[1, 2], {"b": b"c" * 100}]]}))
    call = Call(id=1, method="m", params=params)
    assert decode_message(encode_message(call)) == call


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=5), children, max_size=5)
    ),
    max_leaves=40,
)


@given(value=values, trailing=st.binary(max_size=8))
@settings(max_examples=300, deadline=None)
def test_walk_finds_the_end_and_depth_of_any_value(value: Any, trailing: bytes) -> None:
    encoded = msgspec.msgpack.encode(value)
    end, depth = nesting.measure(encoded + trailing, 0, nesting.Budget(1 << 20))
    assert end == len(encoded)
    assert depth == depth_of(value)


@pytest.mark.parametrize(
    "body", [b"", b"\x92\x01", b"\xc4\x10abc", b"\xc1", b"\xdd\xff\xff\xff\xff"]
)
def test_walk_refuses_truncated_or_invalid_values(body: bytes) -> None:
    with pytest.raises(nesting.Malformed):
        nesting.measure(body, 0, nesting.Budget(1 << 20))


@pytest.mark.parametrize(
    "first",
    [
        "encode_message(Abort(code=1, message='x'))",
        "b'\\x81\\xa1t\\xa5nope!'",  # {"t": "nope!"}: a tag no message has
        "b'\\xc1'",  # not msgpack
    ],
)
def test_a_processs_first_decode_builds_the_decoder_and_answers_like_later_ones(
    first: str,
) -> None:
    """The message decoder is built on the first frame, not at import; that frame is decoded alike."""
    code = (
        "from protocol import codec\n"
        "from protocol.codec import decode_message, encode_message\n"
        "from protocol.messages import Abort\n"
        "assert isinstance(codec._DECODER, codec._FirstDecode)\n"
        "def outcome(body):\n"
        "    try:\n"
        "        return repr(decode_message(body))\n"
        "    except Exception as exc:\n"
        "        return f'{type(exc).__name__}: {exc}'\n"
        f"body = {first}\n"
        "once = outcome(body)\n"
        "assert not isinstance(codec._DECODER, codec._FirstDecode)\n"
        "print(once == outcome(body), once)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.startswith("True "), done.stdout
