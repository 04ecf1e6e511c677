"""Test vectors of the handshake and of sealed frames, computed from fixed inputs.

Every number in the TEST VECTORS section of PROTOCOL.md comes from here:
``python -m protocol.vectors`` prints that section, and the unit tests check
the spec's copy, the connection state machines and an independent
recomputation against one another.

The computation uses the protocol's building blocks directly (transcript,
MACs, key derivation, framing, sealing) rather than the connection machines,
so a machine that drifts from the building blocks shows up as a mismatch.
Computing them performs no I/O; only :func:`main` writes (to stdout).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol import limits
from protocol.aead import FrameSealer
from protocol.codec import ENCODER, encode_message, to_raw
from protocol.errors import ErrorCode
from protocol.framing import encode_frame, frame_header
from protocol.handshake import (
    Negotiated,
    choose_cipher,
    choose_version,
    client_mac,
    derive_keys,
    server_mac,
    transcript,
)
from protocol.messages import Auth, Call, Challenge, Error, Hello, Message, Ping, Welcome
from protocol.rpc.request import ATTACH, AttachParams, NotKnown

#: Width, in hex digits, of one line of a wrapped value in the rendered spec.
HEX_WIDTH = 64


@dataclass(frozen=True, slots=True)
class VectorInputs:
    """Everything a handshake depends on, fixed."""

    name: str
    token: bytes
    client_nonce: bytes
    server_nonce: bytes
    offered_ciphers: tuple[str, ...]
    server_ciphers: tuple[str, ...]
    client_max_frame: int
    client_window: int
    server_max_frame: int
    server_window: int
    welcome_info: dict[str, str | int] = field(default_factory=dict)
    ping_seq: int = 1


@dataclass(frozen=True, slots=True)
class HandshakeVector:
    """What the inputs produce: the agreed values, the secrets and the wire bytes."""

    inputs: VectorInputs
    version: int
    cipher: str
    transcript: bytes
    client_mac: bytes
    server_mac: bytes
    key_client_to_server: bytes
    key_server_to_client: bytes
    hello_frame: bytes
    challenge_frame: bytes
    auth_frame: bytes
    welcome_frame: bytes
    ping_body: bytes
    sealed_ping_frame: bytes


_TOKEN = bytes(range(0x00, 0x20))
_CLIENT_NONCE = bytes(range(0x40, 0x60))
_SERVER_NONCE = bytes(range(0x80, 0xA0))
_OFFERED = (limits.CIPHER_AESGCM, limits.CIPHER_CHACHA20, limits.CIPHER_NONE)


def _case(cipher: str, server_ciphers: tuple[str, ...]) -> VectorInputs:
    """The fixed inputs, with the ciphers the server accepts; named after the one agreed."""
    return VectorInputs(
        name=cipher,
        token=_TOKEN,
        client_nonce=_CLIENT_NONCE,
        server_nonce=_SERVER_NONCE,
        offered_ciphers=_OFFERED,
        server_ciphers=server_ciphers,
        client_max_frame=16 * 1024 * 1024,
        client_window=1024 * 1024,
        server_max_frame=8 * 1024 * 1024,
        server_window=256 * 1024,
        welcome_info={"server": "execd", "pid": 4242},
    )


#: The fixed cases: one per AEAD cipher. Both offer the same list; in the
#: second the server does not accept AES-GCM, so the client's next choice wins.
CASES: tuple[VectorInputs, ...] = (
    _case(limits.CIPHER_AESGCM, _OFFERED),
    _case(limits.CIPHER_CHACHA20, (limits.CIPHER_CHACHA20, limits.CIPHER_NONE)),
)


def compute(inputs: VectorInputs) -> HandshakeVector:
    """Run the handshake arithmetic for ``inputs`` and frame every message."""
    version = choose_version(list(limits.SUPPORTED_VERSIONS))
    cipher = choose_cipher(list(inputs.offered_ciphers), inputs.server_ciphers)
    if version is None or cipher is None:
        raise ValueError(f"vector {inputs.name!r} negotiates nothing")
    negotiated = Negotiated(
        version=version,
        client_nonce=inputs.client_nonce,
        server_nonce=inputs.server_nonce,
        offered_ciphers=inputs.offered_ciphers,
        cipher=cipher,
        client_max_frame=inputs.client_max_frame,
        server_max_frame=inputs.server_max_frame,
        client_window=inputs.client_window,
        server_window=inputs.server_window,
    )
    t = transcript(negotiated)
    c_mac = client_mac(inputs.token, t)
    s_mac = server_mac(inputs.token, t)
    keys = derive_keys(inputs.token, t)
    cap = limits.PREAUTH_MAX_FRAME
    hello = Hello(
        versions=list(limits.SUPPORTED_VERSIONS),
        nonce=inputs.client_nonce,
        ciphers=list(inputs.offered_ciphers),
        max_frame=inputs.client_max_frame,
        window=inputs.client_window,
    )
    challenge = Challenge(
        version=version,
        nonce=inputs.server_nonce,
        cipher=cipher,
        max_frame=inputs.server_max_frame,
        window=inputs.server_window,
    )
    welcome = Welcome(mac=s_mac, info=dict(inputs.welcome_info))
    ping_body = encode_message(Ping(seq=inputs.ping_seq))
    if cipher == limits.CIPHER_NONE:
        sealed = frame_header(len(ping_body)) + ping_body
    else:
        header = frame_header(len(ping_body) + limits.AEAD_TAG_SIZE)
        sealed = header + FrameSealer(cipher, keys.client_to_server).seal(header, ping_body)
    return HandshakeVector(
        inputs=inputs,
        version=version,
        cipher=cipher,
        transcript=t,
        client_mac=c_mac,
        server_mac=s_mac,
        key_client_to_server=keys.client_to_server,
        key_server_to_client=keys.server_to_client,
        hello_frame=bytes(encode_frame(ENCODER, hello, cap)),
        challenge_frame=bytes(encode_frame(ENCODER, challenge, cap)),
        auth_frame=bytes(encode_frame(ENCODER, Auth(mac=c_mac), cap)),
        welcome_frame=bytes(encode_frame(ENCODER, welcome, cap)),
        ping_body=ping_body,
        sealed_ping_frame=sealed,
    )


def all_vectors() -> list[HandshakeVector]:
    """One computed vector per entry of :data:`CASES`."""
    return [compute(case) for case in CASES]


def _hex_lines(label: str, value: bytes) -> list[str]:
    text = value.hex()
    if len(text) <= HEX_WIDTH:
        return [f"{label}: {text}"]
    lines = [f"{label}:"]
    lines.extend("    " + text[i : i + HEX_WIDTH] for i in range(0, len(text), HEX_WIDTH))
    return lines


def vector_fields(vector: HandshakeVector) -> list[tuple[str, bytes | str | int]]:
    """The labelled values of one vector, in the order the spec lists them."""
    inp = vector.inputs
    return [
        ("case", inp.name),
        ("token", inp.token),
        ("client nonce", inp.client_nonce),
        ("server nonce", inp.server_nonce),
        ("offered ciphers", ",".join(inp.offered_ciphers)),
        ("server accepts", ",".join(inp.server_ciphers)),
        ("client max_frame", inp.client_max_frame),
        ("client window", inp.client_window),
        ("server max_frame", inp.server_max_frame),
        ("server window", inp.server_window),
        ("welcome info", json.dumps(inp.welcome_info)),
        ("chosen version", vector.version),
        ("chosen cipher", vector.cipher),
        ("transcript", vector.transcript),
        ("client mac", vector.client_mac),
        ("server mac", vector.server_mac),
        ("key client->server", vector.key_client_to_server),
        ("key server->client", vector.key_server_to_client),
        ("hello frame", vector.hello_frame),
        ("challenge frame", vector.challenge_frame),
        ("auth frame", vector.auth_frame),
        ("welcome frame", vector.welcome_frame),
        (f"ping(seq={inp.ping_seq}) body", vector.ping_body),
        (f"sealed ping(seq={inp.ping_seq}) frame, counter 0", vector.sealed_ping_frame),
    ]


def render(vectors: Sequence[HandshakeVector]) -> str:
    """The spec's vector blocks: one fenced block per vector, values in hex."""
    out: list[str] = []
    for vector in vectors:
        out.append("```text")
        for label, value in vector_fields(vector):
            if isinstance(value, bytes):
                out.extend(_hex_lines(label, value))
            else:
                out.append(f"{label}: {value}")
        out.append("```")
        out.append("")
    return "\n".join(out)


#: The request id of the request-id vectors: the 16 bytes ``a0 a1 .. af``.
VECTOR_RID = bytes(range(0xA0, 0xB0))


def message_vectors() -> list[tuple[str, Message]]:
    """The messages of section 8.1, each with the label the spec gives it."""
    attach = AttachParams(rid=VECTOR_RID, offsets={"stdout": 5})
    not_known = NotKnown(reason="unknown", rid=VECTOR_RID.hex())
    return [
        (
            "call server.noop, id 7, with a request id",
            Call(id=7, method="server.noop", rid=VECTOR_RID),
        ),
        (
            "call request.attach, id 8, holding 5 bytes of stdout",
            Call(id=8, method=ATTACH.name, params=to_raw(attach)),
        ),
        (
            "error REQUEST_NOT_KNOWN answering call 8",
            Error(
                id=8,
                code=int(ErrorCode.REQUEST_NOT_KNOWN),
                message=f"request {VECTOR_RID.hex()} is not known",
                data=to_raw(not_known),
            ),
        ),
    ]


def render_messages(messages: Sequence[tuple[str, Message]]) -> str:
    """The spec's request-id block: each message's body (plaintext msgpack) in hex."""
    out = ["```hex"]
    for label, message in messages:
        out.extend(_hex_lines(label, encode_message(message)))
    out.extend(["```", ""])
    return "\n".join(out)


@dataclass(frozen=True, slots=True)
class NestingVector:
    """A body whose last value nests ``depth`` levels, and what a receiver does with it.

    The body is ``head`` followed by ``depth - 1`` bytes ``91`` (an array of
    one item) and one ``90`` (an empty array): the deep value ends the body.
    ``outcome``: ``"decoded"``, ``"INVALID_MESSAGE"`` (the connection is
    aborted with 5) or ``"INVALID_PARAMS"`` (the call is answered with 101).
    """

    label: str
    head: bytes
    depth: int
    outcome: str

    @property
    def body(self) -> bytes:
        return self.head + b"\x91" * (self.depth - 1) + b"\x90"


def _with_last(message: Message, key: str) -> bytes:
    """The encoding of ``message`` with one more map entry, ``key``, whose value is left out."""
    body = encode_message(message)
    if not 0x80 <= body[0] < 0x8F:
        raise ValueError("a vector message must encode as a map of fewer than 15 entries")
    return bytes((body[0] + 1,)) + body[1:] + ENCODER.encode(key)


def nesting_vectors() -> list[NestingVector]:
    """Bodies on both sides of ``MAX_NESTING`` (PROTOCOL.md section 3), for section 16.2.

    An unknown field ``"x"`` of a hello (before the handshake), a ping and a
    call (after it) nests 511 levels, then 512 (its body one more); then the
    params of ``server.echo`` carry an unknown key ``"x"`` nested 510 levels,
    then 511, so that the params nest 511, then 512.
    """
    hello = Hello(
        versions=[1],
        nonce=_CLIENT_NONCE,
        ciphers=[limits.CIPHER_NONE],
        max_frame=limits.MIN_MAX_FRAME,
        window=limits.MIN_STREAM_WINDOW,
    )
    bound = limits.MAX_NESTING
    vectors: list[NestingVector] = []
    for name, message in (
        ("hello", hello),
        ("ping(seq=1)", Ping(seq=1)),
        ("call server.echo, id 1", Call(id=1, method="server.echo", params=to_raw({"data": b""}))),
    ):
        head = _with_last(message, "x")
        for depth, outcome in ((bound - 1, "decoded"), (bound, "INVALID_MESSAGE")):
            label = f'{name}, unknown field "x" nested {depth} levels'
            vectors.append(NestingVector(label, head, depth, outcome))
    params = b"\x82\xa4data\xc4\x00\xa1x"  # {"data": b"", "x": ...}
    call = Call(id=2, method="server.echo")
    head = _with_last(call, "params") + params
    for depth, outcome in ((bound - 2, "decoded"), (bound - 1, "INVALID_PARAMS")):
        label = f'call server.echo, id 2, params with an unknown key "x" nested {depth} levels'
        vectors.append(NestingVector(label, head, depth, outcome))
    return vectors


def render_nesting(vectors: Sequence[NestingVector]) -> str:
    """The spec's nesting block: each body as its head in hex, then its deep value."""
    out = ["```text"]
    for vector in vectors:
        out.append(f"{vector.label}: {vector.outcome}")
        out.extend(_hex_lines("head", vector.head))
        out.append(f"then: 91 * {vector.depth - 1}, 90")
    out.extend(["```", ""])
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the vector blocks for PROTOCOL.md."""
    del argv
    sys.stdout.write(render(all_vectors()))
    sys.stdout.write(render_messages(message_vectors()))
    sys.stdout.write(render_nesting(nesting_vectors()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
