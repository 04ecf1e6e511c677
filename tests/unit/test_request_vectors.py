"""The request-id vectors of PROTOCOL.md section 16.1, against the code and an independent encoding."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from protocol import vectors
from protocol.codec import decode_message
from protocol.messages import Call, Message

SPEC = Path(__file__).resolve().parents[2] / "protocol" / "PROTOCOL.md"
RID = bytes(range(0xA0, 0xB0))

#: The same messages written as plain maps, encoded by msgspec's generic encoder.
INDEPENDENT: list[dict[str, Any]] = [
    {"t": "call", "id": 7, "method": "server.noop", "rid": RID},
    {
        "t": "call",
        "id": 8,
        "method": "request.attach",
        "params": {"rid": RID, "offsets": {"stdout": 5}},
    },
    {
        "t": "error",
        "id": 8,
        "code": 800,
        "message": f"request {RID.hex()} is not known",
        "data": {"reason": "unknown", "rid": RID.hex()},
    },
]


def spec_bodies() -> dict[str, bytes]:
    section = SPEC.read_text(encoding="utf-8").split("### 16.1 Request ids", 1)[1]
    block = re.search(r"```hex\n(.*?)```", section, re.S)
    assert block is not None
    bodies: dict[str, str] = {}
    label = ""
    for line in block.group(1).splitlines():
        if line.startswith("    "):
            bodies[label] += line.strip()
        else:
            label = line.rstrip(":")
            bodies[label] = ""
    return {name: bytes.fromhex(text) for name, text in bodies.items()}


def test_the_spec_block_is_what_protocol_vectors_prints() -> None:
    rendered = vectors.render_messages(vectors.message_vectors())
    assert rendered in SPEC.read_text(encoding="utf-8")


@pytest.mark.parametrize("index", range(len(INDEPENDENT)))
def test_each_body_decodes_to_the_independently_built_message(index: int) -> None:
    label, message = vectors.message_vectors()[index]
    body = spec_bodies()[label]
    independent = msgspec.msgpack.encode(INDEPENDENT[index])
    for encoded in (body, independent):
        decoded = decode_message(encoded)
        assert type(decoded) is type(message)
        assert _plain(decoded) == _plain(message)


def _plain(message: Message) -> dict[str, Any]:
    """A message with its Raw payloads decoded, for comparison."""
    out: dict[str, Any] = {"type": type(message).__name__}
    for key in message.__struct_fields__:
        value = getattr(message, key)
        out[key] = msgspec.msgpack.decode(value) if isinstance(value, msgspec.Raw) else value
    return out


def test_a_request_id_must_be_exactly_16_bytes() -> None:
    for size in (0, 15, 17):
        body = msgspec.msgpack.encode({"t": "call", "id": 1, "method": "x.y", "rid": bytes(size)})
        with pytest.raises(Exception, match="rid"):
            decode_message(body)


def test_a_call_without_a_request_id_is_unchanged_on_the_wire() -> None:
    body = msgspec.msgpack.encode({"t": "call", "id": 1, "method": "server.noop"})
    decoded = decode_message(body)
    assert isinstance(decoded, Call) and decoded.rid is None
