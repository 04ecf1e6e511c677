"""Scripts: what the kit does on the wire, as data that can be saved, replayed and exported.

Every case of the catalogue, every example of the open-ended fuzzing and every
repro file is a :class:`Script`: a list of steps on numbered connections. A step
either acts (connect, send bytes or a message, run the handshake, upload a
stream, grant credit, wait) or states what the specification requires back
(:class:`Expect`). Scripts are JSON (``Script.to_json``/``Script.from_json``),
so an implementation in another language can run them without Python.

Values in a message body are JSON, with a few tagged objects for what JSON
cannot say (:func:`encode_body` turns them into msgpack):

``{"$bin": "<hex>"}``
    a msgpack binary;
``{"$fill": SIZE}`` (optionally ``"byte": N``)
    a binary of ``SIZE`` bytes of a fixed pattern (or of byte ``N``);
``{"$int": SIZE}``
    an integer given as a size expression;
``{"$raw": "<hex>"}``
    these exact msgpack bytes (any encoding of any value);
``{"$nest": DEPTH, "leaf": VALUE}`` (optionally ``"map": true``)
    ``VALUE`` inside ``DEPTH`` nested arrays (or single-key maps).

A SIZE is an integer or an expression ``NAME``, ``NAME+N`` or ``NAME-N`` over the
values negotiated on the step's connection: ``server_max_frame``,
``server_window``, ``client_max_frame``, ``client_window``, and the values an
earlier Reply captured (see :func:`size_of`).
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec

from protocol import limits

SizeExpr = int | str
#: Pattern bytes of ``$fill`` values and uploads: position i holds ``i * 7 % 251``.
_PERIOD: Final = 251
_PATTERN: Final = bytes(i * 7 % _PERIOD for i in range(64 * 1024 + _PERIOD))
_EXPR: Final = re.compile(r"^\s*([a-z_]+|\d+)\s*(?:([+-])\s*(\d+))?\s*$")


def pattern(offset: int, size: int) -> bytes:
    """``size`` bytes of the fill pattern, starting at stream offset ``offset``."""
    out = bytearray()
    while len(out) < size:
        start = (offset + len(out)) % _PERIOD
        take = min(size - len(out), len(_PATTERN) - start)
        out += _PATTERN[start : start + take]
    return bytes(out)


def size_of(expr: SizeExpr, values: dict[str, int]) -> int:
    """The integer a size expression stands for, given the connection's negotiated values."""
    if isinstance(expr, int):
        return expr
    match = _EXPR.match(expr)
    if match is None:
        raise ValueError(f"not a size expression: {expr!r}")
    name, sign, amount = match.groups()
    if name.isdigit():
        base = int(name)
    elif name in values:
        base = values[name]
    else:
        raise ValueError(f"size expression {expr!r} names an unknown value")
    delta = int(amount) if amount else 0
    return base - delta if sign == "-" else base + delta


def to_value(node: Any, values: dict[str, int]) -> Any:
    """The Python value of a JSON body node, tagged objects resolved (see the module doc)."""
    if isinstance(node, dict):
        if "$bin" in node:
            return bytes.fromhex(node["$bin"])
        if "$fill" in node:
            size = size_of(node["$fill"], values)
            if "byte" in node:
                return bytes([node["byte"]]) * size
            return pattern(0, size)
        if "$int" in node:
            return size_of(node["$int"], values)
        if "$raw" in node:
            return msgspec.Raw(bytes.fromhex(node["$raw"]))
        if "$nest" in node:
            # Written as bytes: an encoder would recurse once per level.
            leaf = msgspec.msgpack.encode(to_value(node.get("leaf"), values))
            level = b"\x81\xa1k" if node.get("map") else b"\x91"
            return msgspec.Raw(level * int(node["$nest"]) + leaf)
        return {key: to_value(item, values) for key, item in node.items()}
    if isinstance(node, list):
        return [to_value(item, values) for item in node]
    return node


def to_json_value(value: Any) -> Any:
    """A JSON body node for a Python value (bytes become ``$bin``); inverse of :func:`to_value`."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bin": bytes(value).hex()}
    if isinstance(value, msgspec.Raw):
        return {"$raw": bytes(value).hex()}
    if isinstance(value, dict):
        return {str(key): to_json_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_value(item) for item in value]
    return value


def encode_body(node: Any, values: dict[str, int]) -> bytes:
    """The msgpack bytes of a JSON body node."""
    return msgspec.msgpack.encode(to_value(node, values))


# -- steps -----------------------------------------------------------------------------


class Step(
    msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """One action or requirement on connection ``conn``."""

    conn: int = 0


class Connect(Step, tag="connect"):
    """Open connection ``conn`` to the target."""


class Close(Step, tag="close"):
    """Close connection ``conn`` (``reset``: abortively, with a TCP RST)."""

    reset: bool = False


class SendBytes(Step, tag="send_bytes"):
    """Write these exact bytes (no framing, no sealing), in writes of ``split`` bytes if set."""

    hex: str
    split: int | None = None


class SendHeader(Step, tag="send_header"):
    """Write only a frame header announcing ``length`` bytes (no body, never sealed)."""

    length: SizeExpr


class Send(Step, tag="send"):
    """Frame and send one message body (sealed once the connection seals).

    ``body`` is a JSON body node (any shape: valid or not). ``pad_to``: add
    an unknown field so that the frame's length (the header's value) is
    exactly this size. ``plain``: never seal. ``tamper``: flip a bit of the
    sealed ciphertext. ``split``: write in pieces of this many bytes.
    """

    body: Any
    pad_to: SizeExpr | None = None
    plain: bool = False
    tamper: bool = False
    split: int | None = None


class SendBody(Step, tag="send_body"):
    """Frame and send these exact body bytes (sealed once the connection seals)."""

    hex: str
    split: int | None = None


class Resend(Step, tag="resend"):
    """Write again, byte for byte, frame ``index`` that connection ``source`` sent (-1: its last)."""

    source: int
    index: int = -1


class Handshake(Step, tag="handshake"):
    """A complete, valid handshake (needs the token): Hello, Challenge, Auth, Welcome."""

    cipher: str = limits.CIPHER_NONE
    max_frame: int = limits.DEFAULT_MAX_FRAME
    window: int = limits.DEFAULT_STREAM_WINDOW
    nonce: str | None = None


class Auth(Step, tag="auth"):
    """Send an Auth for the Hello and Challenge of this connection.

    ``mac``: ``"valid"`` (needs the token), ``"random"``, or hex bytes.
    ``transcript_ciphers``: compute the valid MAC as if these ciphers had been
    offered (what an on-path downgrade would make the client believe).
    """

    mac: str = "valid"
    transcript_ciphers: list[str] | None = None


class Upload(Step, tag="upload"):
    """Send ``total`` pattern bytes on a client -> server stream of call ``id``.

    Chunks carry at most ``chunk`` bytes (default: the most the server's cap
    allows). With ``respect_credit`` the step waits for credit as a correct
    sender does; without it, it sends regardless (to overrun on purpose).
    """

    id: int
    stream: str
    total: SizeExpr
    chunk: SizeExpr | None = None
    end: bool = True
    respect_credit: bool = True


class Grant(Step, tag="grant"):
    """Send a Credit of ``bytes`` for a server -> client stream (any amount, even a wrong one)."""

    id: int
    stream: str
    bytes: SizeExpr


class Configure(Step, tag="configure"):
    """Change how the connection's client behaves: ``auto_grant`` credit for what it receives."""

    auto_grant: bool


class Sleep(Step, tag="sleep"):
    """Wait ``seconds`` (reading nothing)."""

    seconds: float


# -- requirements -----------------------------------------------------------------------


class Want(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=True):
    """What the specification requires the server to send back (or not)."""


class AbortWant(Want, tag="abort"):
    """An Abort with one of ``codes``, then the connection closes.

    ``message``: the Abort's exact text, when the spec fixes it.
    """

    codes: list[int]
    message: str | None = None


class ChallengeWant(Want, tag="challenge"):
    """A well-formed Challenge choosing a version and a cipher the Hello offered."""

    version: int | None = None
    cipher: str | None = None


class WelcomeWant(Want, tag="welcome"):
    """A Welcome whose server MAC verifies (needs the token)."""


class ReplyWant(Want, tag="reply"):
    """A Reply to call ``id``.

    With ``check_result`` its result must equal ``result`` (a JSON body node);
    with ``same_as`` it must equal, byte for byte, the result of that earlier
    call on the same connection.
    """

    id: int
    result: Any = None
    check_result: bool = False
    same_as: int | None = None
    #: Keep integer fields of the result (a map) as named values for later steps.
    capture: list[str] = msgspec.field(default_factory=list)


class ErrorWant(Want, tag="error"):
    """An Error answering call ``id`` with one of ``codes``; ``data`` keys must match if given."""

    id: int
    codes: list[int]
    data: dict[str, Any] | None = None


class AnswerWant(Want, tag="answer"):
    """A final answer to call ``id``: a Reply, or an Error with one of ``codes``."""

    id: int
    codes: list[int] = msgspec.field(default_factory=list)


class EventWant(Want, tag="event"):
    """An Event with this ``topic`` (a size expression: a captured value) and ``name``."""

    topic: SizeExpr
    name: str


class PongWant(Want, tag="pong"):
    """A Pong with this ``seq``, and no Abort before it."""

    seq: int


class AliveWant(Want, tag="alive"):
    """The connection lives: a Ping sent now is answered, nothing fatal arrives first."""


class ClosedWant(Want, tag="closed"):
    """The server closes the connection; with ``quiet`` it sends nothing at all before."""

    quiet: bool = False


class ChunksWant(Want, tag="chunks"):
    """At least ``bytes`` bytes arrive on server stream ``(id, stream)`` (``end``: and it ends)."""

    id: int
    stream: str
    bytes: SizeExpr
    end: bool = False


class NoChunksWant(Want, tag="no_chunks"):
    """Nothing more arrives on server stream ``(id, stream)`` for ``seconds``."""

    id: int
    stream: str
    seconds: float


class DistinctNoncesWant(Want, tag="distinct_nonces"):
    """The Challenges received on ``conns`` all carry different server nonces."""

    conns: list[int]


class FirstAcceptedWant(Want, tag="first_accepted"):
    """The cipher chosen on this connection is the first offered one the probes found accepted.

    Each of ``probes`` offered a single cipher: a Challenge there means the
    server accepts that cipher.
    """

    probes: list[int]


Requirement = (
    AbortWant
    | ChallengeWant
    | WelcomeWant
    | ReplyWant
    | ErrorWant
    | AnswerWant
    | EventWant
    | PongWant
    | AliveWant
    | ClosedWant
    | ChunksWant
    | NoChunksWant
    | DistinctNoncesWant
    | FirstAcceptedWant
)


class Expect(Step, tag="expect"):
    """Require ``want`` within ``timeout`` seconds (default: the run's).

    ``otherwise``: the verdict when it is not met: ``"fail"`` for a MUST,
    ``"non-strict"`` for a SHOULD or a MAY.
    """

    want: Requirement
    timeout: float | None = None
    otherwise: str = "fail"


AnyStep = (
    Connect
    | Close
    | SendBytes
    | SendHeader
    | Send
    | SendBody
    | Resend
    | Handshake
    | Auth
    | Upload
    | Grant
    | Configure
    | Sleep
    | Expect
)


class Script(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Steps to run in order; ``needs_token``: some step proves the token."""

    steps: list[AnyStep]
    needs_token: bool = False

    def to_json(self) -> bytes:
        """The script as JSON."""
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> Script:
        """A script from its JSON; raises ``msgspec.ValidationError`` for a malformed one."""
        return msgspec.json.decode(data, type=cls)


def script(*steps: AnyStep) -> Script:
    """A Script of ``steps``; it needs the token when any step proves it."""
    return Script(steps=list(steps), needs_token=any(_proves_token(s) for s in steps))


def _proves_token(step: AnyStep) -> bool:
    if isinstance(step, Handshake):
        return True
    if isinstance(step, Auth):
        return step.mac == "valid"
    return isinstance(step, Expect) and isinstance(step.want, WelcomeWant)
