"""Property tests of your own, built on the kit's public strategies and state machine.

Run it with pytest (each ``test_*`` is collected) or as a program.
"""

import unittest

import msgspec
from hypothesis import given, settings

from protocol import limits
from protocol.codec import decode_message, encode_message
from protocol.errors import ProtocolError
from protocol.framing import FrameReader
from protocol.fuzz import strategies as fz
from protocol.fuzz.loopback import LoopbackTarget
from protocol.fuzz.machine import connection_machine
from protocol.messages import Message
from protocol.rpc import files

TOKEN = b"a high-entropy secret of 32 byte"


# property_settings: no deadline, and example counts that follow the hypothesis profile.
@fz.property_settings(200)
@given(fz.any_message)
def test_every_message_round_trips(message: Message) -> None:
    assert decode_message(encode_message(message)) == message


@fz.property_settings()
@given(fz.params_for(files.READ))  # params valid by the method's declaration
def test_read_params_decode(params: dict[str, object]) -> None:
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=files.READ.params)
    assert decoded.path == params["path"]


@fz.property_settings()
@given(fz.frames().flatmap(fz.mutations))  # byte-level mutations of whole frames
def test_the_frame_reader_survives_mutations(data: bytes) -> None:
    reader = FrameReader(limits.PREAUTH_MAX_FRAME)
    try:
        reader.feed(data)
        while (body := reader.next_frame()) is not None:
            decode_message(body)
    except ProtocolError:
        pass  # refusing bad bytes with a protocol error is the one allowed failure


# The connection state machine against the reference server in this process; a live
# server is a SocketTarget("127.0.0.1", port) from protocol.fuzz.live instead.
TestConnection = connection_machine(lambda: LoopbackTarget(TOKEN), TOKEN).TestCase
TestConnection.settings = settings(max_examples=20, stateful_step_count=20, deadline=None)


if __name__ == "__main__":
    test_every_message_round_trips()
    test_read_params_decode()
    test_the_frame_reader_survives_mutations()
    unittest.main(defaultTest="TestConnection", argv=["fuzz_properties"], exit=True)
