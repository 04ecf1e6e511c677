"""An in-process target: the sans-I/O :class:`~protocol.connection.ServerConnection` and a small application.

Theory of operation
-------------------
:class:`LoopbackTarget` hands out :class:`LoopbackLink` objects: each owns a
``ServerConnection`` fed synchronously with what the probe sends, and an
:class:`EchoApp` that answers the calls of the machine's default
:class:`~protocol.fuzz.machine.Vocabulary`, so the machine, the strategies
and scripts run against the reference state machine with no socket and no
time passing. The application serves:

* the no-op and echo methods (an echo larger than the result budget is TOO_LARGE);
* the slow method: in flight until cancelled, then CANCELLED;
* the stream method: what arrives on its input stream goes back on its output
  stream within the client's credit, input credit granted as it is echoed;
  after the input's end and the last byte, the output ends and the call replies;
* ``request.attach``: outcomes of calls carrying a request id are kept by the
  target (across links) and given back; an unknown id is REQUEST_NOT_KNOWN.

Anything else is UNKNOWN_METHOD, params it cannot read INVALID_PARAMS. A
protocol violation leaves the machine's Abort in the output and closes the link.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocol import limits
from protocol.codec import ENCODER, to_raw
from protocol.connection import ConnectionEvent, ServerConnection
from protocol.errors import ErrorCode, RemoteProtocolError
from protocol.fuzz.link import LinkClosed
from protocol.messages import Abort, Call, Cancel, Chunk, Credit, Error, Message, Reply


@dataclass
class _Stream:
    """The stream-echo call's state."""

    pending: bytearray = field(default_factory=bytearray)
    seq: int = 0
    input_ended: bool = False
    rid: bytes | None = None


class EchoApp:
    """The application behind each loopback link (see the module docstring)."""

    def __init__(self, target: LoopbackTarget, conn: ServerConnection) -> None:
        self.target = target
        self.conn = conn
        self.out = bytearray()
        self.slow: dict[int, bytes | None] = {}
        self.streams: dict[int, _Stream] = {}

    def handle(self, event: ConnectionEvent) -> None:
        """React to one event of the server machine."""
        if isinstance(event, Call):
            self._call(event)
        elif isinstance(event, Cancel):
            self._cancel(event.id)
        elif isinstance(event, Chunk):
            stream = self.streams.get(event.id)
            if stream is not None and event.stream == self.target.stream_in:
                stream.pending += event.data
                stream.input_ended = event.end
                self._pump(event.id)
        elif isinstance(event, Credit) and event.id in self.streams:
            self._pump(event.id)

    def _answer(self, message: Reply | Error, rid: bytes | None = None) -> None:
        self.out += self.conn.send(message)
        if rid is not None:
            self.target.kept[rid] = message

    def _error(self, call_id: int, code: ErrorCode, text: str, data: Any = None) -> Error:
        return Error(id=call_id, code=int(code), message=text, data=to_raw(data))

    def _call(self, call: Call) -> None:
        vocab = self.target
        if call.rid is not None and call.rid in vocab.kept and call.method != vocab.attach:
            self._answer(_renumbered(vocab.kept[call.rid], call.id))
            return
        try:
            params = msgspec.msgpack.decode(call.params)
        except (msgspec.DecodeError, RecursionError):
            params = None
        if call.method not in vocab.methods:
            self._answer(self._error(call.id, ErrorCode.UNKNOWN_METHOD, f"no method {call.method}"))
            return
        if not isinstance(params, dict):
            self._answer(self._error(call.id, ErrorCode.INVALID_PARAMS, "params must be a map"))
            return
        if call.method == vocab.noop:
            self._answer(Reply(id=call.id), call.rid)
        elif call.method == vocab.echo:
            data = params.get("data", b"")
            budget = self.conn.peer_max_frame - limits.REPLY_OVERHEAD
            if not isinstance(data, bytes):
                self._answer(self._error(call.id, ErrorCode.INVALID_PARAMS, "data must be binary"))
            elif len(ENCODER.encode(data)) > budget:
                self._answer(self._error(call.id, ErrorCode.TOO_LARGE, "too large"), call.rid)
            else:
                self._answer(Reply(id=call.id, result=to_raw(data)), call.rid)
        elif call.method == vocab.slow:
            self.slow[call.id] = call.rid
        elif call.method == vocab.stream:
            self.streams[call.id] = _Stream(rid=call.rid)
        elif call.method == vocab.attach:
            self._attach(call.id, params.get("rid"))

    def _attach(self, call_id: int, rid: Any) -> None:
        if not isinstance(rid, bytes) or len(rid) != limits.REQUEST_ID_SIZE:
            self._answer(self._error(call_id, ErrorCode.INVALID_PARAMS, "rid must be 16 bytes"))
        elif rid in self.target.kept:
            self._answer(_renumbered(self.target.kept[rid], call_id))
        else:
            data = {"reason": "unknown", "rid": rid.hex()}
            self._answer(self._error(call_id, ErrorCode.REQUEST_NOT_KNOWN, "not known", data))

    def _cancel(self, call_id: int) -> None:
        if call_id in self.slow:
            rid = self.slow.pop(call_id)
            self._answer(self._error(call_id, ErrorCode.CANCELLED, "cancelled"), rid)
        elif call_id in self.streams:
            rid = self.streams.pop(call_id).rid
            self._answer(self._error(call_id, ErrorCode.CANCELLED, "cancelled"), rid)

    def _pump(self, call_id: int) -> None:
        """Echo what is pending within the client's credit; finish after the input's end."""
        stream = self.streams[call_id]
        name = self.target.stream_out
        while stream.pending:
            size = min(
                len(stream.pending), self.conn.stream_credit(call_id, name), self.conn.max_chunk
            )
            if size <= 0:
                return
            piece = bytes(stream.pending[:size])
            del stream.pending[:size]
            self.out += self.conn.send(Chunk(id=call_id, stream=name, seq=stream.seq, data=piece))
            stream.seq += 1
            if not stream.input_ended:
                self.out += self.conn.grant(call_id, self.target.stream_in, size)
        if stream.input_ended:
            self.out += self.conn.send(Chunk(id=call_id, stream=name, seq=stream.seq, end=True))
            del self.streams[call_id]
            self._answer(Reply(id=call_id, result=to_raw({"pid": 0, "exit_code": 0})), stream.rid)


def _renumbered(answer: Message, call_id: int) -> Reply | Error:
    assert isinstance(answer, Reply | Error)
    return msgspec.structs.replace(answer, id=call_id)


class LoopbackLink:
    """One connection to the in-process server."""

    def __init__(self, target: LoopbackTarget) -> None:
        self.conn = ServerConnection(
            target.token, max_frame=target.max_frame, window=target.window, ciphers=target.ciphers
        )
        self.app = EchoApp(target, self.conn)
        self.output: deque[bytes] = deque()
        self.closed = False

    def send(self, data: bytes) -> None:
        """Feed the server machine; its answers wait in the output."""
        if self.closed:
            raise LinkClosed("the server closed the connection")
        try:
            events = self.conn.receive_data(data)
        except RemoteProtocolError:
            events = []
        self.output.append(self.conn.data_to_send())
        for event in events:
            if isinstance(event, Abort):
                self.closed = True
                break
            self.app.handle(event)
        self.output.append(bytes(self.app.out))
        self.app.out.clear()
        if self.conn.state.value == "closed":
            self.closed = True

    def recv(self, timeout: float) -> bytes | None:
        """What the server sent; ``b""`` once it closed and all was read; None otherwise."""
        data = b"".join(self.output)
        self.output.clear()
        if data:
            return data
        return b"" if self.closed else None

    def close(self, reset: bool = False) -> None:
        """Close the connection (the server forgets it)."""
        self.closed = True


class LoopbackTarget:
    """The reference server machine in this process, with :class:`EchoApp`.

    The method names are the machine's default vocabulary; pass others to
    match a custom :class:`~protocol.fuzz.machine.Vocabulary`.
    """

    name = "loopback"

    def __init__(
        self,
        token: bytes,
        *,
        max_frame: int = limits.DEFAULT_MAX_FRAME,
        window: int = limits.MIN_STREAM_WINDOW,
        ciphers: tuple[str, ...] = limits.KNOWN_CIPHERS,
        noop: str = "server.noop",
        echo: str = "server.echo",
        slow: str = "watch.wait_for_path",
        stream: str = "shell.run",
        stream_in: str = "stdin",
        stream_out: str = "stdout",
        attach: str = "request.attach",
    ) -> None:
        self.token = token
        self.max_frame = max_frame
        self.window = window
        self.ciphers = ciphers
        self.noop, self.echo, self.slow, self.stream, self.attach = noop, echo, slow, stream, attach
        self.stream_in, self.stream_out = stream_in, stream_out
        self.methods = frozenset({noop, echo, slow, stream, attach})
        #: Outcomes of calls with a request id, by id (kept across links).
        self.kept: dict[bytes, Message] = {}

    def connect(self) -> LoopbackLink:
        """A new connection."""
        return LoopbackLink(self)
