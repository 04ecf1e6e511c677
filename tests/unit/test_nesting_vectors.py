"""The nesting vectors of PROTOCOL.md section 16.2, against the spec text, the decoder and the machines.

Each body is rebuilt from the spec's own text (its head and its deep value),
then given to a server connection in the state the message belongs to: a
hello as the first frame, a ping and a call after the handshake. The outcome
must be the one the spec names, and ``MAX_NESTING`` the bound it states.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from protocol import limits, nesting, vectors
from protocol.codec import NestingTooDeep, decode_message, decode_payload
from protocol.connection import ClientConnection, HandshakeComplete, ServerConnection
from protocol.errors import ErrorCode, InvalidMessage, ProtocolError
from protocol.framing import frame_header
from protocol.messages import Call, Hello, Ping, Pong
from protocol.rpc.core import EchoParams

SPEC = Path(__file__).resolve().parents[2] / "protocol" / "PROTOCOL.md"
TOKEN = b"\x17" * 32


def spec_section() -> str:
    return SPEC.read_text(encoding="utf-8").split("### 16.2 Nesting", 1)[1].split("\n## ", 1)[0]


def spec_bodies() -> dict[str, tuple[str, bytes]]:
    """Label -> (outcome, body), read from the spec's block alone."""
    block = re.search(r"```text\n(.*?)```", spec_section(), re.S)
    assert block is not None
    found: dict[str, tuple[str, bytes]] = {}
    label = outcome = head = ""
    for line in block.group(1).splitlines():
        if line.startswith("head:"):
            head = line.split(":", 1)[1].strip()
        elif line.startswith("    "):
            head += line.strip()
        elif line.startswith("then: 91 * "):
            count = int(line.removeprefix("then: 91 * ").split(",")[0])
            assert line.endswith(", 90")
            found[label] = (outcome, bytes.fromhex(head) + b"\x91" * count + b"\x90")
        else:
            label, outcome = line.rsplit(": ", 1)
    return found


def test_the_spec_block_is_what_protocol_vectors_prints() -> None:
    rendered = vectors.render_nesting(vectors.nesting_vectors())
    assert rendered in SPEC.read_text(encoding="utf-8")


def test_the_spec_states_the_bound_the_code_holds() -> None:
    assert limits.MAX_NESTING == 512
    text = SPEC.read_text(encoding="utf-8")
    assert f"`MAX_NESTING` = {limits.MAX_NESTING} levels" in text
    assert f"`MAX_INSPECTED_ITEMS` = {limits.MAX_INSPECTED_ITEMS}" in text
    bodies = spec_bodies()
    assert len(bodies) == len(vectors.nesting_vectors()) == 8
    for vector in vectors.nesting_vectors():
        assert bodies[vector.label] == (vector.outcome, vector.body)


def depth(body: bytes) -> int:
    return nesting.depth_of(body, nesting.Budget())


@pytest.mark.parametrize("label", list(spec_bodies()))
def test_each_body_nests_as_its_label_says(label: str) -> None:
    stated = int(re.search(r"nested (\d+) levels", label).group(1))  # type: ignore[union-attr]
    _, body = spec_bodies()[label]
    # The field's value nests as stated, so the body one level more (two for a params key):
    # exactly the bound, or one past it.
    extra = 2 if "params with" in label else 1
    assert depth(body) == stated + extra
    past = outcome_of(label) != "decoded"
    assert depth(body) == limits.MAX_NESTING + past


def outcome_of(label: str) -> str:
    return spec_bodies()[label][0]


def opened() -> ServerConnection:
    client = ClientConnection(TOKEN, ciphers=(limits.CIPHER_NONE,))
    server = ServerConnection(TOKEN, max_frame=limits.DEFAULT_MAX_FRAME, window=1 << 20)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    events = server.receive_data(client.data_to_send())
    assert any(isinstance(e, HandshakeComplete) for e in events)
    client.receive_data(server.data_to_send())
    return server


@pytest.mark.parametrize("label", list(spec_bodies()))
def test_a_server_connection_does_what_the_spec_says(label: str) -> None:
    outcome, body = spec_bodies()[label]
    frame = frame_header(len(body)) + body
    is_hello = label.startswith("hello")
    server = (
        ServerConnection(TOKEN, max_frame=limits.DEFAULT_MAX_FRAME, window=1 << 20)
        if is_hello
        else opened()
    )
    if outcome == "INVALID_MESSAGE":
        with pytest.raises(ProtocolError) as caught:
            server.receive_data(frame)
        assert caught.value.code == ErrorCode.INVALID_MESSAGE
        with pytest.raises(InvalidMessage):
            decode_message(body)
        return
    events = server.receive_data(frame)
    answer = server.data_to_send()
    message = decode_message(body)
    if is_hello:
        assert isinstance(message, Hello) and answer, "no challenge for the hello"
    elif isinstance(message, Ping):
        assert decode_message(answer[4:]) == Pong(seq=1)
    else:
        assert events == [message] and isinstance(message, Call)
        decoder = msgspec.msgpack.Decoder(EchoParams)
        if outcome == "INVALID_PARAMS":
            with pytest.raises(NestingTooDeep):
                decode_payload(decoder, message.params)
        else:
            assert outcome == "decoded"
            assert decode_payload(decoder, message.params) == EchoParams(data=b"")
