"""A client and a server machine driven together through random sessions.

Theory of operation
-------------------
The state machine owns one :class:`ClientConnection` and one
:class:`ServerConnection` and two byte queues between them. Rules make either
side act (calls, cancels, answers, stream chunks within credit, grants,
pings, events) and append the bytes produced to the queue towards the peer;
delivery rules move a random number of bytes from a queue into the peer's
``receive_data``, so frames arrive split at arbitrary points. Every byte a
machine produces on its own (handshake, Pong, TOO_MANY_CALLS errors) is
drained into the queue right after the ``receive_data`` that produced it, so
the byte order on each direction is the order the machine sealed frames in.

A small model on each side plays the application: the server answers a Cancel
at once with CANCELLED, both sides grant only bytes they have received. The
model checks, as events arrive, that stream bytes arrive in order with
consecutive seqs, that every call is answered at most once, that a call's
server streams are complete when its answer arrives, and that each side's
credit equals the window minus bytes sent plus credit received. Teardown
delivers everything, answers every open call, and checks that each call got
exactly one final answer, every ping its pong and every event arrived.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from protocol import limits
from protocol.codec import from_raw, to_raw
from protocol.connection import (
    ClientConnection,
    ConnectionEvent,
    HandshakeComplete,
    ServerConnection,
    State,
)
from protocol.errors import ErrorCode, FlowControlBlocked
from protocol.fuzz.strategies import examples
from protocol.messages import (
    Call,
    Cancel,
    Chunk,
    Credit,
    Error,
    Event,
    Ping,
    Pong,
    Reply,
)

TOKEN = b"\x3c" * 32
UPLOAD_STREAMS = ("a", "b")
DOWNLOAD_STREAMS = ("a", "c")
_PERIOD = 251
PATTERN = bytes(i * 7 % _PERIOD for i in range(64 * 1024))


def pattern(offset: int, size: int) -> bytes:
    """``size`` bytes of the endless test pattern, starting at ``offset``."""
    start = offset % _PERIOD
    return PATTERN[start : start + size]


@dataclass
class StreamModel:
    """One direction of one stream, as both ends see it."""

    sent: bytearray = field(default_factory=bytearray)
    next_seq: int = 0
    ended: bool = False
    received: bytearray = field(default_factory=bytearray)
    received_seq: int = 0
    received_end: bool = False
    granted: int = 0
    credit_received: int = 0


@dataclass
class CallModel:
    """One call: its streams both ways and what answered it."""

    call_id: int
    uploads: dict[str, StreamModel] = field(default_factory=dict)
    downloads: dict[str, StreamModel] = field(default_factory=dict)
    cancelled: bool = False
    server_saw: bool = False
    server_answered: bool = False
    answers: list[Reply | Error] = field(default_factory=list)


class ConnectionPair(RuleBasedStateMachine):
    """Random sessions over a client/server pair with random delivery splits."""

    def __init__(self) -> None:
        super().__init__()
        self.client: ClientConnection | None = None
        self.server: ServerConnection | None = None
        self.c2s = bytearray()
        self.s2c = bytearray()
        self.calls: dict[int, CallModel] = {}
        self.pings: dict[str, list[int]] = {"client": [], "server": []}
        self.pongs: dict[str, list[int]] = {"client": [], "server": []}
        self.events_sent: list[int] = []
        self.events_received: list[int] = []
        self.completed: dict[str, HandshakeComplete] = {}
        self.cipher = limits.CIPHER_NONE
        self.answered_in_batch: set[int] = set()
        self.eager_grants = False
        self.deferred_grants: list[tuple[str, CallModel, str, StreamModel, int]] = []

    # -- setup ------------------------------------------------------------------

    @initialize(
        offered=st.lists(
            st.sampled_from(limits.KNOWN_CIPHERS), min_size=1, max_size=3, unique=True
        ).map(tuple),
        client_window=st.sampled_from([limits.MIN_STREAM_WINDOW, 5000, 10_000]),
        server_window=st.sampled_from([limits.MIN_STREAM_WINDOW, 5000, 10_000]),
        client_frame=st.sampled_from([limits.MIN_MAX_FRAME, 6000, 16_384]),
        server_frame=st.sampled_from([limits.MIN_MAX_FRAME, 6000, 16_384]),
        max_inflight=st.sampled_from([2, 1024, 1024]),
        eager_grants=st.booleans(),
    )
    def start(
        self,
        offered: tuple[str, ...],
        client_window: int,
        server_window: int,
        client_frame: int,
        server_frame: int,
        max_inflight: int,
        eager_grants: bool,
    ) -> None:
        self.cipher = offered[0]
        self.eager_grants = eager_grants
        self.client = ClientConnection(
            TOKEN, ciphers=offered, window=client_window, max_frame=client_frame
        )
        self.server = ServerConnection(
            TOKEN, window=server_window, max_frame=server_frame, max_inflight=max_inflight
        )
        self.c2s += self.client.data_to_send()

    # -- helpers ------------------------------------------------------------------

    @property
    def c(self) -> ClientConnection:
        assert self.client is not None
        return self.client

    @property
    def s(self) -> ServerConnection:
        assert self.server is not None
        return self.server

    def both_open(self) -> bool:
        return (
            self.client is not None
            and self.server is not None
            and self.client.state is State.OPEN
            and self.server.state is State.OPEN
        )

    def pending(self) -> list[CallModel]:
        """Calls the client has sent and not seen answered."""
        return [m for _, m in sorted(self.calls.items()) if not m.answers]

    def server_open(self) -> list[CallModel]:
        """Calls the server has surfaced and not answered."""
        return [m for _, m in sorted(self.calls.items()) if m.server_saw and not m.server_answered]

    def owed(self, side: str) -> list[tuple[CallModel, str, StreamModel]]:
        """Streams whose receiver on ``side`` has consumed bytes it has not granted yet."""
        if side == "client":
            found = [(m, n, st_) for m in self.pending() for n, st_ in m.downloads.items()]
        else:
            found = [(m, n, st_) for m in self.server_open() for n, st_ in m.uploads.items()]
        return [
            (m, n, st_)
            for m, n, st_ in sorted(found, key=lambda x: (x[0].call_id, x[1]))
            if not st_.received_end and len(st_.received) > st_.granted
        ]

    def deliver_to_server(self, n: int) -> None:
        piece = bytes(self.c2s[:n])
        del self.c2s[:n]
        self.answered_in_batch.clear()
        events = self.s.receive_data(piece)
        self.s2c += self.s.data_to_send()
        for event in events:
            self.on_server_event(event)
        self.run_deferred_grants()

    def deliver_to_client(self, n: int) -> None:
        piece = bytes(self.s2c[:n])
        del self.s2c[:n]
        events = self.c.receive_data(piece)
        self.c2s += self.c.data_to_send()
        for event in events:
            self.on_client_event(event)
        self.run_deferred_grants()

    def run_deferred_grants(self) -> None:
        """Eager grants, made once a whole batch of events has been seen.

        A later event of the same batch may have ended the stream or answered
        the call, after which there is nothing to grant.
        """
        grants, self.deferred_grants = self.deferred_grants, []
        for side, model, name, stream, n in grants:
            finished = model.answers if side == "client" else model.server_answered
            if not finished and not stream.received_end:
                self.grant(side, model, name, stream, n)

    def flush(self) -> None:
        for _ in range(10_000):
            if not self.c2s and not self.s2c:
                return
            if self.c2s:
                self.deliver_to_server(len(self.c2s))
            if self.s2c:
                self.deliver_to_client(len(self.s2c))
        raise AssertionError("the two machines never went quiet")

    def grant(self, side: str, model: CallModel, name: str, stream: StreamModel, n: int) -> None:
        conn: ClientConnection | ServerConnection = self.c if side == "client" else self.s
        frame = conn.grant(model.call_id, name, n)
        assert frame, "an open stream refused a grant"
        if side == "client":
            self.c2s += frame
        else:
            self.s2c += frame
        stream.granted += n

    def send_chunks(
        self, side: str, model: CallModel, name: str, sizes: list[int], end: bool
    ) -> None:
        """Send up to ``len(sizes)`` chunks on a stream, each within the credit."""
        conn: ClientConnection | ServerConnection = self.c if side == "client" else self.s
        streams = model.uploads if side == "client" else model.downloads
        stream = streams.setdefault(name, StreamModel())
        for i, wanted in enumerate(sizes):
            if stream.ended:
                return
            size = min(wanted, conn.stream_credit(model.call_id, name), conn.max_chunk)
            last = end and i == len(sizes) - 1
            data = pattern(len(stream.sent), size)
            frame = conn.send(
                Chunk(id=model.call_id, stream=name, seq=stream.next_seq, data=data, end=last)
            )
            if side == "client":
                self.c2s += frame
            else:
                self.s2c += frame
            stream.sent += data
            stream.next_seq += 1
            stream.ended = last

    # -- the applications ----------------------------------------------------------------

    def on_server_event(self, event: ConnectionEvent) -> None:
        if isinstance(event, HandshakeComplete):
            assert "server" not in self.completed
            assert event.cipher == self.cipher
            self.completed["server"] = event
        elif isinstance(event, Call):
            model = self.calls[event.id]
            assert not model.server_saw, "a call surfaced twice"
            assert from_raw(event.params, dict) == {"i": event.id}
            model.server_saw = True
        elif isinstance(event, Chunk):
            if event.id in self.answered_in_batch:
                return  # it came with a Cancel this application has just answered
            model = self.calls[event.id]
            assert model.server_saw and not model.server_answered
            stream = model.uploads.setdefault(event.stream, StreamModel())
            self.receive_chunk(stream, event)
            if self.eager_grants and event.data:
                self.deferred_grants.append(
                    ("server", model, event.stream, stream, len(event.data))
                )
        elif isinstance(event, Credit):
            if event.id in self.answered_in_batch:
                return
            model = self.calls[event.id]
            assert model.server_saw and not model.server_answered
            model.downloads[event.stream].credit_received += event.bytes
        elif isinstance(event, Cancel):
            model = self.calls[event.id]
            assert model.cancelled and model.server_saw and not model.server_answered
            self.server_answer(
                model, Error(id=model.call_id, code=int(ErrorCode.CANCELLED), message="cancelled")
            )
        elif isinstance(event, Pong):
            self.pongs["server"].append(event.seq)
        else:
            raise AssertionError(f"unexpected server event {event!r}")

    def on_client_event(self, event: ConnectionEvent) -> None:
        if isinstance(event, HandshakeComplete):
            assert "client" not in self.completed
            assert event.cipher == self.cipher
            self.completed["client"] = event
        elif isinstance(event, Reply | Error):
            model = self.calls[event.id]
            assert not model.answers, f"call {event.id} answered twice"
            model.answers.append(event)
            if isinstance(event, Error) and event.code == ErrorCode.TOO_MANY_CALLS:
                assert not model.server_saw
            else:
                assert model.server_answered
            for name, stream in model.downloads.items():
                assert stream.received == stream.sent, f"stream {name!r} incomplete at answer"
                assert stream.received_end == stream.ended
        elif isinstance(event, Chunk):
            model = self.calls[event.id]
            assert not model.answers
            stream = model.downloads[event.stream]
            self.receive_chunk(stream, event)
            if self.eager_grants and event.data:
                self.deferred_grants.append(
                    ("client", model, event.stream, stream, len(event.data))
                )
        elif isinstance(event, Credit):
            model = self.calls[event.id]
            assert not model.answers
            model.uploads[event.stream].credit_received += event.bytes
        elif isinstance(event, Event):
            self.events_received.append(event.topic)
        elif isinstance(event, Pong):
            self.pongs["client"].append(event.seq)
        else:
            raise AssertionError(f"unexpected client event {event!r}")

    @staticmethod
    def receive_chunk(stream: StreamModel, chunk: Chunk) -> None:
        assert not stream.received_end, "chunk after the end of its stream"
        assert chunk.seq == stream.received_seq, "chunks out of sequence"
        stream.received_seq += 1
        stream.received += chunk.data
        assert stream.sent.startswith(stream.received), "stream bytes out of order"
        stream.received_end = chunk.end

    def server_answer(self, model: CallModel, answer: Reply | Error) -> None:
        self.s2c += self.s.send(answer)
        model.server_answered = True
        self.answered_in_batch.add(model.call_id)

    # -- delivery rules ------------------------------------------------------------------

    @precondition(lambda self: self.client is not None and bool(self.c2s))
    @rule(n=st.integers(1, 20_000))
    def deliver_c2s(self, n: int) -> None:
        self.deliver_to_server(n)

    @precondition(lambda self: self.client is not None and bool(self.s2c))
    @rule(n=st.integers(1, 20_000))
    def deliver_s2c(self, n: int) -> None:
        self.deliver_to_client(n)

    @precondition(lambda self: self.client is not None and bool(self.c2s or self.s2c))
    @rule()
    def deliver_everything(self) -> None:
        self.flush()

    # -- client rules ----------------------------------------------------------------

    @precondition(lambda self: self.both_open() and len(self.pending()) < 5)
    @rule()
    def client_call(self) -> None:
        call_id = self.c.next_call_id()
        self.calls[call_id] = CallModel(call_id)
        self.c2s += self.c.send(Call(id=call_id, method="m", params=to_raw({"i": call_id})))

    @precondition(lambda self: self.both_open() and any(not m.cancelled for m in self.pending()))
    @rule(index=st.integers(0, 63))
    def client_cancel(self, index: int) -> None:
        candidates = [m for m in self.pending() if not m.cancelled]
        model = candidates[index % len(candidates)]
        model.cancelled = True
        self.c2s += self.c.send(Cancel(id=model.call_id))

    @precondition(lambda self: self.both_open() and bool(self.pending()))
    @rule(
        index=st.integers(0, 63),
        name=st.sampled_from(UPLOAD_STREAMS),
        sizes=st.lists(st.integers(0, 12_000), min_size=1, max_size=4),
        end=st.booleans(),
    )
    def client_upload(self, index: int, name: str, sizes: list[int], end: bool) -> None:
        pending = self.pending()
        self.send_chunks("client", pending[index % len(pending)], name, sizes, end)

    @precondition(lambda self: self.both_open() and bool(self.pending()))
    @rule(index=st.integers(0, 63), name=st.sampled_from(UPLOAD_STREAMS))
    def client_overrun_is_refused(self, index: int, name: str) -> None:
        pending = self.pending()
        model = pending[index % len(pending)]
        stream = model.uploads.setdefault(name, StreamModel())
        credit = self.c.stream_credit(model.call_id, name)
        if stream.ended or credit >= self.c.max_chunk:
            return
        try:
            self.c.send(
                Chunk(id=model.call_id, stream=name, seq=stream.next_seq, data=b"x" * (credit + 1))
            )
        except FlowControlBlocked:
            pass
        else:
            raise AssertionError("a chunk beyond the credit was accepted")
        assert self.c.stream_credit(model.call_id, name) == credit

    # -- server rules --------------------------------------------------------------------

    @precondition(lambda self: self.both_open() and bool(self.server_open()))
    @rule(
        index=st.integers(0, 63),
        code=st.sampled_from([0, 0, 101, 106, 200, 204, 600]),
        value=st.integers(-5, 5),
    )
    def server_answers(self, index: int, code: int, value: int) -> None:
        candidates = self.server_open()
        model = candidates[index % len(candidates)]
        answer: Reply | Error = (
            Reply(id=model.call_id, result=to_raw(value))
            if code == 0
            else Error(id=model.call_id, code=code, message="failed", data=to_raw(value))
        )
        self.server_answer(model, answer)

    @precondition(lambda self: self.both_open() and bool(self.server_open()))
    @rule(
        index=st.integers(0, 63),
        name=st.sampled_from(DOWNLOAD_STREAMS),
        sizes=st.lists(st.integers(0, 12_000), min_size=1, max_size=4),
        end=st.booleans(),
    )
    def server_download(self, index: int, name: str, sizes: list[int], end: bool) -> None:
        candidates = self.server_open()
        self.send_chunks("server", candidates[index % len(candidates)], name, sizes, end)

    @precondition(lambda self: self.both_open())
    @rule(topic=st.integers(0, limits.MAX_CALL_ID))
    def server_event(self, topic: int) -> None:
        self.events_sent.append(topic)
        self.s2c += self.s.send(Event(topic=topic, name="tick", data=to_raw(topic)))

    # -- both sides ---------------------------------------------------------------------

    @precondition(
        lambda self: self.both_open() and bool(self.owed("client") or self.owed("server"))
    )
    @rule(
        side=st.sampled_from(["client", "server"]),
        index=st.integers(0, 63),
        percent=st.integers(1, 100),
    )
    def grant_consumed(self, side: str, index: int, percent: int) -> None:
        owed = self.owed(side) or self.owed("server" if side == "client" else "client")
        side = side if self.owed(side) else ("server" if side == "client" else "client")
        model, name, stream = owed[index % len(owed)]
        amount = max(1, (len(stream.received) - stream.granted) * percent // 100)
        self.grant(side, model, name, stream, amount)

    @precondition(lambda self: self.both_open())
    @rule(side=st.sampled_from(["client", "server"]), seq=st.integers(0, limits.MAX_CALL_ID))
    def ping(self, side: str, seq: int) -> None:
        self.pings[side].append(seq)
        if side == "client":
            self.c2s += self.c.send(Ping(seq=seq))
        else:
            self.s2c += self.s.send(Ping(seq=seq))

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def nobody_closed(self) -> None:
        if self.client is not None:
            assert self.c.state is not State.CLOSED
            assert self.s.state is not State.CLOSED

    @invariant()
    def books_agree(self) -> None:
        if not self.both_open():
            return
        assert self.c.pending_calls == len(self.pending())
        assert self.s.open_calls == len(self.server_open())

    @invariant()
    def credit_is_exact_and_never_negative(self) -> None:
        if not self.both_open():
            return
        server_window = self.completed["client"].peer_window
        client_window = self.completed["server"].peer_window
        for model in self.pending():
            for name, stream in model.uploads.items():
                credit = self.c.stream_credit(model.call_id, name)
                assert 0 <= credit <= limits.MAX_STREAM_WINDOW
                if not stream.ended:
                    expected = server_window - len(stream.sent) + stream.credit_received
                    assert credit == expected
        for model in self.server_open():
            for name, stream in model.downloads.items():
                credit = self.s.stream_credit(model.call_id, name)
                assert 0 <= credit <= limits.MAX_STREAM_WINDOW
                if not stream.ended:
                    expected = client_window - len(stream.sent) + stream.credit_received
                    assert credit == expected

    # -- the end ------------------------------------------------------------------------

    def teardown(self) -> None:
        # Hypothesis calls teardown from a ``finally``: when a step has failed (or
        # the run was cut short) its exception is in flight, and running the final
        # checks on a half-updated model would only mask it.
        if self.client is None or sys.exc_info()[1] is not None:
            return
        self.flush()
        assert self.both_open()
        assert set(self.completed) == {"client", "server"}
        for model in self.server_open():
            for name, stream in model.uploads.items():
                assert stream.received == stream.sent, f"upload {name!r} incomplete"
                assert stream.received_end == stream.ended
            self.server_answer(model, Reply(id=model.call_id))
        self.flush()
        for model in self.calls.values():
            assert len(model.answers) == 1, f"call {model.call_id}: {model.answers}"
        assert self.c.pending_calls == 0 and self.s.open_calls == 0
        assert self.pongs == self.pings
        assert self.events_received == self.events_sent


ConnectionPair.TestCase.settings = settings(
    max_examples=examples(100),
    stateful_step_count=60,
    deadline=None,
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)
TestConnectionPair = ConnectionPair.TestCase
