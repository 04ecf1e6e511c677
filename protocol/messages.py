"""Every message of the wire protocol, as msgspec Structs in one tagged union.

Each message is a msgpack map whose ``"t"`` key holds its tag (a short stable
string); the remaining keys are the fields below. Unknown keys are ignored so
newer peers can add fields; an unknown tag or a wrongly typed field is a
protocol error (see :mod:`protocol.codec`).

``params``, ``result`` and ``data`` payloads are carried as ``msgspec.Raw``:
already-encoded msgpack that the application decodes into the Struct of the
method in question (see :mod:`protocol.rpc`).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from protocol import limits

_U63 = msgspec.Meta(ge=0, le=limits.MAX_U63)
_U32 = msgspec.Meta(ge=0, le=limits.MAX_HEADER_VALUE)
CallId = Annotated[int, _U63]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=limits.MAX_NAME)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=limits.NONCE_SIZE, max_length=limits.NONCE_SIZE)]
Mac = Annotated[bytes, msgspec.Meta(min_length=limits.MAC_SIZE, max_length=limits.MAC_SIZE)]
CipherName = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
RequestId = Annotated[
    bytes, msgspec.Meta(min_length=limits.REQUEST_ID_SIZE, max_length=limits.REQUEST_ID_SIZE)
]

#: msgpack for an empty map and for nil: the defaults of Raw payloads.
EMPTY_MAP: Final = msgspec.Raw(b"\x80")
NIL: Final = msgspec.Raw(b"\xc0")


class Message(
    msgspec.Struct,
    tag_field="t",
    kw_only=True,
    omit_defaults=True,
    forbid_unknown_fields=False,
    gc=False,
):
    """Base of every wire message."""


# -- handshake ------------------------------------------------------------------


class Hello(Message, tag="hello"):
    """Client -> server, first frame: versions, a fresh nonce, offered ciphers and limits."""

    versions: Annotated[list[Annotated[int, _U32]], msgspec.Meta(min_length=1, max_length=16)]
    nonce: Nonce
    ciphers: Annotated[list[CipherName], msgspec.Meta(min_length=1, max_length=8)]
    max_frame: Annotated[int, _U32]
    window: Annotated[int, _U32]


class Challenge(Message, tag="challenge"):
    """Server -> client: the chosen version and cipher, the server's nonce and limits."""

    version: Annotated[int, _U32]
    nonce: Nonce
    cipher: CipherName
    max_frame: Annotated[int, _U32]
    window: Annotated[int, _U32]


class Auth(Message, tag="auth"):
    """Client -> server: the client's proof, HMAC over the transcript."""

    mac: Mac


class Welcome(Message, tag="welcome"):
    """Server -> client: the server's proof; the connection is open after it."""

    mac: Mac
    info: dict[str, str | int] = msgspec.field(default_factory=dict)


# -- calls ----------------------------------------------------------------------


class Call(Message, tag="call"):
    """Start a call. ``id`` is chosen by the caller and unique among its open calls.

    ``rid``, when present, is the call's request id: 16 random bytes that name
    the call beyond its connection (PROTOCOL.md section 8.1).
    """

    id: CallId
    method: Name
    params: msgspec.Raw = EMPTY_MAP
    rid: RequestId | None = None


class Reply(Message, tag="reply"):
    """The successful, final answer to a call."""

    id: CallId
    result: msgspec.Raw = NIL


class Error(Message, tag="error"):
    """The failed, final answer to a call, with a stable numeric code."""

    id: CallId
    code: Annotated[int, _U32]
    message: Annotated[str, msgspec.Meta(max_length=limits.MAX_ERROR_MESSAGE)] = ""
    data: msgspec.Raw = NIL


class Chunk(Message, tag="chunk"):
    """A piece of a byte stream belonging to an open call, in either direction."""

    id: CallId
    stream: Name
    seq: Annotated[int, _U63]
    data: bytes = b""
    end: bool = False


class Cancel(Message, tag="cancel"):
    """Ask the server to cancel a call; it still answers with a final Error."""

    id: CallId


class Credit(Message, tag="credit"):
    """Grant the peer ``bytes`` more of stream data on ``(id, stream)``."""

    id: CallId
    stream: Name
    bytes: Annotated[int, msgspec.Meta(ge=1, le=limits.MAX_STREAM_WINDOW)]


class Event(Message, tag="event"):
    """A server-pushed event, e.g. a path-watch notification; ``topic`` names the subscription."""

    topic: Annotated[int, _U63]
    name: Name
    data: msgspec.Raw = NIL


class Ping(Message, tag="ping"):
    """Liveness probe; the peer answers with a Pong carrying the same ``seq``."""

    seq: Annotated[int, _U63]


class Pong(Message, tag="pong"):
    """Answer to a Ping."""

    seq: Annotated[int, _U63]


class Abort(Message, tag="abort"):
    """Last frame before the sender closes the connection because of ``code``."""

    code: Annotated[int, _U32]
    message: Annotated[str, msgspec.Meta(max_length=limits.MAX_ERROR_MESSAGE)] = ""


AnyMessage = (
    Hello
    | Challenge
    | Auth
    | Welcome
    | Call
    | Reply
    | Error
    | Chunk
    | Cancel
    | Credit
    | Event
    | Ping
    | Pong
    | Abort
)

#: Every concrete message class, in the order of the union.
MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello,
    Challenge,
    Auth,
    Welcome,
    Call,
    Reply,
    Error,
    Chunk,
    Cancel,
    Credit,
    Event,
    Ping,
    Pong,
    Abort,
)


def tag_of(cls: type[Message]) -> str:
    """The wire tag of a message class."""
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag
