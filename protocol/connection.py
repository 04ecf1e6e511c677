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

Which message may be received or sent in which state is decided by the
tables of :mod:`protocol.states` alone (PROTOCOL.md section 5); this module
keeps the books those messages change. Each call in flight has one record,
holding one record per stream name (:class:`_Stream`): both directions'
credit, sequence numbers and ends. The machine numbers outgoing chunks
(:meth:`Connection.next_seq`) and hands out call ids (:meth:`ClientConnection.next_call_id`).

Any violation raises a :class:`~protocol.errors.RemoteProtocolError`: the machine
moves to ``CLOSED`` and leaves an Abort frame in the outbox for the caller to
send before closing the socket. Chunks and credits for calls that have already
finished are dropped silently: they are the normal race with a final answer.
"""

from __future__ import annotations

import os  # os.urandom: the source secrets.token_bytes uses, without importing random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, overload

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
from protocol.framing import FrameReader, SplicedFrame, encode_chunk, encode_frame, frame_header
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
    Hello,
    Message,
    Ping,
    Pong,
    Reply,
    Welcome,
)
from protocol.states import ACCEPTS, CLOSED, HANDSHAKE_ORDER, OPEN, SENDS, Role, State

__all__ = [
    "ClientConnection",
    "Connection",
    "ConnectionEvent",
    "HandshakeComplete",
    "ServerConnection",
    "State",
    "StreamKey",
]


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
Frame = bytes | bytearray | SplicedFrame
#: How a role sends, or takes in, one kind of message (unbound methods).
_Sender = Callable[[Any, Any], Frame]
_Receiver = Callable[[Any, Any, list[ConnectionEvent]], None]


@dataclass(slots=True)
class _Stream:
    """The books of one stream name of one call, in both directions."""

    #: Data bytes this side may still send: the peer's window plus its grants.
    out_credit: int
    #: Data bytes the peer may still send: this side's window plus its grants.
    in_left: int
    #: The seq of this side's next chunk (0 until it first sends).
    out_seq: int = 0
    out_ended: bool = False
    #: The seq the peer's next chunk must carry (0 until it first sends).
    in_seq: int = 0
    in_ended: bool = False


#: The record of one call in flight: its streams by name.
_Call = dict[str, _Stream]


def _check_limits(max_frame: int, window: int) -> None:
    if not limits.MIN_MAX_FRAME <= max_frame <= limits.MAX_MAX_FRAME:
        raise InvalidMessage(f"announced frame cap {max_frame} is outside the allowed range")
    if not limits.MIN_STREAM_WINDOW <= window <= limits.MAX_STREAM_WINDOW:
        raise InvalidMessage(f"announced stream window {window} is outside the allowed range")


class Connection:
    """What both roles share: framing, sealing, streams and credit."""

    role: ClassVar[Role]
    #: message type -> how this role sends it: exactly ``states.SENDS[role]``.
    _senders: ClassVar[dict[type[Message], _Sender]]
    #: message type -> how this role takes it in: every type it ever accepts.
    _receivers: ClassVar[dict[type[Message], _Receiver]]
    #: Where to receive the next bytes in place (``recv_into``); never empty. Follow
    #: with :meth:`buffer_updated`: together they are :meth:`receive_data` without the
    #: copy of large frame bodies. (The reader's own method, called once per read.)
    get_buffer: Callable[[], memoryview]

    def __init__(self, token: bytes, *, max_frame: int, window: int) -> None:
        if not token:
            raise ValueError("an empty token cannot authenticate anything")
        _check_limits(max_frame, window)
        self._token = token
        self.max_frame = max_frame
        self.window = window
        self.peer_max_frame = limits.PREAUTH_MAX_FRAME
        self.peer_window = limits.MIN_STREAM_WINDOW
        self.cipher = limits.CIPHER_NONE
        self.version = 0
        self._reader = FrameReader(limits.PREAUTH_MAX_FRAME)
        self.get_buffer = self._reader.get_buffer
        self._outbox = bytearray()
        self._seal: Callable[[bytes, bytes], bytes] | None = None
        self._opener: FrameOpener | None = None
        #: Calls in flight (sent and unanswered on a client, received and unanswered on a server).
        self._calls: dict[int, _Call] = {}
        self._negotiated: Negotiated | None = None
        self._handshake_step = 0
        self._transcript = b""
        self.state = State.HANDSHAKE
        self._accepted = ACCEPTS[self.role][State.HANDSHAKE]

    # -- public API ---------------------------------------------------------

    @property
    def server_nonce(self) -> bytes:  # names the connection (PROTOCOL.md 8.1); b"" before
        return self._negotiated.server_nonce if self._negotiated is not None else b""

    @property
    def buffered(self) -> int:
        """Received bytes waiting for the rest of their frame."""
        return self._reader.buffered

    @property
    def max_chunk(self) -> int:
        """The largest data payload one Chunk to the peer may carry."""
        overhead = limits.CHUNK_OVERHEAD + (limits.AEAD_TAG_SIZE if self._seal else 0)
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

        Raises RemoteProtocolError on any violation (then CLOSED, an Abort frame in the outbox).
        """
        if self.state is CLOSED:
            return []
        self._reader.feed(data)
        return self._process()

    def buffer_updated(self, nbytes: int) -> list[ConnectionEvent]:
        """``nbytes`` arrived in the buffer of :attr:`get_buffer`; return the events completed.

        Raises RemoteProtocolError exactly as :meth:`receive_data` does.
        """
        if self.state is CLOSED:
            return []
        self._reader.buffer_updated(nbytes)
        return self._process()

    @overload
    def send(self, message: Message, *, splice: Literal[False] = False) -> bytes | bytearray: ...
    @overload
    def send(self, message: Message, *, splice: bool) -> Frame: ...
    def send(self, message: Message, *, splice: bool = False) -> Frame:
        """The framed (and, once negotiated, sealed) bytes of ``message``.

        Raises LocalProtocolError when the message is not allowed now (see
        :mod:`protocol.states`), and FlowControlBlocked when a chunk exceeds
        the granted credit. A message that cannot be sent leaves no trace in
        the books: each sender checks, frames, and only then commits. ``splice``: a
        large plaintext chunk of immutable data may come back as a SplicedFrame.
        """
        sender = self._senders.get(type(message))
        if sender is None or self.state is not OPEN:
            raise LocalProtocolError(
                f"a {self.role.value} cannot send {type(message).__name__} in state "
                f"{self.state.value}"
            )
        if splice and type(message) is Chunk:
            return self._send_chunk(message, splice=True)
        return sender(self, message)

    def in_flight(self, call_id: int) -> bool:
        """Whether call ``call_id`` is in flight (its answer not yet sent or received)."""
        return call_id in self._calls

    def next_seq(self, call_id: int, stream: str) -> int:
        """The ``seq`` the next chunk this side sends on ``(call_id, stream)`` must carry."""
        call = self._calls.get(call_id)
        entry = call.get(stream) if call is not None else None
        return entry.out_seq if entry is not None else 0

    def stream_credit(self, call_id: int, stream: str) -> int:
        """How many data bytes may be sent on ``(call_id, stream)`` right now."""
        call = self._calls.get(call_id)
        entry = call.get(stream) if call is not None else None
        if entry is None or entry.out_ended:
            return self.peer_window
        return entry.out_credit

    def grant(self, call_id: int, stream: str, nbytes: int) -> bytes | bytearray:
        """Let the peer send ``nbytes`` more on a stream whose data was consumed.

        Returns the Credit frame to send, or empty bytes when the stream has
        already finished (nothing more will come on it).
        """
        if nbytes > limits.MAX_STREAM_WINDOW:
            raise LocalProtocolError(f"a grant of {nbytes} bytes exceeds the largest window")
        call = self._calls.get(call_id)
        entry = call.get(stream) if call is not None else None
        if (
            nbytes <= 0
            or entry is None
            or entry.in_seq == 0
            or entry.in_ended
            or self.state is not OPEN
        ):
            return b""
        entry.in_left += nbytes
        return self._frame(Credit(id=call_id, stream=stream, bytes=nbytes))

    def close(self, code: ErrorCode = ErrorCode.GOING_AWAY, message: str = "") -> bytes:
        """Move to CLOSED; return an Abort frame to send first (empty if already closed)."""
        if self.state is CLOSED:
            return b""
        out = bytes(self._abort_frame(code, message))
        self._enter(State.CLOSED)
        return out

    # -- receiving ----------------------------------------------------------

    def _process(self) -> list[ConnectionEvent]:
        reader = self._reader
        events: list[ConnectionEvent] = []
        try:
            # A frame may close the connection: look at the state before each.
            while self.state is not CLOSED:
                frame = reader.next_frame()
                if frame is None:
                    break
                body = frame
                if self._opener is not None:
                    body = self._opener.open(frame_header(len(frame)), frame)
                message = decode_message(body)
                kind = type(message)
                if body is not frame or kind is Chunk:
                    # Nothing refers to the received buffer any more: a
                    # Chunk's data is a copy (only Raw payloads point into
                    # the buffer they were decoded from).
                    reader.recycle(frame)
                if kind not in self._accepted:
                    raise UnexpectedMessage(
                        f"a {self.role.value} does not accept {kind.__name__} in state "
                        f"{self.state.value}"
                    )
                self._receivers[kind](self, message, events)
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise
        return events

    def _receive_handshake(self, message: Message, events: list[ConnectionEvent]) -> None:
        """Hold a handshake message to its turn, then let the role take its step."""
        expected = HANDSHAKE_ORDER[self.role][self._handshake_step]
        if type(message) is not expected:
            raise UnexpectedMessage(
                f"expected {expected.__name__} during the handshake, got {type(message).__name__}"
            )
        self._handshake_step += 1
        self._handshake(message, events)

    def _receive_chunk(self, chunk: Chunk, events: list[ConnectionEvent]) -> None:
        call = self._calls.get(chunk.id)
        if call is None:
            return  # the call has finished: the normal race with its answer
        entry = call.get(chunk.stream)
        if entry is None:
            if len(call) >= 2 * limits.MAX_STREAMS_PER_CALL:
                raise InvalidMessage(f"call {chunk.id} opened too many streams")
            entry = call[chunk.stream] = _Stream(self.peer_window, self.window)
        if entry.in_ended:
            raise FlowControlViolation(f"chunk on stream {chunk.stream!r} after its end")
        if chunk.seq != entry.in_seq:
            raise InvalidMessage(
                f"chunk {chunk.seq} on stream {chunk.stream!r} where {entry.in_seq} was due"
            )
        entry.in_seq += 1
        left = entry.in_left - len(chunk.data)
        if left < 0:
            raise FlowControlViolation(f"peer overran its credit on stream {chunk.stream!r}")
        entry.in_left = left
        entry.in_ended = chunk.end
        events.append(chunk)

    def _receive_credit(self, credit: Credit, events: list[ConnectionEvent]) -> None:
        call = self._calls.get(credit.id)
        if call is None:
            return  # the call has finished: the normal race with its answer
        entry = call.get(credit.stream)
        if entry is None or entry.out_seq == 0 or entry.out_ended:
            # Never sent on, or already ended: a late credit crossing our end.
            return
        total = entry.out_credit + credit.bytes
        if total > limits.MAX_STREAM_WINDOW:
            raise FlowControlViolation("peer granted more credit than any window allows")
        entry.out_credit = total
        events.append(credit)

    def _receive_ping(self, message: Ping, events: list[ConnectionEvent]) -> None:
        self._outbox += self._frame(Pong(seq=message.seq))

    def _receive_abort(self, message: Abort, events: list[ConnectionEvent]) -> None:
        self._enter(State.CLOSED)
        events.append(message)

    def _surface(self, message: Message, events: list[ConnectionEvent]) -> None:
        """A message that changes no books goes to the application as it is."""
        events.append(message)

    def _handshake(self, message: Message, events: list[ConnectionEvent]) -> None:
        raise NotImplementedError

    # -- sending ------------------------------------------------------------

    def _frame(self, message: Message) -> bytes | bytearray:
        return encode_frame(ENCODER, message, self.peer_max_frame, self._seal)

    def _send_chunk(self, chunk: Chunk, splice: bool = False) -> Frame:
        call = self._calls.get(chunk.id)
        if call is None:
            raise LocalProtocolError(f"no call {chunk.id} in flight for this chunk")
        entry = call.get(chunk.stream) or _Stream(self.peer_window, self.window)
        if entry.out_ended:
            raise LocalProtocolError(f"stream {chunk.stream!r} of call {chunk.id} has ended")
        if chunk.seq != entry.out_seq:
            raise LocalProtocolError(
                f"chunk {chunk.seq} on stream {chunk.stream!r} where {entry.out_seq} is due"
            )
        size = len(chunk.data)
        if size > entry.out_credit:
            raise FlowControlBlocked(
                f"chunk of {size} bytes exceeds the {entry.out_credit} bytes of credit on "
                f"stream {chunk.stream!r} of call {chunk.id}"
            )
        if size > self.max_chunk:
            raise LocalProtocolError(f"chunk of {size} bytes exceeds max_chunk {self.max_chunk}")
        frame = encode_chunk(ENCODER, chunk, self.peer_max_frame, self._seal, splice)
        call[chunk.stream] = entry
        entry.out_seq += 1
        entry.out_credit -= size
        entry.out_ended = chunk.end
        return frame

    def _emit_handshake(self, message: Message) -> None:
        self._outbox += encode_frame(ENCODER, message, limits.PREAUTH_MAX_FRAME)

    # -- state --------------------------------------------------------------

    def _enter(self, state: State) -> None:
        self.state = state
        self._accepted = ACCEPTS[self.role][state]

    def _abort_frame(self, code: ErrorCode, message: str) -> bytes | bytearray:
        abort = Abort(code=int(code), message=message[: limits.MAX_ERROR_MESSAGE])
        try:
            return self._frame(abort)
        except LocalProtocolError:
            return b""

    def _fail(self, exc: RemoteProtocolError) -> None:
        if self.state is CLOSED:
            return
        # An authentication failure says no more than that: no hint for a prober.
        text = "authentication failed" if isinstance(exc, AuthenticationFailed) else exc.message
        self._outbox += self._abort_frame(exc.code, text)
        self._enter(State.CLOSED)

    def _open(self, negotiated: Negotiated, key_out: bytes, key_in: bytes) -> None:
        self._enter(State.OPEN)
        self._reader.max_frame = self.max_frame
        self.version = negotiated.version
        self.cipher = negotiated.cipher
        if self.role is Role.CLIENT:
            self.peer_max_frame = negotiated.server_max_frame
            self.peer_window = negotiated.server_window
        else:
            self.peer_max_frame = negotiated.client_max_frame
            self.peer_window = negotiated.client_window
        if self.cipher != limits.CIPHER_NONE:
            self._seal = FrameSealer(self.cipher, key_out).seal
            self._opener = FrameOpener(self.cipher, key_in)

    def _completed(self, info: dict[str, str | int] | None = None) -> HandshakeComplete:
        return HandshakeComplete(
            version=self.version,
            cipher=self.cipher,
            peer_max_frame=self.peer_max_frame,
            peer_window=self.peer_window,
            info=dict(info or {}),
        )


def _sender_table(role: Role, special: dict[type[Message], Any]) -> dict[type[Message], _Sender]:
    """What ``role`` may send, each with its sender; the ``special`` ones keep books."""
    return {kind: special.get(kind, Connection._frame) for kind in SENDS[role]}


def _receiver_table(
    role: Role, special: dict[type[Message], Any]
) -> dict[type[Message], _Receiver]:
    """Every message ``role`` accepts in some state, each with what takes it in."""
    common: dict[type[Message], Any] = {
        Chunk: Connection._receive_chunk,
        Credit: Connection._receive_credit,
        Ping: Connection._receive_ping,
        Abort: Connection._receive_abort,
        **dict.fromkeys(HANDSHAKE_ORDER[role], Connection._receive_handshake),
    }
    kinds: set[type[Message]] = set().union(*ACCEPTS[role].values())
    return {kind: special.get(kind) or common.get(kind, Connection._surface) for kind in kinds}


class ClientConnection(Connection):
    """The calling side: sends Hello at once, then Calls once the server is proven."""

    role = Role.CLIENT

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
        self._nonce = nonce if nonce is not None else os.urandom(limits.NONCE_SIZE)
        self._next_id = 1
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
        return len(self._calls)

    def next_call_id(self) -> int:
        """A fresh call id: 1, 2, 3, ... (the one place ids are chosen)."""
        call_id = self._next_id
        self._next_id += 1
        return call_id

    def _send_call(self, message: Call) -> Frame:
        if message.id in self._calls:
            raise LocalProtocolError(f"call id {message.id} is already in flight")
        frame = self._frame(message)
        self._calls[message.id] = {}
        return frame

    def _send_cancel(self, message: Cancel) -> Frame:
        if message.id not in self._calls:
            raise LocalProtocolError(f"no call {message.id} in flight to cancel")
        return self._frame(message)

    def _receive_answer(self, message: Reply | Error, events: list[ConnectionEvent]) -> None:
        if self._calls.pop(message.id, None) is None:
            raise UnexpectedMessage(f"answer to call {message.id}, which is not in flight")
        events.append(message)

    def _handshake(self, message: Message, events: list[ConnectionEvent]) -> None:
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
        elif isinstance(message, Welcome):
            assert self._negotiated is not None
            if not verify_mac(server_mac(self._token, self._transcript), message.mac):
                raise AuthenticationFailed("the server did not prove knowledge of the token")
            keys = derive_keys(self._token, self._transcript)
            self._open(self._negotiated, keys.client_to_server, keys.server_to_client)
            events.append(self._completed(message.info))

    _senders = _sender_table(
        Role.CLIENT,
        {Call: _send_call, Chunk: Connection._send_chunk, Cancel: _send_cancel},
    )
    _receivers = _receiver_table(Role.CLIENT, {Reply: _receive_answer, Error: _receive_answer})


class ServerConnection(Connection):
    """The serving side: answers the handshake, then surfaces Calls."""

    role = Role.SERVER

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
        self._accepted_ciphers = tuple(ciphers)
        self._nonce = nonce if nonce is not None else os.urandom(limits.NONCE_SIZE)
        self._info = dict(info or {})
        probe = Welcome(mac=bytes(limits.MAC_SIZE), info=self._info)
        if len(ENCODER.encode(probe)) > limits.PREAUTH_MAX_FRAME:
            raise ValueError("Welcome info does not fit the pre-authentication frame cap")
        self.max_inflight = max_inflight

    @property
    def open_calls(self) -> int:
        """Calls received and not yet answered."""
        return len(self._calls)

    def _send_answer(self, message: Reply | Error) -> Frame:
        if message.id not in self._calls:
            raise LocalProtocolError(f"no call {message.id} open to answer")
        frame = self._frame(message)
        del self._calls[message.id]
        return frame

    def _receive_call(self, message: Call, events: list[ConnectionEvent]) -> None:
        if message.id in self._calls:
            raise DuplicateCallId(f"call id {message.id} is already in flight")
        if len(self._calls) >= self.max_inflight:
            self._outbox += self._frame(
                Error(
                    id=message.id,
                    code=int(ErrorCode.TOO_MANY_CALLS),
                    message=f"more than {self.max_inflight} calls in flight",
                )
            )
            return
        self._calls[message.id] = {}
        events.append(message)

    def _receive_cancel(self, message: Cancel, events: list[ConnectionEvent]) -> None:
        if message.id in self._calls:
            events.append(message)

    def _handshake(self, message: Message, events: list[ConnectionEvent]) -> None:
        if isinstance(message, Hello):
            version = choose_version(message.versions)
            if version is None:
                raise VersionMismatch(
                    f"no shared protocol version (server speaks {limits.SUPPORTED_VERSIONS})"
                )
            cipher = choose_cipher(message.ciphers, self._accepted_ciphers)
            if cipher is None:
                raise UnsupportedCipher(
                    f"no acceptable cipher offered (accepted: {self._accepted_ciphers})"
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
        elif isinstance(message, Auth):
            assert self._negotiated is not None
            if not verify_mac(client_mac(self._token, self._transcript), message.mac):
                raise AuthenticationFailed("the client did not prove knowledge of the token")
            keys = derive_keys(self._token, self._transcript)
            self._emit_handshake(
                Welcome(mac=server_mac(self._token, self._transcript), info=self._info)
            )
            self._open(self._negotiated, keys.server_to_client, keys.client_to_server)
            events.append(self._completed())

    _senders = _sender_table(
        Role.SERVER,
        {Reply: _send_answer, Error: _send_answer, Chunk: Connection._send_chunk},
    )
    _receivers = _receiver_table(Role.SERVER, {Call: _receive_call, Cancel: _receive_cancel})
