"""The terminal and limit message vectors: PROTOCOL.md's copy, the computation, and decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

import protocol
from protocol import api_vectors
from protocol.codec import decode_message, from_raw
from protocol.framing import frame_header
from protocol.messages import Call, Chunk, Reply

SPEC = Path(protocol.__file__).with_name("PROTOCOL.md")


def test_spec_holds_what_the_module_prints() -> None:
    assert api_vectors.render() in SPEC.read_text(encoding="utf-8")


@pytest.mark.parametrize("index", range(len(api_vectors.CASES)))
def test_each_frame_decodes_back_to_its_message(index: int) -> None:
    label, message, value = api_vectors.CASES[index]
    frame = api_vectors.frame_of(message)
    body = frame[4:]
    assert frame[:4] == frame_header(len(body))
    decoded = decode_message(body)
    assert decoded == message, label
    if isinstance(decoded, Call):
        assert from_raw(decoded.params, type(value)) == value
    elif isinstance(decoded, Reply):
        assert from_raw(decoded.result, type(value)) == value
    else:
        assert isinstance(decoded, Chunk) and decoded.stream == "output"
