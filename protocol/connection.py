"""Sans-I/O connection state machines for the two roles.

Theory of operation
-------------------
A connection object owns no socket. The caller feeds it received bytes with
:meth:`Connection.receive_data`, which returns the events they complete, and
asks it for the bytes of outgoing messages with :meth:`Connection.send`.
Bytes the machine produces on its own (handshake replies, Pong answers, the
Abort before a close) collect in an outbox that the caller drains with
:meth:`Connection.data_to_send` after every ``receive_data``.

States: ``HANDSHAKE`` -> ``OPEN`` -> ``CLOSED``. During the handshake only
the four handshake messages are accepted, each at most
:data:`~protocol.limits.PREAUTH_MAX_FRAME` bytes. When both proofs have
verified, a :class:`HandshakeComplete` event is emitted, the frame cap becomes
the negotiated one and, if a cipher was agreed, every later frame in each
direction is sealed (client -> server from the frame after Auth, server ->
client from the frame after Welcome).

Once open, the machine keeps the books the peer could abuse:

* calls in flight, matched by id: a server rejects a duplicate id (protocol
  error) and answers calls beyond its in-flight limit with a TOO_MANY_CALLS
  Error without surfacing them; a client rejects answers to calls it never
  made;
* per-stream credit, in data bytes, for each ``(call id, stream)`` in both
  directions: a receiver starts every stream with the window it announced in
  the handshake, a sender may not exceed what it has been granted
  (:class:`~protocol.errors.FlowControlBlocked`) and a peer that does is cut
  off (:class:`~protocol.errors.FlowControlViolation`). Credit grows only when
  the receiving application calls :meth:`Connection.grant` after consuming
  data, so a slow reader bounds what the sender can have in flight.

Any violation raises a :class:`~protocol.errors.RemoteProtocolError`: the machine
moves to ``CLOSED`` and leaves an Abort frame in the outbox for the caller to
send before closing the socket. Chunks and credits for calls that have already
finished are dropped silently: they are the normal race with a final answer.
"""

from __future__ import annotations

import enum
import secrets
import struct
from dataclasses import dataclass, field
from typing import Final

from protocol import limits
from protocol.aead import FrameOpener, FrameSealer
from protocol.codec import ENCODER, decode_message
from protocol.errors import (
    AuthenticationFailed,
    DuplicateCallId,
    ErrorCode,
    FlowControlBlocked,
    FlowControlViolation,
    InvalidMessage,
    LocalProtocolError,
    RemoteProtocolError,
    UnexpectedMessage,
    UnsupportedCipher,
    VersionMismatch,
)
from protocol.framing import FrameReader, encode_frame, frame_header
from protocol.handshake import (
    Negotiated,
    choose_cipher,
    choose_version,
    client_mac,
    derive_keys,
    server_mac,
    transcript,
    verify_mac,
)
from protocol.messages import (
    Abort,
    Auth,
    Call,
    Cancel,
    Challenge,
    Chunk,
    Credit,
    Error,
    Event,
    Hello,
    Message,
    Ping,
    Pong,
    Reply,
    Welcome,
)

_HEADER: Final = struct.Struct(">I")


class State(enum.Enum):
    """Where a connection is in its life."""

    HANDSHAKE = "handshake"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class HandshakeComplete:
    """Both sides proved the token; the connection is open."""

    version: int
    cipher: str
    peer_max_frame: int
    peer_window: int
    info: dict[str, str | int] = field(default_factory=dict)


ConnectionEvent = HandshakeComplete | Message
StreamKey = tuple[int, str]


def _check_limits(max_frame: int, window: int) -> None:
    if not limits.MIN_MAX_FRAME <= max_frame <= limits.MAX_MAX_FRAME:
        raise InvalidMessage(f"announced frame cap {max_frame} is outside the allowed range")
    if not limits.MIN_STREAM_WINDOW <= window <= limits.MAX_STREAM_WINDOW:
        raise InvalidMessage(f"announced stream window {window} is outside the allowed range")


class Connection:
    """What both roles share: framing, sealing, streams and credit."""

    def __init__(self, token: bytes, *, max_frame: int, window: int) -> None:
        if not token:
            raise ValueError("an empty token cannot authenticate anything")
        _check_limits(max_frame, window)
        self._token = token
        self.max_frame = max_frame
        self.window = window
        self.state = State.HANDSHAKE
        self.peer_max_frame = limits.PREAUTH_MAX_FRAME
        self.peer_window = limits.MIN_STREAM_WINDOW
        self.cipher = limits.CIPHER_NONE
        self.version = 0
        self._reader = FrameReader(limits.PREAUTH_MAX_FRAME)
        self._outbox = bytearray()
        self._sealer: FrameSealer | None = None
        self._opener: FrameOpener | None = None
        self._send_credit: dict[StreamKey, int] = {}
        self._recv_left: dict[StreamKey, int] = {}
        self._streams: dict[int, set[str]] = {}
        self._send_ended: set[StreamKey] = set()
        self._recv_ended: set[StreamKey] = set()
        self._recv_seq: dict[StreamKey, int] = {}
        self._negotiated: Negotiated | None = None
        self._expect: type[Message] = Hello

    # -- public API ---------------------------------------------------------

    @property
    def server_nonce(self) -> bytes:
        """The server's nonce, in the transcript: names the connection (PROTOCOL.md 8.1)."""
        return self._negotiated.server_nonce if self._negotiated is not None else b""

    @property
    def buffered(self) -> int:
        """Received bytes waiting for the rest of their frame."""
        return self._reader.buffered

    @property
    def max_chunk(self) -> int:
        """The largest data payload one Chunk to the peer may carry."""
        overhead = limits.CHUNK_OVERHEAD + (limits.AEAD_TAG_SIZE if self._sealer else 0)
        return self.peer_max_frame - overhead

    def data_to_send(self) -> bytes:
        """Bytes the machine produced on its own since the last call."""
        if not self._outbox:
            return b""
        out = bytes(self._outbox)
        self._outbox.clear()
        return out

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[ConnectionEvent]:
        """Feed received bytes; return the events they complete.

        Raises RemoteProtocolError on any violation; the state is then CLOSED and the
        outbox holds an Abort frame.
        """
        if self.state is State.CLOSED:
            return []
        self._reader.feed(data)
        return self._process()

    def get_buffer(self) -> memoryview:
        """Where to receive the next bytes in place (``recv_into``); never empty.

        Follow with :meth:`buffer_updated`: together they are
        :meth:`receive_data` without the copy of large frame bodies.
        """
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> list[ConnectionEvent]:
        """``nbytes`` arrived in the buffer of :meth:`get_buffer`; return the events completed.

        Raises RemoteProtocolError exactly as :meth:`receive_data` does.
        """
        if self.state is State.CLOSED:
            return []
        self._reader.buffer_updated(nbytes)
        return self._process()

    def _process(self) -> list[ConnectionEvent]:
        reader = self._reader
        events: list[ConnectionEvent] = []
        try:
            # A frame may close the connection: look at the state before each.
            while self.state is not State.CLOSED:
                frame = reader.next_frame()
                if frame is None:
                    break
                body = frame
                if self._opener is not None:
                    body = self._opener.open(frame_header(len(frame)), frame)
                message = decode_message(body)
                if body is not frame or type(message) is Chunk:
                    # Nothing refers to the received buffer any more: a
                    # Chunk's data is a copy (only Raw payloads point into
                    # the buffer they were decoded from).
                    reader.recycle(frame)
                self._handle(message, events)
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise
        return events

    def send(self, message: Message) -> bytes | bytearray:
        """The framed (and, once negotiated, sealed) bytes of ``message``.

        Raises LocalProtocolError when the message is not allowed now, and
        FlowControlBlocked when a chunk exceeds the granted credit.
        """
        if self.state is not State.OPEN:
            raise LocalProtocolError(f"cannot send {type(message).__name__} in state {self.state}")
        # Check, frame, and only then commit: a message that cannot be framed
        # (too large for the peer's cap) leaves no trace in the books.
        self._check_send(message)
        frame = self._frame(message)
        self._commit_send(message)
        return frame

    def stream_credit(self, call_id: int, stream: str) -> int:
        """How many data bytes may be sent on ``(call_id, stream)`` right now."""
        return self._send_credit.get((call_id, stream), self.peer_window)

    def grant(self, call_id: int, stream: str, nbytes: int) -> bytes | bytearray:
        """Let the peer send ``nbytes`` more on a stream whose data was consumed.

        Returns the Credit frame to send, or empty bytes when the stream has
        already finished (nothing more will come on it).
        """
        key = (call_id, stream)
        if nbytes > limits.MAX_STREAM_WINDOW:
            raise LocalProtocolError(f"a grant of {nbytes} bytes exceeds the largest window")
        if nbytes <= 0 or key not in self._recv_left or self.state is not State.OPEN:
            return b""
        self._recv_left[key] += nbytes
        return self._frame(Credit(id=call_id, stream=stream, bytes=nbytes))

    def ping(self, seq: int) -> bytes | bytearray:
        """A Ping frame; the peer answers with a Pong event carrying ``seq``."""
        return self.send(Ping(seq=seq))

    def close(self, code: ErrorCode = ErrorCode.GOING_AWAY, message: str = "") -> bytes:
        """Move to CLOSED; return an Abort frame to send first (empty if already closed)."""
        if self.state is State.CLOSED:
            return b""
        out = bytes(self._abort_frame(code, message))
        self.state = State.CLOSED
        return out

    # -- role hooks ---------------------------------------------------------

    def _handle(self, message: Message, events: list[ConnectionEvent]) -> None:
        raise NotImplementedError

    def _check_send(self, message: Message) -> None:
        raise NotImplementedError

    def _commit_send(self, message: Message) -> None:
        raise NotImplementedError

    # -- shared machinery ---------------------------------------------------

    def _frame(self, message: Message) -> bytes | bytearray:
        if self._sealer is None:
            # encode_frame, inlined: this runs for every message sent.
            buf = bytearray(limits.HEADER_SIZE)
            ENCODER.encode_into(message, buf, limits.HEADER_SIZE)
            length = len(buf) - limits.HEADER_SIZE
            if length > self.peer_max_frame:
                raise LocalProtocolError(
                    f"frame body of {length} bytes exceeds the peer's cap of {self.peer_max_frame}"
                )
            _HEADER.pack_into(buf, 0, length)
            return buf
        body = ENCODER.encode(message)
        length = len(body) + limits.AEAD_TAG_SIZE
        if length > self.peer_max_frame:
            raise LocalProtocolError(
                f"frame body of {length} bytes exceeds the peer's cap of {self.peer_max_frame}"
            )
        header = frame_header(length)
        return header + self._sealer.seal(header, body)

    def _emit_handshake(self, message: Message) -> None:
        self._outbox += encode_frame(ENCODER, message, limits.PREAUTH_MAX_FRAME)

    def _abort_frame(self, code: ErrorCode, message: str) -> bytes | bytearray:
        abort = Abort(code=int(code), message=message[: limits.MAX_ERROR_MESSAGE])
        try:
            return self._frame(abort)
        except LocalProtocolError:
            return b""

    def _fail(self, exc: RemoteProtocolError) -> None:
        if self.state is State.CLOSED:
            return
        # An authentication failure says no more than that: no hint for a prober.
        text = "authentication failed" if isinstance(exc, AuthenticationFailed) else exc.message
        self._outbox += self._abort_frame(exc.code, text)
        self.state = State.CLOSED

    def _open(self, negotiated: Negotiated, client_side: bool) -> None:
        self.state = State.OPEN
        self._reader.max_frame = self.max_frame
        self.version = negotiated.version
        self.cipher = negotiated.cipher
        if client_side:
            self.peer_max_frame = negotiated.server_max_frame
            self.peer_window = negotiated.server_window
        else:
            self.peer_max_frame = negotiated.client_max_frame
            self.peer_window = negotiated.client_window

    def _install_sealer(self, key: bytes) -> None:
        if self.cipher != limits.CIPHER_NONE:
            self._sealer = FrameSealer(self.cipher, key)

    def _install_opener(self, key: bytes) -> None:
        if self.cipher != limits.CIPHER_NONE:
            self._opener = FrameOpener(self.cipher, key)

    def _check_chunk(self, chunk: Chunk) -> None:
        key = (chunk.id, chunk.stream)
        if key in self._send_ended:
            raise LocalProtocolError(f"stream {chunk.stream!r} of call {chunk.id} has ended")
        credit = self._send_credit.get(key, self.peer_window)
        size = len(chunk.data)
        if size > credit:
            raise FlowControlBlocked(
                f"chunk of {size} bytes exceeds the {credit} bytes of credit on {key}"
            )
        if size > self.max_chunk:
            raise LocalProtocolError(f"chunk of {size} bytes exceeds max_chunk {self.max_chunk}")

    def _commit_chunk(self, chunk: Chunk) -> None:
        key = (chunk.id, chunk.stream)
        self._streams.setdefault(chunk.id, set()).add(chunk.stream)
        credit = self._send_credit.get(key, self.peer_window)
        if chunk.end:
            self._send_credit.pop(key, None)
            self._send_ended.add(key)
        else:
            self._send_credit[key] = credit - len(chunk.data)

    def _note_received_chunk(self, chunk: Chunk) -> None:
        key = (chunk.id, chunk.stream)
        if key in self._recv_ended:
            raise FlowControlViolation(f"chunk on stream {chunk.stream!r} after its end")
        expected = self._recv_seq.get(key, 0)
        if chunk.seq != expected:
            raise InvalidMessage(
                f"chunk {chunk.seq} on stream {chunk.stream!r} where {expected} was due"
            )
        self._recv_seq[key] = expected + 1
        left = self._recv_left.get(key)
        if left is None:
            names = self._streams.setdefault(chunk.id, set())
            if len(names) >= 2 * limits.MAX_STREAMS_PER_CALL:
                raise InvalidMessage(f"call {chunk.id} opened too many streams")
            names.add(chunk.stream)
            left = self.window
        left -= len(chunk.data)
        if left < 0:
            raise FlowControlViolation(f"peer overran its credit on stream {chunk.stream!r}")
        if chunk.end:
            self._recv_left.pop(key, None)
            self._recv_ended.add(key)
        else:
            self._recv_left[key] = left

    def _note_credit(self, credit: Credit) -> None:
        key = (credit.id, credit.stream)
        current = self._send_credit.get(key)
        if current is None:
            # Never sent on, or already ended: a late credit crossing our end.
            return
        total = current + credit.bytes
        if total > limits.MAX_STREAM_WINDOW:
            raise FlowControlViolation("peer granted more credit than any window allows")
        self._send_credit[key] = total

    def _finish_call(self, call_id: int) -> None:
        for name in self._streams.pop(call_id, ()):
            key = (call_id, name)
            self._send_credit.pop(key, None)
            self._recv_left.pop(key, None)
            self._send_ended.discard(key)
            self._recv_ended.discard(key)
            self._recv_seq.pop(key, None)

    def _handshake_aborted(self, message: Message, events: list[ConnectionEvent]) -> bool:
        """True when the peer aborted the handshake; raise if ``message`` is out of turn."""
        if isinstance(message, Abort):
            self.state = State.CLOSED
            events.append(message)
            return True
        if not isinstance(message, self._expect):
            raise UnexpectedMessage(
                f"expected {self._expect.__name__} during the handshake, got "
                f"{type(message).__name__}"
            )
        return False

    def _handle_stream_message(
        self, message: Chunk | Credit, events: list[ConnectionEvent], live: set[int]
    ) -> None:
        """Book a Chunk or Credit of a call in ``live``; drop those of finished calls."""
        if message.id not in live:
            return
        if isinstance(message, Chunk):
            self._note_received_chunk(message)
        else:
            self._note_credit(message)
        events.append(message)

    def _handle_common(self, message: Message, events: list[ConnectionEvent]) -> bool:
        """Ping, Pong and Abort behave alike in both roles; True if handled."""
        if isinstance(message, Ping):
            self._outbox += self._frame(Pong(seq=message.seq))
            return True
        if isinstance(message, Pong):
            events.append(message)
            return True
        if isinstance(message, Abort):
            self.state = State.CLOSED
            events.append(message)
            return True
        return False


class ClientConnection(Connection):
    """The calling side: sends Hello at once, then Calls once the server is proven."""

    def __init__(
        self,
        token: bytes,
        *,
        max_frame: int = limits.DEFAULT_MAX_FRAME,
        window: int = limits.DEFAULT_STREAM_WINDOW,
        ciphers: tuple[str, ...] = (limits.CIPHER_NONE,),
        nonce: bytes | None = None,
    ) -> None:
        super().__init__(token, max_frame=max_frame, window=window)
        if not ciphers or any(c not in limits.KNOWN_CIPHERS for c in ciphers):
            raise ValueError(f"ciphers must be chosen from {limits.KNOWN_CIPHERS}")
        self._ciphers = tuple(ciphers)
        self._nonce = nonce if nonce is not None else secrets.token_bytes(limits.NONCE_SIZE)
        self._pending: set[int] = set()
        self._next_id = 1
        self._expect: type[Message] = Challenge
        self._transcript = b""
        self._emit_handshake(
            Hello(
                versions=list(limits.SUPPORTED_VERSIONS),
                nonce=self._nonce,
                ciphers=list(self._ciphers),
                max_frame=max_frame,
                window=window,
            )
        )

    @property
    def pending_calls(self) -> int:
        """Calls sent and not yet answered."""
        return len(self._pending)

    def next_call_id(self) -> int:
        """A fresh call id."""
        call_id = self._next_id
        self._next_id += 1
        return call_id

    def send(self, message: Message) -> bytes | bytearray:
        if type(message) is Call and self.state is State.OPEN:
            # The path of every call: _check_send and _commit_send inlined.
            if message.id in self._pending:
                raise LocalProtocolError(f"call id {message.id} is already in flight")
            frame = self._frame(message)
            self._pending.add(message.id)
            return frame
        return super().send(message)

    def _check_send(self, message: Message) -> None:
        if isinstance(message, Call):
            if message.id in self._pending:
                raise LocalProtocolError(f"call id {message.id} is already in flight")
        elif isinstance(message, Chunk):
            if message.id not in self._pending:
                raise LocalProtocolError(f"no call {message.id} in flight for this chunk")
            self._check_chunk(message)
        elif isinstance(message, Cancel):
            if message.id not in self._pending:
                raise LocalProtocolError(f"no call {message.id} in flight to cancel")
        elif not isinstance(message, Ping | Pong | Credit | Abort):
            raise LocalProtocolError(f"a client does not send {type(message).__name__}")

    def _commit_send(self, message: Message) -> None:
        if isinstance(message, Call):
            self._pending.add(message.id)
        elif isinstance(message, Chunk):
            self._commit_chunk(message)

    def _handle(self, message: Message, events: list[ConnectionEvent]) -> None:
        if self.state is State.HANDSHAKE:
            self._handshake(message, events)
            return
        if isinstance(message, Reply | Error):
            call_id = message.id
            if call_id not in self._pending:
                raise UnexpectedMessage(f"answer to call {call_id}, which is not in flight")
            self._pending.discard(call_id)
            if call_id in self._streams:
                self._finish_call(call_id)
            events.append(message)
        elif isinstance(message, Chunk | Credit):
            self._handle_stream_message(message, events, self._pending)
        elif isinstance(message, Event):
            events.append(message)
        elif not self._handle_common(message, events):
            raise UnexpectedMessage(f"a server does not send {type(message).__name__}")

    def _handshake(self, message: Message, events: list[ConnectionEvent]) -> None:
        if self._handshake_aborted(message, events):
            return
        if isinstance(message, Challenge):
            if message.version not in limits.SUPPORTED_VERSIONS:
                raise VersionMismatch(f"server chose unsupported version {message.version}")
            if message.cipher not in self._ciphers:
                raise UnsupportedCipher(f"server chose a cipher not offered: {message.cipher!r}")
            _check_limits(message.max_frame, message.window)
            self._negotiated = Negotiated(
                version=message.version,
                client_nonce=self._nonce,
                server_nonce=message.nonce,
                offered_ciphers=self._ciphers,
                cipher=message.cipher,
                client_max_frame=self.max_frame,
                server_max_frame=message.max_frame,
                client_window=self.window,
                server_window=message.window,
            )
            self._transcript = transcript(self._negotiated)
            self._emit_handshake(Auth(mac=client_mac(self._token, self._transcript)))
            self._expect = Welcome
        elif isinstance(message, Welcome):
            assert self._negotiated is not None
            if not verify_mac(server_mac(self._token, self._transcript), message.mac):
                raise AuthenticationFailed("the server did not prove knowledge of the token")
            keys = derive_keys(self._token, self._transcript)
            self._open(self._negotiated, client_side=True)
            self._install_sealer(keys.client_to_server)
            self._install_opener(keys.server_to_client)
            events.append(
                HandshakeComplete(
                    version=self.version,
                    cipher=self.cipher,
                    peer_max_frame=self.peer_max_frame,
                    peer_window=self.peer_window,
                    info=dict(message.info),
                )
            )


class ServerConnection(Connection):
    """The serving side: answers the handshake, then surfaces Calls."""

    def __init__(
        self,
        token: bytes,
        *,
        max_frame: int = limits.DEFAULT_MAX_FRAME,
        window: int = limits.DEFAULT_STREAM_WINDOW,
        ciphers: tuple[str, ...] = limits.KNOWN_CIPHERS,
        max_inflight: int = 1024,
        info: dict[str, str | int] | None = None,
        nonce: bytes | None = None,
    ) -> None:
        super().__init__(token, max_frame=max_frame, window=window)
        self._accepted = tuple(ciphers)
        self._nonce = nonce if nonce is not None else secrets.token_bytes(limits.NONCE_SIZE)
        self._info = dict(info or {})
        probe = Welcome(mac=bytes(limits.MAC_SIZE), info=self._info)
        if len(ENCODER.encode(probe)) > limits.PREAUTH_MAX_FRAME:
            raise ValueError("Welcome info does not fit the pre-authentication frame cap")
        self.max_inflight = max_inflight
        self._open_calls: set[int] = set()
        self._expect: type[Message] = Hello
        self._transcript = b""

    @property
    def open_calls(self) -> int:
        """Calls received and not yet answered."""
        return len(self._open_calls)

    def send(self, message: Message) -> bytes | bytearray:
        if (type(message) is Reply or type(message) is Error) and self.state is State.OPEN:
            # The path of every answer: _check_send and _commit_send inlined.
            call_id = message.id
            if call_id not in self._open_calls:
                raise LocalProtocolError(f"no call {call_id} open to answer")
            frame = self._frame(message)
            self._open_calls.discard(call_id)
            if call_id in self._streams:
                self._finish_call(call_id)
            return frame
        return super().send(message)

    def _check_send(self, message: Message) -> None:
        if isinstance(message, Reply | Error):
            if message.id not in self._open_calls:
                raise LocalProtocolError(f"no call {message.id} open to answer")
        elif isinstance(message, Chunk):
            if message.id not in self._open_calls:
                raise LocalProtocolError(f"no call {message.id} open for this chunk")
            self._check_chunk(message)
        elif not isinstance(message, Event | Ping | Pong | Credit | Abort):
            raise LocalProtocolError(f"a server does not send {type(message).__name__}")

    def _commit_send(self, message: Message) -> None:
        if isinstance(message, Reply | Error):
            self._open_calls.discard(message.id)
            self._finish_call(message.id)
        elif isinstance(message, Chunk):
            self._commit_chunk(message)

    def _handle(self, message: Message, events: list[ConnectionEvent]) -> None:
        if self.state is State.HANDSHAKE:
            self._handshake(message, events)
            return
        if isinstance(message, Call):
            if message.id in self._open_calls:
                raise DuplicateCallId(f"call id {message.id} is already in flight")
            if len(self._open_calls) >= self.max_inflight:
                self._outbox += self._frame(
                    Error(
                        id=message.id,
                        code=int(ErrorCode.TOO_MANY_CALLS),
                        message=f"more than {self.max_inflight} calls in flight",
                    )
                )
                return
            self._open_calls.add(message.id)
            events.append(message)
        elif isinstance(message, Chunk | Credit):
            self._handle_stream_message(message, events, self._open_calls)
        elif isinstance(message, Cancel):
            if message.id in self._open_calls:
                events.append(message)
        elif not self._handle_common(message, events):
            raise UnexpectedMessage(f"a client does not send {type(message).__name__}")

    def _handshake(self, message: Message, events: list[ConnectionEvent]) -> None:
        if self._handshake_aborted(message, events):
            return
        if isinstance(message, Hello):
            version = choose_version(message.versions)
            if version is None:
                raise VersionMismatch(
                    f"no shared protocol version (server speaks {limits.SUPPORTED_VERSIONS})"
                )
            cipher = choose_cipher(message.ciphers, self._accepted)
            if cipher is None:
                raise UnsupportedCipher(
                    f"no acceptable cipher offered (accepted: {self._accepted})"
                )
            _check_limits(message.max_frame, message.window)
            self._negotiated = Negotiated(
                version=version,
                client_nonce=message.nonce,
                server_nonce=self._nonce,
                offered_ciphers=tuple(message.ciphers),
                cipher=cipher,
                client_max_frame=message.max_frame,
                server_max_frame=self.max_frame,
                client_window=message.window,
                server_window=self.window,
            )
            self._transcript = transcript(self._negotiated)
            self._emit_handshake(
                Challenge(
                    version=version,
                    nonce=self._nonce,
                    cipher=cipher,
                    max_frame=self.max_frame,
                    window=self.window,
                )
            )
            self._expect = Auth
        elif isinstance(message, Auth):
            assert self._negotiated is not None
            if not verify_mac(client_mac(self._token, self._transcript), message.mac):
                raise AuthenticationFailed("the client did not prove knowledge of the token")
            keys = derive_keys(self._token, self._transcript)
            self._emit_handshake(
                Welcome(mac=server_mac(self._token, self._transcript), info=self._info)
            )
            self._open(self._negotiated, client_side=False)
            self._install_opener(keys.client_to_server)
            self._install_sealer(keys.server_to_client)
            events.append(
                HandshakeComplete(
                    version=self.version,
                    cipher=self.cipher,
                    peer_max_frame=self.peer_max_frame,
                    peer_window=self.peer_window,
                )
            )
