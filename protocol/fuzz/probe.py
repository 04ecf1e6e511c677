"""The kit's client: sends anything at all, and holds the server to the specification.

Theory of operation
-------------------
A :class:`Probe` drives one :class:`~protocol.fuzz.link.Link`. Unlike
:class:`~protocol.connection.ClientConnection` it refuses to send nothing: a
script may send a Ping before the handshake, a Call with a duplicate id or a
chunk beyond its credit. It still keeps the books a client keeps, from what it
actually sent: the Hello and Challenge (to compute MACs and keys when it holds
the token), the calls in flight, the credit of every stream in both
directions.

What the server sends is held to the specification as it arrives
(:meth:`Probe.pump`): frames within the probe's cap, bodies that decode to a
message the server may send in the current state, answers only to calls in
flight and only once, chunks in sequence and within the credit the probe
granted, nothing after an Abort, no token in anything. A breach is a
*violation*, recorded with what was seen; the case that was running fails.
Messages that pass are queued (``Probe.inbox``) for the script's
expectations to look for. The probe answers the server's Pings itself and,
with ``Probe.auto_grant``, grants credit for what it has read.

States, for what the server may send::

    HANDSHAKE --(Welcome verified, or Welcome seen without the token)--> OPEN
    any       --(Abort received, or end of stream)-------------------> CLOSED
"""

from __future__ import annotations

import functools
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from protocol import limits
from protocol.aead import FrameOpener, FrameSealer
from protocol.codec import ENCODER, decode_message, from_raw
from protocol.errors import DecryptionFailed, FrameTooLarge, RemoteProtocolError
from protocol.framing import FrameReader, frame_header
from protocol.fuzz.link import Link, LinkClosed
from protocol.handshake import (
    Negotiated,
    client_mac,
    derive_keys,
    server_mac,
    transcript,
    verify_mac,
)
from protocol.messages import (
    Abort,
    Call,
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
from protocol.rpc import Rpc, all_rpcs

#: What a server may send before its Welcome, and after.
_HANDSHAKE_KINDS: Final = (Challenge, Welcome, Abort)
_OPEN_KINDS: Final = (Reply, Error, Chunk, Credit, Event, Ping, Pong, Abort)
_READ_SLICE: Final = 0.05


@dataclass
class _Down:
    """A server -> client stream, as the probe receives it."""

    left: int
    seq: int = 0
    received: int = 0
    ended: bool = False


@dataclass
class _Up:
    """A client -> server stream, as the probe sends it."""

    credit: int
    seq: int = 0
    sent: int = 0
    ended: bool = False


@dataclass
class Sent:
    """One frame the probe wrote, with the message it carried when it decoded."""

    frame: bytes
    message: Message | None


@dataclass
class Probe:
    """One connection's client: see the module docstring."""

    link: Link
    token: bytes | None
    auto_grant: bool = True
    state: str = "handshake"
    hello: Hello | None = None
    challenge: Challenge | None = None
    welcome: Welcome | None = None
    #: Challenges received on this connection (a broken server may send several).
    challenges: list[Challenge] = field(default_factory=list)
    abort: Abort | None = None
    eof: bool = False
    inbox: deque[Message] = field(default_factory=deque)
    received: list[Message] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    in_flight: set[int] = field(default_factory=set)
    answered: set[int] = field(default_factory=set)
    #: The result of every Reply received, by call id (the latest for a reused id).
    results: dict[int, bytes] = field(default_factory=dict)
    #: The method of every call sent, by call id.
    methods: dict[int, str] = field(default_factory=dict)
    #: Values captured from results, for later size expressions.
    captured: dict[str, int] = field(default_factory=dict)
    downs: dict[tuple[int, str], _Down] = field(default_factory=dict)
    ups: dict[tuple[int, str], _Up] = field(default_factory=dict)
    _reader: FrameReader = field(default_factory=lambda: FrameReader(limits.PREAUTH_MAX_FRAME))
    _seal: FrameSealer | None = None
    _open: FrameOpener | None = None
    _transcript: bytes = b""
    _sealing: bool = False
    _opaque: bool = False
    _ping_seq: int = 1 << 40

    # -- negotiated values -----------------------------------------------------------

    @property
    def values(self) -> dict[str, int]:
        """The negotiated numbers size expressions may name (PREAUTH values until known)."""
        hello, challenge = self.hello, self.challenge
        return {
            "client_max_frame": hello.max_frame if hello else limits.PREAUTH_MAX_FRAME,
            "client_window": hello.window if hello else limits.MIN_STREAM_WINDOW,
            "server_max_frame": challenge.max_frame if challenge else limits.PREAUTH_MAX_FRAME,
            "server_window": challenge.window if challenge else limits.MIN_STREAM_WINDOW,
            "preauth_max_frame": limits.PREAUTH_MAX_FRAME,
            "max_window": limits.MAX_STREAM_WINDOW,
            **self.captured,
        }

    @property
    def sealed(self) -> bool:
        """Whether what this probe sends now is sealed."""
        return self._seal is not None and self._sealing

    @property
    def max_chunk(self) -> int:
        """The most data one Chunk to the server may carry."""
        overhead = limits.CHUNK_OVERHEAD + (limits.AEAD_TAG_SIZE if self.sealed else 0)
        return max(1, self.values["server_max_frame"] - overhead)

    # -- sending ---------------------------------------------------------------------

    def send_raw(self, data: bytes, split: int | None = None, note: bool = True) -> None:
        """Write bytes as they are (in pieces of ``split`` bytes).

        With ``note``, the complete plaintext frames among them count as sent
        messages for the books (a Hello written as raw bytes is still the Hello).
        """
        if note and not self.sealed:
            self._note_raw(data)
        step = split if split and split > 0 else len(data) or 1
        try:
            for start in range(0, len(data), step):
                self.link.send(data[start : start + step])
        except LinkClosed:
            self.eof = True

    def _note_raw(self, data: bytes) -> None:
        pos = 0
        while len(data) - pos >= limits.HEADER_SIZE:
            length = int.from_bytes(data[pos : pos + limits.HEADER_SIZE], "big")
            end = pos + limits.HEADER_SIZE + length
            if end > len(data):
                return
            message = _decoded(data[pos + limits.HEADER_SIZE : end])
            if message is not None:
                self._note_sent(message)
            pos = end

    def send_body(
        self,
        body: bytes,
        *,
        plain: bool = False,
        tamper: bool = False,
        split: int | None = None,
    ) -> bytes:
        """Frame ``body`` (sealed when this side seals and not ``plain``), send it, keep books."""
        message = _decoded(body)
        if self.sealed and not plain:
            assert self._seal is not None
            header = frame_header(len(body) + limits.AEAD_TAG_SIZE)
            sealed = bytearray(self._seal.seal(header, body))
            if tamper:
                sealed[len(sealed) // 2] ^= 0x01
            frame = header + bytes(sealed)
        else:
            frame = frame_header(len(body)) + body
        self.sent.append(Sent(frame, message))
        if message is not None:
            self._note_sent(message)
        self.send_raw(frame, split, note=False)
        return frame

    def send_message(self, message: Message) -> bytes:
        """Encode, frame and send a message."""
        return self.send_body(ENCODER.encode(message))

    def _note_sent(self, message: Message) -> None:
        kind = type(message)
        if kind is Hello:
            assert isinstance(message, Hello)
            self.hello = message
            self._reader.max_frame = limits.PREAUTH_MAX_FRAME
        elif kind is Call:
            assert isinstance(message, Call)
            self.methods[message.id] = message.method
            self.in_flight.add(message.id)
            self.answered.discard(message.id)
            # A reused id starts afresh: the earlier call's streams are forgotten.
            for books in (self.downs, self.ups):
                for key in [k for k in books if k[0] == message.id]:
                    del books[key]
        elif kind is Chunk:
            assert isinstance(message, Chunk)
            up = self._up(message.id, message.stream)
            up.seq = message.seq + 1
            up.sent += len(message.data)
            up.credit -= len(message.data)
            up.ended = up.ended or message.end

    def _up(self, call_id: int, stream: str) -> _Up:
        key = (call_id, stream)
        if key not in self.ups:
            self.ups[key] = _Up(credit=self.values["server_window"])
        return self.ups[key]

    def up_credit(self, call_id: int, stream: str) -> int:
        """Data bytes this probe may still send on a stream, by the server's grants."""
        return self._up(call_id, stream).credit

    def next_up_seq(self, call_id: int, stream: str) -> int:
        """The seq of this probe's next chunk on a stream."""
        return self._up(call_id, stream).seq

    def auth_mac(self, transcript_ciphers: list[str] | None = None) -> bytes:
        """The valid client MAC for this connection's Hello and Challenge (needs the token)."""
        if self.token is None:
            raise ValueError("a valid Auth needs the token")
        negotiated = self._negotiated(transcript_ciphers)
        return client_mac(self.token, transcript(negotiated))

    def _negotiated(self, ciphers: list[str] | None = None) -> Negotiated:
        hello, challenge = self.hello, self.challenge
        if hello is None or challenge is None:
            raise ValueError("no Hello and Challenge on this connection yet")
        return Negotiated(
            version=challenge.version,
            client_nonce=hello.nonce,
            server_nonce=challenge.nonce,
            offered_ciphers=tuple(ciphers if ciphers is not None else hello.ciphers),
            cipher=challenge.cipher,
            client_max_frame=hello.max_frame,
            server_max_frame=challenge.max_frame,
            client_window=hello.window,
            server_window=challenge.window,
        )

    def ping(self) -> int:
        """Send a Ping with a fresh seq; return the seq."""
        self._ping_seq += 1
        self.send_message(Ping(seq=self._ping_seq))
        return self._ping_seq

    # -- receiving -------------------------------------------------------------------

    def pump(self, timeout: float) -> None:
        """Read for up to ``timeout`` seconds, or until at least one read arrived."""
        if self.eof:
            return
        data = self.link.recv(timeout)
        if data is None:
            return
        if not data:
            self.eof = True
            self.state = "closed"
            return
        self._take(data)

    def wait(self, done: object, deadline: float) -> bool:
        """Pump until ``done()`` holds, the connection ends or ``deadline`` passes."""
        assert callable(done)
        while True:
            if done():
                return True
            if self.eof:
                return bool(done())
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.pump(min(left, _READ_SLICE * 20))

    def _take(self, data: bytes) -> None:
        if self._opaque:
            return
        if self.state == "closed" and self.abort is not None:
            self.violate(f"the server sent {len(data)} bytes after its Abort")
            self._opaque = True
            return
        reader = self._reader
        reader.feed(data)
        try:
            while not self._opaque:
                frame = reader.next_frame()
                if frame is None:
                    return
                self._frame(bytes(frame))
        except FrameTooLarge as exc:
            self.violate(f"the server sent a frame over the client's cap: {exc.message}")
            self._opaque = True

    def _frame(self, frame: bytes) -> None:
        body = frame
        if self._open is not None:
            try:
                body = self._open.open(frame_header(len(frame)), frame)
            except DecryptionFailed:
                self.violate("a sealed frame from the server does not verify")
                self._opaque = True
                return
        try:
            message = decode_message(body)
        except RemoteProtocolError as exc:
            self.violate(f"the server sent a body that is not a valid message: {exc.message}")
            self._opaque = True
            return
        if self.token is not None and len(self.token) >= 8 and self.token in body:
            self.violate("the token appears in a message from the server")
        self.received.append(message)
        if self.state == "closed":
            self.violate(f"the server sent {type(message).__name__} after its Abort")
            return
        allowed = _HANDSHAKE_KINDS if self.state == "handshake" else _OPEN_KINDS
        if not isinstance(message, allowed):
            self.violate(f"the server sent {type(message).__name__} in state {self.state}")
            return
        self._receive(message)

    def _receive(self, message: Message) -> None:
        if isinstance(message, Abort):
            self.abort = message
            self.state = "closed"
            if message.code >= 100:
                self.violate(f"an Abort carries the call-level code {message.code}")
        elif isinstance(message, Challenge):
            self._on_challenge(message)
        elif isinstance(message, Welcome):
            self._on_welcome(message)
        elif isinstance(message, Reply | Error):
            if message.id not in self.in_flight:
                self.violate(f"an answer to call {message.id}, which is not in flight")
                return
            self.in_flight.discard(message.id)
            self.answered.add(message.id)
            if isinstance(message, Reply):
                self.results[message.id] = bytes(message.result)
                self._check_result(message)
        elif isinstance(message, Chunk):
            self._on_chunk(message)
        elif isinstance(message, Credit):
            up = self.ups.get((message.id, message.stream))
            if up is not None and not up.ended:
                up.credit += message.bytes
        elif isinstance(message, Ping):
            self.send_message(Pong(seq=message.seq))
            return
        self.inbox.append(message)

    def _check_result(self, reply: Reply) -> None:
        """A Reply to a declared method must decode as that method's declared result."""
        method = self.methods.get(reply.id, "")
        rpc = _declared().get(method)
        if rpc is None or rpc.result is msgspec.Raw:
            return
        try:
            from_raw(reply.result, rpc.result)
        except msgspec.DecodeError as exc:
            self.violate(f"the result of {method} does not match its declared schema: {exc}")

    def _on_challenge(self, message: Challenge) -> None:
        self.challenges.append(message)
        hello = self.hello
        if self.challenge is not None:
            self.violate("a second Challenge on one connection")
            return
        self.challenge = message
        if hello is None:
            self.violate("a Challenge before any Hello")
            return
        problems = [
            f"version {message.version} was not offered"
            if message.version not in hello.versions
            else "",
            f"cipher {message.cipher!r} was not offered"
            if message.cipher not in hello.ciphers
            else "",
            f"max_frame {message.max_frame} is out of range"
            if not limits.MIN_MAX_FRAME <= message.max_frame <= limits.MAX_MAX_FRAME
            else "",
            f"window {message.window} is out of range"
            if not limits.MIN_STREAM_WINDOW <= message.window <= limits.MAX_STREAM_WINDOW
            else "",
        ]
        for problem in filter(None, problems):
            self.violate(f"the Challenge is not acceptable: {problem}")

    def _on_welcome(self, message: Welcome) -> None:
        self.welcome = message
        self.state = "open"
        if self.token is None or self.challenge is None or self.hello is None:
            # Without the token (or a Challenge) nothing after it can be read.
            self._opaque = self.challenge is None or self.challenge.cipher != limits.CIPHER_NONE
            return
        t = transcript(self._negotiated())
        if not verify_mac(server_mac(self.token, t), message.mac):
            self.violate("the server's Welcome MAC does not verify")
            self._opaque = True
            return
        self._reader.max_frame = self.hello.max_frame
        cipher = self.challenge.cipher
        if cipher != limits.CIPHER_NONE:
            keys = derive_keys(self.token, t)
            self._seal = FrameSealer(cipher, keys.client_to_server)
            self._open = FrameOpener(cipher, keys.server_to_client)
        self._sealing = True

    def _on_chunk(self, chunk: Chunk) -> None:
        if chunk.id not in self.in_flight:
            self.violate(f"a chunk for call {chunk.id}, which is not in flight")
            return
        key = (chunk.id, chunk.stream)
        down = self.downs.get(key)
        if down is None:
            names = {k[1] for k in self.downs if k[0] == chunk.id}
            if len(names) >= limits.MAX_STREAMS_PER_CALL:
                self.violate(f"call {chunk.id} streams on more than 8 names")
            down = self.downs[key] = _Down(left=self.values["client_window"])
        if down.ended:
            self.violate(f"a chunk on stream {chunk.stream!r} after its end")
            return
        if chunk.seq != down.seq:
            self.violate(f"chunk seq {chunk.seq} where {down.seq} was due")
        down.seq = chunk.seq + 1
        down.left -= len(chunk.data)
        down.received += len(chunk.data)
        if down.left < 0:
            self.violate(
                f"the server overran the credit of stream {chunk.stream!r} by {-down.left} bytes"
            )
        down.ended = chunk.end
        if self.auto_grant and chunk.data and not chunk.end:
            self.grant(chunk.id, chunk.stream, len(chunk.data))

    def grant(self, call_id: int, stream: str, nbytes: int) -> None:
        """Send a Credit and count it (even an amount the spec forbids)."""
        down = self.downs.get((call_id, stream))
        if down is not None:
            down.left += nbytes
        body = ENCODER.encode({"t": "credit", "id": call_id, "stream": stream, "bytes": nbytes})
        self.send_body(body)

    def down_received(self, call_id: int, stream: str) -> tuple[int, bool]:
        """Bytes received on a server stream so far, and whether it ended."""
        down = self.downs.get((call_id, stream))
        return (down.received, down.ended) if down is not None else (0, False)

    def violate(self, what: str) -> None:
        """Record a breach of the specification by the server."""
        self.violations.append(what)

    def close(self, reset: bool = False) -> None:
        """Close the link."""
        self.link.close(reset)
        self.eof = True


@functools.cache
def _declared() -> dict[str, Rpc[Any, Any]]:
    return {rpc.name: rpc for rpc in all_rpcs()}


def _decoded(body: bytes) -> Message | None:
    try:
        return decode_message(body)
    except (RemoteProtocolError, msgspec.DecodeError, RecursionError):
        return None


def fresh_nonce() -> bytes:
    """A random client nonce."""
    return os.urandom(limits.NONCE_SIZE)
