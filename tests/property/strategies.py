"""Hypothesis strategies for every wire message, and the property suite's settings.

:data:`MESSAGE_STRATEGIES` maps each message class to a strategy that builds
valid instances of it, within every bound the schema declares. Raw payloads
(``params``, ``result``, ``data``) are generated as values and encoded, so
they are always one valid msgpack value.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from protocol import limits
from protocol.codec import to_raw
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

#: Settings for example-based property tests: small but meaningful, no deadline
#: (a loaded two-core machine must not turn slowness into failures).
PROPERTY_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: Lighter settings for tests parametrized over all fourteen message types.
PER_TYPE_SETTINGS = settings(PROPERTY_SETTINGS, max_examples=25)

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
cipher_names = st.sampled_from(limits.KNOWN_CIPHERS) | st.text(min_size=1, max_size=32)

msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
msgpack_values: st.SearchStrategy[Any] = st.recursive(
    msgpack_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
raw_payloads: st.SearchStrategy[msgspec.Raw] = msgpack_values.map(to_raw)

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
    Call: st.builds(Call, id=u63, method=names, params=raw_payloads),
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
