"""The handshake and frame protection, against PROTOCOL.md's vectors and an attacker.

The vector tests read the hex values out of PROTOCOL.md and recompute every
one of them here without the protocol package (hand-packed transcript, HMAC,
RFC 5869 HKDF written out, the AEAD primitives), then check that the
connection machines produce exactly the spec's frames. A wrong number in the
spec, in :mod:`protocol.vectors` or in the machines fails one of them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

import protocol
from protocol import limits, vectors
from protocol.codec import ENCODER, decode_message, encode_message, to_raw
from protocol.connection import ClientConnection, HandshakeComplete, ServerConnection, State
from protocol.errors import (
    AuthenticationFailed,
    DecryptionFailed,
    ErrorCode,
    FrameTooLarge,
    InvalidMessage,
    LocalProtocolError,
    ProtocolError,
    UnexpectedMessage,
    UnsupportedCipher,
    VersionMismatch,
)
from protocol.framing import FrameReader, encode_frame, frame_header
from protocol.messages import (
    Abort,
    Auth,
    Call,
    Challenge,
    Event,
    Hello,
    Message,
    Ping,
    Pong,
    Welcome,
)

SPEC = Path(protocol.__file__).with_name("PROTOCOL.md")
TOKEN = b"\x5a" * 32
OTHER_TOKEN = b"\xa5" * 32
AEAD_CIPHERS = (limits.CIPHER_AESGCM, limits.CIPHER_CHACHA20)
SMALL_CAP = 64 * 1024


# -- helpers ------------------------------------------------------------------------------


def split_frames(data: bytes) -> list[bytes]:
    """Whole frames (header included) of a plaintext or sealed byte string."""
    frames = []
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack_from(">I", data, pos)
        frames.append(data[pos : pos + 4 + length])
        pos += 4 + length
    return frames


def plain_message(frame: bytes) -> Message:
    """Decode a plaintext frame."""
    reader = FrameReader(limits.MAX_MAX_FRAME)
    reader.feed(frame)
    body = reader.next_frame()
    assert body is not None and reader.buffered == 0
    return decode_message(body)


def make_pair(
    cipher: str = limits.CIPHER_NONE,
    *,
    client_token: bytes = TOKEN,
    server_token: bytes = TOKEN,
    max_frame: int = SMALL_CAP,
) -> tuple[ClientConnection, ServerConnection]:
    client = ClientConnection(client_token, ciphers=(cipher,), max_frame=max_frame)
    server = ServerConnection(server_token, max_frame=max_frame)
    return client, server


def handshake_frames(
    client: ClientConnection, server: ServerConnection
) -> tuple[list[bytes], list[Any], list[Any]]:
    """Run the four-frame handshake: its frames (Hello, Challenge, Auth, Welcome), each side's events."""
    frames: list[bytes] = []
    client_events: list[Any] = []
    server_events: list[Any] = []
    for _ in range(2):
        frames.append(client.data_to_send())
        server_events += server.receive_data(frames[-1])
        frames.append(server.data_to_send())
        client_events += client.receive_data(frames[-1])
    assert client.state is State.OPEN and server.state is State.OPEN
    return frames, client_events, server_events


def handshake(client: ClientConnection, server: ServerConnection) -> tuple[list[Any], list[Any]]:
    """Run the four-frame handshake; return the events of each side."""
    _, client_events, server_events = handshake_frames(client, server)
    return client_events, server_events


def open_pair(cipher: str = limits.CIPHER_NONE) -> tuple[ClientConnection, ServerConnection]:
    client, server = make_pair(cipher)
    handshake(client, server)
    return client, server


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869, written out."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    okm = b""
    block = b""
    counter = 1
    while len(okm) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        okm += block
        counter += 1
    return okm[:length]


def aead(cipher: str, key: bytes) -> AESGCM | ChaCha20Poly1305:
    return AESGCM(key) if cipher == limits.CIPHER_AESGCM else ChaCha20Poly1305(key)


def counter_nonce(counter: int) -> bytes:
    return b"\x00" * 4 + counter.to_bytes(8, "big")


# -- spec vectors ---------------------------------------------------------------------------


def spec_text() -> str:
    return SPEC.read_text(encoding="utf-8")


def spec_vector_blocks() -> list[dict[str, str]]:
    """Every ``label: value`` block of section 16's handshake vectors, continuation lines joined."""
    text = spec_text()
    section = text.split("## 16. Test vectors", 1)[1].split("### 16.1", 1)[0]
    blocks = []
    for body in re.findall(r"```text\n(.*?)```", section, re.S):
        fields: dict[str, str] = {}
        label = ""
        for line in body.splitlines():
            if line.startswith("    "):
                fields[label] += line.strip()
                continue
            label, _, value = line.partition(":")
            fields[label] = value.strip()
        blocks.append(fields)
    return blocks


def test_spec_has_one_vector_block_per_case() -> None:
    blocks = spec_vector_blocks()
    assert [b["case"] for b in blocks] == [c.name for c in vectors.CASES]
    assert {b["chosen cipher"] for b in blocks} == set(AEAD_CIPHERS)


def test_spec_vector_section_is_what_protocol_vectors_prints() -> None:
    assert vectors.render(vectors.all_vectors()) in spec_text()


def side_of(block: dict[str, str], side: str) -> dict[str, Any]:
    """A side's nonce, max_frame and window in a block, keyed as its message and constructor."""
    return {
        "nonce": bytes.fromhex(block[f"{side} nonce"]),
        "max_frame": int(block[f"{side} max_frame"]),
        "window": int(block[f"{side} window"]),
    }


def completed(
    block: dict[str, str], peer: str, info: dict[str, str | int] | None = None
) -> HandshakeComplete:
    """The event a side reports in a block: the chosen cipher, ``peer``'s limits, Welcome's info."""
    announced = side_of(block, peer)
    return HandshakeComplete(
        version=1,
        cipher=block["chosen cipher"],
        peer_max_frame=announced["max_frame"],
        peer_window=announced["window"],
        info=info or {},
    )


def independent_transcript(block: dict[str, str]) -> bytes:
    offered = block["offered ciphers"].split(",")
    chosen = block["chosen cipher"]
    out = b"execd-handshake-v1\x00"
    out += struct.pack(">I", int(block["chosen version"]))
    out += bytes.fromhex(block["client nonce"]) + bytes.fromhex(block["server nonce"])
    out += bytes([len(offered)])
    for name in offered:
        out += bytes([len(name.encode())]) + name.encode()
    out += bytes([len(chosen.encode())]) + chosen.encode()
    out += struct.pack(
        ">IIII",
        int(block["client max_frame"]),
        int(block["server max_frame"]),
        int(block["client window"]),
        int(block["server window"]),
    )
    return out


@pytest.mark.parametrize("index", range(len(vectors.CASES)))
def test_spec_vectors_recomputed_independently(index: int) -> None:
    block = spec_vector_blocks()[index]
    token = bytes.fromhex(block["token"])
    offered = block["offered ciphers"].split(",")
    accepted = block["server accepts"].split(",")
    chosen = next(name for name in offered if name in accepted)
    assert block["chosen cipher"] == chosen
    assert int(block["chosen version"]) == limits.PROTOCOL_VERSION

    t = independent_transcript(block)
    assert block["transcript"] == t.hex()
    client_mac = hmac.new(token, b"execd client auth\x00" + t, hashlib.sha256).digest()
    server_mac = hmac.new(token, b"execd server auth\x00" + t, hashlib.sha256).digest()
    assert block["client mac"] == client_mac.hex()
    assert block["server mac"] == server_mac.hex()
    okm = hkdf_sha256(token, hashlib.sha256(t).digest(), b"execd v1 frame keys", 64)
    assert block["key client->server"] == okm[:32].hex()
    assert block["key server->client"] == okm[32:].hex()

    expected_bodies = {
        "hello frame": {
            "t": "hello",
            "versions": [limits.PROTOCOL_VERSION],
            "ciphers": offered,
            **side_of(block, "client"),
        },
        "challenge frame": {
            "t": "challenge",
            "version": int(block["chosen version"]),
            "cipher": chosen,
            **side_of(block, "server"),
        },
        "auth frame": {"t": "auth", "mac": client_mac},
        "welcome frame": {
            "t": "welcome",
            "mac": server_mac,
            "info": json.loads(block["welcome info"]),
        },
    }
    for label, expected in expected_bodies.items():
        frame = bytes.fromhex(block[label])
        (length,) = struct.unpack(">I", frame[:4])
        assert length == len(frame) - 4, label
        assert length <= limits.PREAUTH_MAX_FRAME
        assert msgspec.msgpack.decode(frame[4:]) == expected, label

    ping_body = bytes.fromhex(block["ping(seq=1) body"])
    assert msgspec.msgpack.decode(ping_body) == {"t": "ping", "seq": 1}
    sealed = bytes.fromhex(block["sealed ping(seq=1) frame, counter 0"])
    header, body = sealed[:4], sealed[4:]
    assert header == struct.pack(">I", len(ping_body) + 16)
    assert len(body) == len(ping_body) + 16
    assert aead(chosen, okm[:32]).decrypt(counter_nonce(0), body, header) == ping_body


@pytest.mark.parametrize("index", range(len(vectors.CASES)))
def test_connection_machines_produce_the_spec_frames(index: int) -> None:
    block = spec_vector_blocks()[index]
    token = bytes.fromhex(block["token"])
    info = json.loads(block["welcome info"])
    offered = tuple(block["offered ciphers"].split(","))
    client = ClientConnection(token, ciphers=offered, **side_of(block, "client"))
    accepted = tuple(block["server accepts"].split(","))
    server = ServerConnection(token, ciphers=accepted, info=info, **side_of(block, "server"))
    hello = client.data_to_send()
    assert hello.hex() == block["hello frame"]
    assert server.receive_data(hello) == []
    challenge = server.data_to_send()
    assert challenge.hex() == block["challenge frame"]
    assert client.receive_data(challenge) == []
    auth = client.data_to_send()
    assert auth.hex() == block["auth frame"]
    server_events = server.receive_data(auth)
    welcome = server.data_to_send()
    assert welcome.hex() == block["welcome frame"]
    client_events = client.receive_data(welcome)
    assert client.data_to_send() == b""
    assert server_events == [completed(block, "client")]
    assert client_events == [completed(block, "server", info)]
    ping = client.send(Ping(seq=1))
    assert bytes(ping).hex() == block["sealed ping(seq=1) frame, counter 0"]
    assert server.receive_data(ping) == []
    assert client.receive_data(server.data_to_send()) == [Pong(seq=1)]


# -- spec tables against the code -------------------------------------------------------------


def test_spec_error_table_lists_every_code() -> None:
    section = spec_text().split("## 13. Error codes", 1)[1].split("## 14.", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `([A-Z_]+)` \| (yes|no) \|", section, re.M)
    assert {int(code): name for code, name, _ in rows} == {int(c): c.name for c in ErrorCode}
    for code, _, closes in rows:
        assert (closes == "yes") == (int(code) < 100)


def test_spec_limits_table_matches_protocol_limits() -> None:
    section = spec_text().split("## 14. Limits", 1)[1].split("## 15.", 1)[0]
    rows = re.findall(r"^\| `([A-Z_]+)` \| (\d+)", section, re.M)
    assert rows, "no limits table"
    for name, value in rows:
        assert getattr(limits, name) == int(value), name


# -- authentication failures ---------------------------------------------------------------------


def test_wrong_token_fails_on_both_sides() -> None:
    client, server = make_pair(client_token=OTHER_TOKEN)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    with pytest.raises(AuthenticationFailed) as info:
        server.receive_data(client.data_to_send())
    assert info.value.code is ErrorCode.AUTH_FAILED
    assert server.state is State.CLOSED
    abort_bytes = server.data_to_send()
    assert plain_message(abort_bytes) == Abort(
        code=int(ErrorCode.AUTH_FAILED), message="authentication failed"
    )
    events = client.receive_data(abort_bytes)
    assert events == [Abort(code=int(ErrorCode.AUTH_FAILED), message="authentication failed")]
    assert client.state is State.CLOSED
    with pytest.raises(LocalProtocolError):
        client.send(Call(id=1, method="server.noop"))


def test_client_rejects_a_welcome_with_a_wrong_mac() -> None:
    client, server = make_pair()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    assert isinstance(plain_message(client.data_to_send()), Auth)
    forged = encode_frame(ENCODER, Welcome(mac=b"\x00" * 32), limits.PREAUTH_MAX_FRAME)
    with pytest.raises(AuthenticationFailed):
        client.receive_data(forged)
    assert client.state is State.CLOSED
    assert plain_message(client.data_to_send()) == Abort(
        code=int(ErrorCode.AUTH_FAILED), message="authentication failed"
    )


def test_replayed_auth_fails_against_a_new_server() -> None:
    (recorded_hello, _, recorded_auth, _), _, _ = handshake_frames(*make_pair())
    replay_target = ServerConnection(TOKEN, max_frame=SMALL_CAP)
    with pytest.raises(AuthenticationFailed):
        replay_target.receive_data(recorded_hello + recorded_auth)
    assert replay_target.state is State.CLOSED


def test_replayed_welcome_fails_against_a_new_client() -> None:
    frames, _, _ = handshake_frames(*make_pair(limits.CIPHER_AESGCM))
    _, recorded_challenge, _, recorded_welcome = frames
    victim = ClientConnection(TOKEN, ciphers=(limits.CIPHER_AESGCM,), max_frame=SMALL_CAP)
    victim.data_to_send()
    assert victim.receive_data(recorded_challenge) == []
    assert isinstance(plain_message(victim.data_to_send()), Auth)
    with pytest.raises(AuthenticationFailed):
        victim.receive_data(recorded_welcome)
    assert victim.state is State.CLOSED


# -- frame protection -------------------------------------------------------------------------------


def sealed_client_frames(cipher: str) -> tuple[ServerConnection, bytes, bytes]:
    """An open server and two sealed client frames it has not seen yet."""
    client, server = open_pair(cipher)
    first = bytes(client.send(Call(id=1, method="server.echo", params=to_raw({"data": b"a"}))))
    second = bytes(client.send(Call(id=2, method="server.noop")))
    return server, first, second


@pytest.mark.parametrize("cipher", AEAD_CIPHERS)
def test_tampering_with_any_byte_of_a_sealed_frame_fails_and_closes(cipher: str) -> None:
    _, first, _ = sealed_client_frames(cipher)
    for position in range(len(first)):
        client, server = open_pair(cipher)
        frame = bytearray(
            client.send(Call(id=1, method="server.echo", params=to_raw({"data": b"a"})))
        )
        follow = bytes(client.send(Call(id=2, method="server.noop")))
        assert len(frame) == len(first)
        frame[position] ^= 0x01
        with pytest.raises((DecryptionFailed, FrameTooLarge)) as info:
            server.receive_data(bytes(frame) + follow + b"\x00" * (SMALL_CAP + 8))
        if position >= limits.HEADER_SIZE:
            assert type(info.value) is DecryptionFailed, position
        assert server.state is State.CLOSED
        events = client.receive_data(server.data_to_send())
        assert events == [Abort(code=int(info.value.code), message=info.value.message)]


@pytest.mark.parametrize("cipher", AEAD_CIPHERS)
def test_reordered_frames_fail(cipher: str) -> None:
    server, first, second = sealed_client_frames(cipher)
    with pytest.raises(DecryptionFailed):
        server.receive_data(second + first)
    assert server.state is State.CLOSED


@pytest.mark.parametrize("cipher", AEAD_CIPHERS)
def test_replayed_frame_fails(cipher: str) -> None:
    server, first, _ = sealed_client_frames(cipher)
    events = server.receive_data(first)
    assert [type(e) for e in events] == [Call]
    with pytest.raises(DecryptionFailed):
        server.receive_data(first)
    assert server.state is State.CLOSED


@pytest.mark.parametrize("cipher", AEAD_CIPHERS)
def test_dropped_frame_fails(cipher: str) -> None:
    server, _, second = sealed_client_frames(cipher)
    with pytest.raises(DecryptionFailed):
        server.receive_data(second)


@pytest.mark.parametrize("cipher", AEAD_CIPHERS)
def test_server_to_client_tampering_fails(cipher: str) -> None:
    client, server = open_pair(cipher)
    frame = bytearray(server.send(Event(topic=1, name="changed", data=to_raw({"path": "/x"}))))
    frame[-1] ^= 0x80
    with pytest.raises(DecryptionFailed):
        client.receive_data(bytes(frame))
    assert client.state is State.CLOSED


@pytest.mark.parametrize("cipher", AEAD_CIPHERS)
def test_sealed_body_shorter_than_the_tag_fails(cipher: str) -> None:
    _, server = open_pair(cipher)
    with pytest.raises(DecryptionFailed):
        server.receive_data(frame_header(5) + b"12345")


@pytest.mark.parametrize("case", vectors.CASES, ids=lambda c: c.name)
def test_protection_starts_after_auth_and_after_welcome(case: vectors.VectorInputs) -> None:
    vector = vectors.compute(case)
    client = ClientConnection(
        case.token,
        ciphers=case.offered_ciphers,
        max_frame=case.client_max_frame,
        window=case.client_window,
        nonce=case.client_nonce,
    )
    server = ServerConnection(
        case.token,
        ciphers=case.server_ciphers,
        max_frame=case.server_max_frame,
        window=case.server_window,
        nonce=case.server_nonce,
    )
    hello = client.data_to_send()
    assert isinstance(plain_message(hello), Hello)
    server.receive_data(hello)
    challenge = server.data_to_send()
    assert isinstance(plain_message(challenge), Challenge)
    client.receive_data(challenge)
    auth = client.data_to_send()
    assert isinstance(plain_message(auth), Auth)
    server.receive_data(auth)
    welcome = server.data_to_send()
    assert isinstance(plain_message(welcome), Welcome)

    # Server frames right behind the Welcome are sealed with k_s2c from counter 0.
    events_frames = [bytes(server.send(Event(topic=7, name="e", data=to_raw(i)))) for i in range(2)]
    s2c = aead(vector.cipher, vector.key_server_to_client)
    for counter, frame in enumerate(events_frames):
        header, body = frame[:4], frame[4:]
        plain = s2c.decrypt(counter_nonce(counter), body, header)
        assert decode_message(plain) == Event(topic=7, name="e", data=to_raw(counter))
    got = client.receive_data(welcome + b"".join(events_frames))
    assert isinstance(got[0], HandshakeComplete)
    assert got[1:] == [Event(topic=7, name="e", data=to_raw(i)) for i in range(2)]

    # Client frames after the Auth are sealed with k_c2s, counters 0 and 1.
    c2s = aead(vector.cipher, vector.key_client_to_server)
    for counter in range(2):
        frame = bytes(client.send(Ping(seq=100 + counter)))
        plain = c2s.decrypt(counter_nonce(counter), frame[4:], frame[:4])
        assert decode_message(plain) == Ping(seq=100 + counter)
        server.receive_data(frame)


def test_cipher_none_leaves_frames_in_plaintext() -> None:
    client, server = open_pair(limits.CIPHER_NONE)
    frame = bytes(client.send(Call(id=1, method="server.noop")))
    assert plain_message(frame) == Call(id=1, method="server.noop")
    assert server.receive_data(frame) == [Call(id=1, method="server.noop")]


# -- negotiation attacks and failures -------------------------------------------------------------------


def rewrite(frame: bytes, **changes: Any) -> bytes:
    """The same handshake frame with some fields replaced."""
    message = plain_message(frame)
    changed = msgspec.structs.replace(message, **changes)
    return bytes(encode_frame(ENCODER, changed, limits.PREAUTH_MAX_FRAME))


@pytest.mark.parametrize(
    "changes",
    [
        {"ciphers": [limits.CIPHER_CHACHA20]},
        {"ciphers": [limits.CIPHER_NONE]},
        {"ciphers": [limits.CIPHER_CHACHA20, limits.CIPHER_AESGCM, limits.CIPHER_NONE]},
        {"max_frame": limits.MIN_MAX_FRAME},
        {"window": limits.MAX_STREAM_WINDOW},
    ],
    ids=["drop-aes", "force-none", "reorder", "max_frame", "window"],
)
def test_tampered_hello_breaks_the_client_mac(changes: dict[str, Any]) -> None:
    offered = (limits.CIPHER_AESGCM, limits.CIPHER_CHACHA20, limits.CIPHER_NONE)
    client = ClientConnection(TOKEN, ciphers=offered, max_frame=SMALL_CAP)
    server = ServerConnection(TOKEN, max_frame=SMALL_CAP)
    server.receive_data(rewrite(client.data_to_send(), **changes))
    challenge = server.data_to_send()
    assert client.receive_data(challenge) == []
    with pytest.raises(AuthenticationFailed):
        server.receive_data(client.data_to_send())
    assert client.state is State.HANDSHAKE
    assert client.receive_data(server.data_to_send())[0] == Abort(
        code=int(ErrorCode.AUTH_FAILED), message="authentication failed"
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"cipher": limits.CIPHER_NONE},
        {"max_frame": limits.MAX_MAX_FRAME},
        {"window": limits.MIN_STREAM_WINDOW},
        {"nonce": b"\x01" * 32},
    ],
    ids=["cipher", "max_frame", "window", "nonce"],
)
def test_tampered_challenge_breaks_the_client_mac(changes: dict[str, Any]) -> None:
    client = ClientConnection(
        TOKEN, ciphers=(limits.CIPHER_AESGCM, limits.CIPHER_NONE), max_frame=SMALL_CAP
    )
    server = ServerConnection(TOKEN, max_frame=SMALL_CAP)
    server.receive_data(client.data_to_send())
    client.receive_data(rewrite(server.data_to_send(), **changes))
    with pytest.raises(AuthenticationFailed):
        server.receive_data(client.data_to_send())


def test_version_mismatch_at_the_server() -> None:
    client, server = make_pair()
    with pytest.raises(VersionMismatch):
        server.receive_data(rewrite(client.data_to_send(), versions=[2, 3]))
    abort = plain_message(server.data_to_send())
    assert isinstance(abort, Abort) and abort.code == int(ErrorCode.VERSION_MISMATCH)
    assert server.state is State.CLOSED


def test_version_mismatch_at_the_client() -> None:
    client, server = make_pair()
    server.receive_data(client.data_to_send())
    with pytest.raises(VersionMismatch):
        client.receive_data(rewrite(server.data_to_send(), version=2))
    assert client.state is State.CLOSED


def test_server_highest_shared_version_wins() -> None:
    client, server = make_pair()
    server.receive_data(rewrite(client.data_to_send(), versions=[7, 1, 0]))
    challenge = plain_message(server.data_to_send())
    assert isinstance(challenge, Challenge) and challenge.version == 1


def test_no_shared_cipher() -> None:
    client = ClientConnection(TOKEN, ciphers=(limits.CIPHER_CHACHA20,))
    server = ServerConnection(TOKEN, ciphers=(limits.CIPHER_AESGCM,))
    with pytest.raises(UnsupportedCipher):
        server.receive_data(client.data_to_send())
    abort = plain_message(server.data_to_send())
    assert isinstance(abort, Abort) and abort.code == int(ErrorCode.UNSUPPORTED_CIPHER)


def test_server_picks_the_first_offered_cipher_it_accepts() -> None:
    client = ClientConnection(TOKEN, ciphers=(limits.CIPHER_CHACHA20, limits.CIPHER_AESGCM))
    server = ServerConnection(TOKEN)
    server.receive_data(client.data_to_send())
    challenge = plain_message(server.data_to_send())
    assert isinstance(challenge, Challenge) and challenge.cipher == limits.CIPHER_CHACHA20


def test_unknown_offered_cipher_names_are_skipped_but_bound() -> None:
    client = ClientConnection(TOKEN, ciphers=(limits.CIPHER_AESGCM,))
    server = ServerConnection(TOKEN)
    hello = rewrite(client.data_to_send(), ciphers=["rot13", limits.CIPHER_AESGCM])
    server.receive_data(hello)
    challenge = server.data_to_send()
    parsed = plain_message(challenge)
    assert isinstance(parsed, Challenge) and parsed.cipher == limits.CIPHER_AESGCM
    client.receive_data(challenge)
    with pytest.raises(AuthenticationFailed):
        server.receive_data(client.data_to_send())


def test_client_rejects_a_cipher_it_did_not_offer() -> None:
    client = ClientConnection(TOKEN, ciphers=(limits.CIPHER_AESGCM,))
    server = ServerConnection(TOKEN)
    server.receive_data(client.data_to_send())
    with pytest.raises(UnsupportedCipher):
        client.receive_data(rewrite(server.data_to_send(), cipher=limits.CIPHER_NONE))


@pytest.mark.parametrize(
    "changes",
    [
        {"max_frame": limits.MIN_MAX_FRAME - 1},
        {"max_frame": limits.MAX_MAX_FRAME + 1},
        {"window": limits.MIN_STREAM_WINDOW - 1},
        {"window": limits.MAX_STREAM_WINDOW + 1},
    ],
)
def test_announced_limits_out_of_range(changes: dict[str, Any]) -> None:
    client, server = make_pair()
    with pytest.raises(InvalidMessage):
        server.receive_data(rewrite(client.data_to_send(), **changes))
    client, server = make_pair()
    server.receive_data(client.data_to_send())
    with pytest.raises(InvalidMessage):
        client.receive_data(rewrite(server.data_to_send(), **changes))


def test_constructor_rejects_bad_local_settings() -> None:
    with pytest.raises(ValueError):
        ClientConnection(b"")
    with pytest.raises(ValueError):
        ClientConnection(TOKEN, ciphers=("rot13",))
    with pytest.raises(InvalidMessage):
        ServerConnection(TOKEN, max_frame=100)


# -- pre-authentication cap and ordering ------------------------------------------------------------------


def test_preauth_frame_over_the_cap_is_rejected_from_the_header_alone() -> None:
    server = ServerConnection(TOKEN)
    with pytest.raises(FrameTooLarge):
        server.receive_data(frame_header(limits.PREAUTH_MAX_FRAME + 1))
    assert server.state is State.CLOSED
    abort = plain_message(server.data_to_send())
    assert isinstance(abort, Abort) and abort.code == int(ErrorCode.FRAME_TOO_LARGE)

    client = ClientConnection(TOKEN)
    client.data_to_send()
    with pytest.raises(FrameTooLarge):
        client.receive_data(frame_header(limits.PREAUTH_MAX_FRAME + 1))


def test_preauth_frame_at_the_cap_is_read_in_full() -> None:
    server = ServerConnection(TOKEN)
    server.receive_data(frame_header(limits.PREAUTH_MAX_FRAME))
    assert server.buffered == 4
    with pytest.raises(ProtocolError) as info:
        server.receive_data(b"\x00" * limits.PREAUTH_MAX_FRAME)
    assert not isinstance(info.value, FrameTooLarge)


def test_cap_becomes_the_announced_one_after_the_handshake() -> None:
    client, server = open_pair()
    big = Call(id=1, method="server.echo", params=to_raw({"data": b"x" * 20_000}))
    assert server.receive_data(client.send(big)) == [big]
    with pytest.raises(FrameTooLarge):
        server.receive_data(frame_header(SMALL_CAP + 1))


def test_handshake_messages_out_of_order() -> None:
    server = ServerConnection(TOKEN)
    with pytest.raises(UnexpectedMessage):
        server.receive_data(encode_frame(ENCODER, Auth(mac=b"\x00" * 32), 4096))
    server = ServerConnection(TOKEN)
    with pytest.raises(UnexpectedMessage):
        server.receive_data(encode_frame(ENCODER, Call(id=1, method="server.noop"), 4096))
    server = ServerConnection(TOKEN)
    with pytest.raises(UnexpectedMessage):
        server.receive_data(encode_frame(ENCODER, Ping(seq=1), 4096))
    client = ClientConnection(TOKEN)
    with pytest.raises(UnexpectedMessage):
        client.receive_data(encode_frame(ENCODER, Welcome(mac=b"\x00" * 32), 4096))


def test_handshake_frames_are_rejected_once_open() -> None:
    client, server = open_pair()
    with pytest.raises(UnexpectedMessage):
        server.receive_data(
            encode_frame(
                ENCODER,
                Hello(
                    versions=[1], nonce=b"\x00" * 32, ciphers=["none"], max_frame=4096, window=4096
                ),
                4096,
            )
        )
    with pytest.raises(UnexpectedMessage):
        client.receive_data(encode_frame(ENCODER, Welcome(mac=b"\x00" * 32), 4096))


def test_abort_in_place_of_the_challenge() -> None:
    client = ClientConnection(TOKEN)
    client.data_to_send()
    abort = Abort(code=int(ErrorCode.CONNECTION_LIMIT), message="too many connections")
    assert client.receive_data(encode_frame(ENCODER, abort, 4096)) == [abort]
    assert client.state is State.CLOSED
    assert client.receive_data(b"anything after the abort") == []


def test_handshake_one_byte_at_a_time() -> None:
    client, server = make_pair(limits.CIPHER_CHACHA20)
    for _ in range(2):
        for byte in client.data_to_send():
            server.receive_data(bytes([byte]))
        for byte in server.data_to_send():
            client.receive_data(bytes([byte]))
    assert client.state is State.OPEN and server.state is State.OPEN
    assert server.receive_data(client.send(Ping(seq=5))) == []
    assert client.receive_data(server.data_to_send()) == [Pong(seq=5)]


def test_auth_failure_message_reveals_nothing() -> None:
    client, server = make_pair(client_token=OTHER_TOKEN)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    with pytest.raises(AuthenticationFailed):
        server.receive_data(client.data_to_send())
    wire = server.data_to_send()
    assert TOKEN not in wire and TOKEN.hex().encode() not in wire
    assert encode_message(Abort(code=7, message="authentication failed")) == wire[4:]
