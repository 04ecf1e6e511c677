"""The open connection: calls matched by id, in-flight limits, flow control, ping, abort.

Misbehaving peers are simulated with hand-built frames (on a connection that
negotiated no cipher), which bypass every check the sending machine would make.
"""

from __future__ import annotations

import pytest

from protocol import limits
from protocol.codec import ENCODER, decode_message, from_raw, to_raw
from protocol.connection import (
    ClientConnection,
    ConnectionEvent,
    HandshakeComplete,
    ServerConnection,
    State,
)
from protocol.errors import (
    DuplicateCallId,
    ErrorCode,
    FlowControlBlocked,
    FlowControlViolation,
    InvalidMessage,
    LocalProtocolError,
    MalformedMessage,
    UnexpectedMessage,
)
from protocol.framing import FrameReader, encode_frame
from protocol.messages import (
    Abort,
    Call,
    Cancel,
    Chunk,
    Credit,
    Error,
    Event,
    Hello,
    Message,
    Ping,
    Pong,
    Reply,
)

TOKEN = b"\x42" * 32
WINDOW = limits.MIN_STREAM_WINDOW
CAP = 64 * 1024


def open_pair(
    cipher: str = limits.CIPHER_NONE,
    *,
    window: int = WINDOW,
    max_frame: int = CAP,
    max_inflight: int = 1024,
) -> tuple[ClientConnection, ServerConnection]:
    client = ClientConnection(TOKEN, ciphers=(cipher,), window=window, max_frame=max_frame)
    server = ServerConnection(TOKEN, window=window, max_frame=max_frame, max_inflight=max_inflight)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    events = client.receive_data(server.data_to_send())
    assert [type(e) for e in events] == [HandshakeComplete]
    assert client.state is State.OPEN and server.state is State.OPEN
    return client, server


def raw(message: Message) -> bytes:
    """A plaintext frame, built without any state machine's checks."""
    return bytes(encode_frame(ENCODER, message, limits.MAX_MAX_FRAME))


def messages(data: bytes) -> list[Message]:
    reader = FrameReader(limits.MAX_MAX_FRAME)
    reader.feed(data)
    out = []
    while (body := reader.next_frame()) is not None:
        out.append(decode_message(body))
    return out


def call(client: ClientConnection, server: ServerConnection, method: str = "m") -> int:
    call_id = client.next_call_id()
    events = server.receive_data(client.send(Call(id=call_id, method=method)))
    assert events == [Call(id=call_id, method=method)]
    return call_id


def assert_server_aborted(
    client: ClientConnection, server: ServerConnection, code: ErrorCode
) -> None:
    """The server has closed, and all the client hears of it is one Abort with ``code``."""
    assert server.state is State.CLOSED
    events = client.receive_data(server.data_to_send())
    assert len(events) == 1 and isinstance(events[0], Abort)
    assert events[0].code == int(code)


# -- calls ----------------------------------------------------------------------------------


def test_call_ids_count_up_from_one() -> None:
    client, _ = open_pair()
    assert [client.next_call_id() for _ in range(3)] == [1, 2, 3]


def test_replies_and_errors_are_matched_by_id() -> None:
    client, server = open_pair()
    ids = [call(client, server, f"method.{i}") for i in range(3)]
    assert client.pending_calls == 3 and server.open_calls == 3
    answers = [
        Reply(id=ids[2], result=to_raw({"n": 3})),
        Error(id=ids[0], code=int(ErrorCode.NOT_FOUND), message="no", data=to_raw({"p": "/"})),
        Reply(id=ids[1]),
    ]
    for expected_open, answer in zip((2, 1, 0), answers, strict=True):
        events = client.receive_data(server.send(answer))
        assert events == [answer]
        assert server.open_calls == expected_open
        assert client.pending_calls == expected_open
    reply = answers[0]
    assert isinstance(reply, Reply)
    assert from_raw(reply.result, dict) == {"n": 3}


def test_an_answered_id_may_be_reused() -> None:
    client, server = open_pair()
    assert server.receive_data(client.send(Call(id=9, method="a"))) == [Call(id=9, method="a")]
    client.receive_data(server.send(Reply(id=9)))
    assert server.receive_data(client.send(Call(id=9, method="b"))) == [Call(id=9, method="b")]


def test_answer_to_a_call_not_in_flight_closes_the_client() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    client.receive_data(server.send(Reply(id=call_id)))
    with pytest.raises(UnexpectedMessage):
        client.receive_data(raw(Reply(id=call_id)))
    assert client.state is State.CLOSED
    abort = messages(client.data_to_send())
    assert [type(m) for m in abort] == [Abort]
    assert isinstance(abort[0], Abort) and abort[0].code == int(ErrorCode.UNEXPECTED_MESSAGE)


def test_duplicate_call_id_is_a_protocol_error() -> None:
    client, server = open_pair()
    server.receive_data(raw(Call(id=5, method="a")))
    with pytest.raises(DuplicateCallId) as info:
        server.receive_data(raw(Call(id=5, method="b")))
    assert info.value.code is ErrorCode.DUPLICATE_CALL_ID
    assert_server_aborted(client, server, ErrorCode.DUPLICATE_CALL_ID)
    assert client.state is State.CLOSED


def test_client_refuses_to_send_a_duplicate_id() -> None:
    client, _ = open_pair()
    client.send(Call(id=1, method="a"))
    with pytest.raises(LocalProtocolError):
        client.send(Call(id=1, method="b"))
    assert client.pending_calls == 1


def test_too_many_calls_get_an_error_without_closing() -> None:
    client, server = open_pair(max_inflight=2)
    first = call(client, server)
    call(client, server)
    third = client.next_call_id()
    assert server.receive_data(client.send(Call(id=third, method="m"))) == []
    assert server.state is State.OPEN and server.open_calls == 2
    events = client.receive_data(server.data_to_send())
    assert len(events) == 1 and isinstance(events[0], Error)
    assert events[0].id == third and events[0].code == int(ErrorCode.TOO_MANY_CALLS)
    assert client.pending_calls == 2
    # Chunks for the refused call are dropped; a new call fits once one finishes.
    assert server.receive_data(raw(Chunk(id=third, stream="s", seq=0, data=b"x"))) == []
    client.receive_data(server.send(Reply(id=first)))
    call(client, server)
    assert server.open_calls == 2


def test_cancel_is_surfaced_and_the_call_still_gets_its_answer() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    assert server.receive_data(client.send(Cancel(id=call_id))) == [Cancel(id=call_id)]
    assert client.pending_calls == 1
    cancelled = Error(id=call_id, code=int(ErrorCode.CANCELLED), message="cancelled")
    assert client.receive_data(server.send(cancelled)) == [cancelled]
    assert client.pending_calls == 0


def test_cancel_for_an_unknown_call_is_ignored_by_the_server() -> None:
    client, server = open_pair()
    assert server.receive_data(raw(Cancel(id=77))) == []
    assert server.state is State.OPEN
    with pytest.raises(LocalProtocolError):
        client.send(Cancel(id=77))


def test_cancel_racing_the_answer_is_ignored() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    reply = server.send(Reply(id=call_id))
    cancel = client.send(Cancel(id=call_id))
    assert server.receive_data(cancel) == []
    assert client.receive_data(reply) == [Reply(id=call_id)]
    assert server.state is State.OPEN and client.state is State.OPEN


def test_events_reach_the_client() -> None:
    client, server = open_pair()
    event = Event(topic=3, name="modified", data=to_raw({"path": "/w/f"}))
    assert client.receive_data(server.send(event)) == [event]


# -- direction and state -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [Reply(id=1), Error(id=1, code=1), Event(topic=1, name="e")],
    ids=["reply", "error", "event"],
)
def test_server_rejects_messages_only_a_server_sends(message: Message) -> None:
    _, server = open_pair()
    with pytest.raises(UnexpectedMessage):
        server.receive_data(raw(message))
    assert server.state is State.CLOSED


@pytest.mark.parametrize("message", [Call(id=1, method="m"), Cancel(id=1)], ids=["call", "cancel"])
def test_client_rejects_messages_only_a_client_sends(message: Message) -> None:
    client, _ = open_pair()
    with pytest.raises(UnexpectedMessage):
        client.receive_data(raw(message))
    assert client.state is State.CLOSED


def test_sending_during_the_handshake_is_a_local_error() -> None:
    client = ClientConnection(TOKEN)
    server = ServerConnection(TOKEN)
    with pytest.raises(LocalProtocolError):
        client.send(Call(id=1, method="m"))
    with pytest.raises(LocalProtocolError):
        client.send(Ping(seq=1))
    with pytest.raises(LocalProtocolError):
        server.send(Event(topic=1, name="e"))
    assert client.state is State.HANDSHAKE and server.state is State.HANDSHAKE


@pytest.mark.parametrize(
    "message",
    [
        Reply(id=1),
        Event(topic=1, name="e"),
        Hello(versions=[1], nonce=b"\x00" * 32, ciphers=["none"], max_frame=4096, window=4096),
        Chunk(id=99, stream="s", seq=0),
        Cancel(id=99),
    ],
    ids=["reply", "event", "hello", "chunk-unknown-call", "cancel-unknown-call"],
)
def test_client_sending_the_wrong_message_is_a_local_error(message: Message) -> None:
    client, _ = open_pair()
    with pytest.raises(LocalProtocolError):
        client.send(message)
    assert client.state is State.OPEN


@pytest.mark.parametrize(
    "message",
    [Call(id=1, method="m"), Cancel(id=1), Reply(id=99), Chunk(id=99, stream="s", seq=0)],
    ids=["call", "cancel", "reply-unknown-call", "chunk-unknown-call"],
)
def test_server_sending_the_wrong_message_is_a_local_error(message: Message) -> None:
    _, server = open_pair()
    with pytest.raises(LocalProtocolError):
        server.send(message)
    assert server.state is State.OPEN


def test_server_sends_nothing_for_a_call_after_its_answer() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    server.send(Reply(id=call_id))
    with pytest.raises(LocalProtocolError):
        server.send(Chunk(id=call_id, stream="out", seq=0, data=b"late"))
    with pytest.raises(LocalProtocolError):
        server.send(Error(id=call_id, code=int(ErrorCode.INTERNAL)))


def test_garbage_after_the_handshake_closes_with_an_abort() -> None:
    client, server = open_pair()
    with pytest.raises(MalformedMessage):
        server.receive_data(b"\x00\x00\x00\x01\xc1")
    assert_server_aborted(client, server, ErrorCode.MALFORMED_MESSAGE)


# -- flow control -----------------------------------------------------------------------------


def test_initial_credit_is_the_receivers_announced_window() -> None:
    client = ClientConnection(TOKEN, window=8192)
    server = ServerConnection(TOKEN, window=20_000)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    call_id = client.next_call_id()
    server.receive_data(client.send(Call(id=call_id, method="m")))
    assert client.stream_credit(call_id, "up") == 20_000
    assert server.stream_credit(call_id, "down") == 8192


def test_sender_is_blocked_beyond_its_credit() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    with pytest.raises(FlowControlBlocked):
        client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x" * (WINDOW + 1)))
    assert client.stream_credit(call_id, "up") == WINDOW
    server.receive_data(client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x" * 1000)))
    assert client.stream_credit(call_id, "up") == WINDOW - 1000
    client.send(Chunk(id=call_id, stream="up", seq=1, data=b"x" * (WINDOW - 1000)))
    assert client.stream_credit(call_id, "up") == 0
    with pytest.raises(FlowControlBlocked):
        client.send(Chunk(id=call_id, stream="up", seq=2, data=b"x"))
    # An empty chunk costs nothing and may always be sent.
    client.send(Chunk(id=call_id, stream="up", seq=2))
    assert issubclass(FlowControlBlocked, LocalProtocolError)


def test_receiver_detects_an_overrun() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    server.receive_data(raw(Chunk(id=call_id, stream="up", seq=0, data=b"x" * (WINDOW - 1))))
    server.receive_data(raw(Chunk(id=call_id, stream="up", seq=1, data=b"x")))
    with pytest.raises(FlowControlViolation) as info:
        server.receive_data(raw(Chunk(id=call_id, stream="up", seq=2, data=b"x")))
    assert info.value.code is ErrorCode.FLOW_CONTROL_VIOLATION
    assert_server_aborted(client, server, ErrorCode.FLOW_CONTROL_VIOLATION)


def test_client_detects_a_server_overrun() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    with pytest.raises(FlowControlViolation):
        client.receive_data(raw(Chunk(id=call_id, stream="out", seq=0, data=b"x" * (WINDOW + 1))))


def test_grant_reopens_a_blocked_stream() -> None:
    client, server = open_pair(limits.CIPHER_CHACHA20)
    call_id = call(client, server)
    events = server.receive_data(
        client.send(Chunk(id=call_id, stream="up", seq=0, data=b"a" * WINDOW))
    )
    assert events == [Chunk(id=call_id, stream="up", seq=0, data=b"a" * WINDOW)]
    assert client.stream_credit(call_id, "up") == 0
    credit_frame = server.grant(call_id, "up", 1500)
    assert client.receive_data(credit_frame) == [Credit(id=call_id, stream="up", bytes=1500)]
    assert client.stream_credit(call_id, "up") == 1500
    events = server.receive_data(
        client.send(Chunk(id=call_id, stream="up", seq=1, data=b"b" * 1500))
    )
    assert len(events) == 1
    with pytest.raises(FlowControlBlocked):
        client.send(Chunk(id=call_id, stream="up", seq=2, data=b"c"))


def test_grant_reopens_a_server_stream() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    client.receive_data(server.send(Chunk(id=call_id, stream="out", seq=0, data=b"o" * WINDOW)))
    assert server.stream_credit(call_id, "out") == 0
    server.receive_data(client.grant(call_id, "out", WINDOW))
    assert server.stream_credit(call_id, "out") == WINDOW


def test_grant_is_empty_when_there_is_nothing_to_grant() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    assert server.grant(call_id, "never-opened", 10) == b""
    server.receive_data(client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x")))
    assert server.grant(call_id, "up", 0) == b""
    server.receive_data(client.send(Chunk(id=call_id, stream="up", seq=1, end=True)))
    assert server.grant(call_id, "up", 1) == b""
    server.receive_data(client.send(Chunk(id=call_id, stream="u2", seq=0, data=b"x")))
    assert server.grant(call_id, "u2", 1) != b""
    client.receive_data(server.send(Reply(id=call_id)))
    assert server.grant(call_id, "u2", 1) == b""


def test_credit_beyond_the_largest_window_is_a_violation() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x"))
    with pytest.raises(FlowControlViolation):
        client.receive_data(raw(Credit(id=call_id, stream="up", bytes=limits.MAX_STREAM_WINDOW)))
    assert client.state is State.CLOSED


def test_chunks_and_credits_for_finished_calls_are_dropped() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    server.receive_data(client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x" * 100)))
    reply = server.send(Reply(id=call_id))
    # The client, not yet aware of the reply, keeps uploading; the server drops it.
    late_chunk = client.send(Chunk(id=call_id, stream="up", seq=1, data=b"y" * 100))
    assert server.receive_data(late_chunk) == []
    assert server.receive_data(raw(Credit(id=call_id, stream="down", bytes=10))) == []
    assert server.state is State.OPEN
    assert client.receive_data(reply) == [Reply(id=call_id)]
    # Strays for calls the client no longer has are dropped too.
    assert client.receive_data(raw(Chunk(id=call_id, stream="out", seq=0, data=b"z"))) == []
    assert client.receive_data(raw(Credit(id=call_id, stream="up", bytes=10))) == []
    assert client.receive_data(raw(Chunk(id=12345, stream="out", seq=0, data=b"z"))) == []
    assert client.state is State.OPEN


def test_chunk_data_is_bounded_by_max_chunk() -> None:
    client, server = open_pair(limits.CIPHER_AESGCM, window=limits.MAX_STREAM_WINDOW)
    call_id = call(client, server)
    assert client.max_chunk == CAP - limits.CHUNK_OVERHEAD - limits.AEAD_TAG_SIZE
    with pytest.raises(LocalProtocolError):
        client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x" * (client.max_chunk + 1)))
    frame = client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x" * client.max_chunk))
    assert len(frame) <= CAP + limits.HEADER_SIZE
    assert len(server.receive_data(frame)) == 1


def test_too_many_stream_names_on_one_call() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    for i in range(2 * limits.MAX_STREAMS_PER_CALL):
        server.receive_data(raw(Chunk(id=call_id, stream=f"s{i}", seq=0, data=b"x")))
    with pytest.raises(InvalidMessage):
        server.receive_data(raw(Chunk(id=call_id, stream="one-too-many", seq=0)))


def test_streams_in_both_directions_are_independent() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    server.receive_data(client.send(Chunk(id=call_id, stream="data", seq=0, data=b"u" * WINDOW)))
    client.receive_data(server.send(Chunk(id=call_id, stream="data", seq=0, data=b"d" * 10)))
    assert client.stream_credit(call_id, "data") == 0
    assert server.stream_credit(call_id, "data") == WINDOW - 10


# -- ping, abort, close ----------------------------------------------------------------------------


@pytest.mark.parametrize("cipher", [limits.CIPHER_NONE, limits.CIPHER_AESGCM])
def test_ping_is_answered_automatically(cipher: str) -> None:
    client, server = open_pair(cipher)
    assert server.receive_data(client.send(Ping(seq=41))) == []
    assert client.receive_data(server.data_to_send()) == [Pong(seq=41)]
    assert client.receive_data(server.send(Ping(seq=42))) == []
    assert server.receive_data(client.data_to_send()) == [Pong(seq=42)]


def test_unsolicited_pong_is_harmless() -> None:
    client, server = open_pair()
    assert server.receive_data(client.send(Pong(seq=3))) == [Pong(seq=3)]
    assert server.state is State.OPEN


@pytest.mark.parametrize("cipher", [limits.CIPHER_NONE, limits.CIPHER_CHACHA20])
def test_abort_closes_and_later_frames_are_ignored(cipher: str) -> None:
    client, server = open_pair(cipher)
    call_id = client.next_call_id()
    call_frame = client.send(Call(id=call_id, method="m"))
    abort_frame = server.close(ErrorCode.SHUTTING_DOWN, "bye")
    assert server.state is State.CLOSED
    assert server.close() == b""
    trailing = raw(Event(topic=1, name="after-abort"))
    events: list[ConnectionEvent] = client.receive_data(abort_frame + trailing)
    assert events == [Abort(code=int(ErrorCode.SHUTTING_DOWN), message="bye")]
    assert client.state is State.CLOSED
    assert client.receive_data(b"more bytes") == []
    assert server.receive_data(call_frame) == []
    with pytest.raises(LocalProtocolError):
        client.send(Call(id=client.next_call_id(), method="m"))
    with pytest.raises(LocalProtocolError):
        server.send(Event(topic=1, name="e"))
    assert client.grant(call_id, "s", 1) == b""


def test_close_defaults_to_going_away_and_truncates_the_message() -> None:
    client, server = open_pair()
    frame = client.close(message="m" * (limits.MAX_ERROR_MESSAGE + 100))
    events = server.receive_data(frame)
    assert len(events) == 1 and isinstance(events[0], Abort)
    assert events[0].code == int(ErrorCode.GOING_AWAY)
    assert len(events[0].message) == limits.MAX_ERROR_MESSAGE
    assert server.state is State.CLOSED


def test_abort_during_handshake_on_the_server_side() -> None:
    client = ClientConnection(TOKEN)
    server = ServerConnection(TOKEN)
    server.receive_data(client.data_to_send())
    events = server.receive_data(client.close(ErrorCode.HANDSHAKE_TIMEOUT))
    assert events == [Abort(code=int(ErrorCode.HANDSHAKE_TIMEOUT))]
    assert server.state is State.CLOSED


# -- state is committed only for frames that exist; streams end for good ---------------------------


def test_call_too_large_for_a_frame_leaves_no_trace() -> None:
    client, server = open_pair(max_frame=limits.MIN_MAX_FRAME)
    big = Call(id=5, method="m", params=to_raw(b"x" * 2 * limits.MIN_MAX_FRAME))
    with pytest.raises(LocalProtocolError):
        client.send(big)
    assert client.pending_calls == 0
    assert server.receive_data(client.send(Call(id=5, method="m"))) == [Call(id=5, method="m")]


def test_reply_too_large_leaves_the_call_answerable() -> None:
    client, server = open_pair(max_frame=limits.MIN_MAX_FRAME)
    call_id = call(client, server)
    with pytest.raises(LocalProtocolError):
        server.send(Reply(id=call_id, result=to_raw(b"x" * 2 * limits.MIN_MAX_FRAME)))
    assert server.open_calls == 1
    error = Error(id=call_id, code=int(ErrorCode.TOO_LARGE), message="result too large")
    assert client.receive_data(server.send(error)) == [error]


def test_unframeable_chunk_keeps_its_credit() -> None:
    client, server = open_pair(max_frame=limits.MIN_MAX_FRAME)
    call_id = call(client, server)
    name = "\U0001f600" * limits.MAX_NAME
    before = client.stream_credit(call_id, name)
    with pytest.raises(LocalProtocolError):
        client.send(Chunk(id=call_id, stream=name, seq=0, data=b"x" * (client.max_chunk + 1)))
    assert client.stream_credit(call_id, name) == before
    frame = client.send(Chunk(id=call_id, stream=name, seq=0, data=b"x" * client.max_chunk))
    assert len(server.receive_data(frame)) == 1
    assert client.stream_credit(call_id, name) == before - client.max_chunk


def test_a_max_chunk_sized_chunk_always_fits() -> None:
    client, server = open_pair(max_frame=limits.MIN_MAX_FRAME)
    call_id = call(client, server)
    name = "\U0001f600" * limits.MAX_NAME
    frame = client.send(Chunk(id=call_id, stream=name, seq=0, data=b"x" * client.max_chunk))
    assert len(server.receive_data(frame)) == 1


def test_chunk_after_end_is_a_flow_control_violation() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    server.receive_data(raw(Chunk(id=call_id, stream="up", seq=0, data=b"x" * WINDOW, end=True)))
    with pytest.raises(FlowControlViolation):
        server.receive_data(raw(Chunk(id=call_id, stream="up", seq=1, data=b"x", end=True)))
    assert_server_aborted(client, server, ErrorCode.FLOW_CONTROL_VIOLATION)


def test_sender_cannot_reopen_an_ended_stream() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    server.receive_data(client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x", end=True)))
    with pytest.raises(LocalProtocolError):
        client.send(Chunk(id=call_id, stream="up", seq=1, data=b"y"))
    # A finished call forgets its streams: the id and the name can be used again.
    client.receive_data(server.send(Reply(id=call_id)))
    server.receive_data(client.send(Call(id=call_id, method="again")))
    events = server.receive_data(client.send(Chunk(id=call_id, stream="up", seq=0, data=b"z")))
    assert events == [Chunk(id=call_id, stream="up", seq=0, data=b"z")]


def test_credit_crossing_the_end_of_a_stream_is_harmless() -> None:
    client, server = open_pair(window=limits.MAX_STREAM_WINDOW)
    call_id = call(client, server)
    server.receive_data(client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x" * 10)))
    credit = server.grant(call_id, "up", 10)
    last = client.send(Chunk(id=call_id, stream="up", seq=1, data=b"y", end=True))
    client.receive_data(credit)
    assert client.state is State.OPEN
    assert len(server.receive_data(last)) == 1


def test_credit_for_a_stream_never_opened_is_ignored() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    server.receive_data(client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x")))
    for i in range(100):
        client.receive_data(raw(Credit(id=call_id, stream=f"never-{i}", bytes=1000)))
    assert client.stream_credit(call_id, "never-7") == WINDOW


def test_welcome_info_must_fit_the_preauth_cap() -> None:
    with pytest.raises(ValueError, match="pre-authentication"):
        ServerConnection(TOKEN, info={"banner": "x" * limits.PREAUTH_MAX_FRAME})
    info: dict[str, str | int] = {"banner": "x" * 3000, "pid": 1}
    server = ServerConnection(TOKEN, info=info)
    client = ClientConnection(TOKEN)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    events = client.receive_data(server.data_to_send())
    assert isinstance(events[0], HandshakeComplete) and events[0].info == info


def test_chunk_out_of_sequence_is_a_protocol_error() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    server.receive_data(raw(Chunk(id=call_id, stream="up", seq=0, data=b"a")))
    with pytest.raises(InvalidMessage):
        server.receive_data(raw(Chunk(id=call_id, stream="up", seq=2, data=b"b")))
    assert server.state is State.CLOSED


def test_grant_beyond_the_largest_window_is_refused_locally() -> None:
    client, server = open_pair()
    call_id = call(client, server)
    server.receive_data(client.send(Chunk(id=call_id, stream="up", seq=0, data=b"x")))
    with pytest.raises(LocalProtocolError):
        server.grant(call_id, "up", limits.MAX_STREAM_WINDOW + 1)
    assert server.state is State.OPEN
