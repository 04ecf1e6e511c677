"""Running a script against a target, and judging what came back.

A :class:`Session` runs steps one at a time (:meth:`Session.run_step`), so the
state machine can act step by step, or a whole :class:`~protocol.fuzz.script.Script`
(:meth:`Session.run`). Each connection of the script is a
:class:`~protocol.fuzz.probe.Probe`. Every :class:`~protocol.fuzz.script.Expect`
is judged here; so are the probes' violations, after every step. The result
is an :class:`Outcome`: the worst verdict met, with a finding for each
requirement that was not met, and a short log of what went over the wire.

Verdicts, from best to worst: ``pass``; ``non-strict`` (a SHOULD or MAY was
not followed, or a violation was met with an Abort of another code or by a
close without an Abort: the peer is safe but not exact); ``fail`` (a MUST was
broken).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from protocol import limits
from protocol.codec import ENCODER
from protocol.errors import ErrorCode
from protocol.framing import frame_header
from protocol.fuzz import script as s
from protocol.fuzz.link import Target
from protocol.fuzz.probe import Probe, fresh_nonce
from protocol.messages import Chunk, Error, Event, Hello, Message, Pong, Reply

PASS: Final = "pass"  # noqa: S105 (a verdict, not a password)
NON_STRICT: Final = "non-strict"
FAIL: Final = "fail"
SKIPPED: Final = "skipped"
_RANK: Final = {SKIPPED: 0, PASS: 1, NON_STRICT: 2, FAIL: 3}
#: The field a padded message carries its padding in (unknown, so ignored).
PAD_FIELD: Final = "~pad"


def worst(*verdicts: str) -> str:
    """The worst of ``verdicts`` (pass when none)."""
    return max(verdicts, key=_RANK.__getitem__, default=PASS)


@dataclass
class Finding:
    """A requirement not met, at step ``step`` (0-based; -1: after the script)."""

    step: int
    verdict: str
    text: str


@dataclass
class Outcome:
    """What running a script gave."""

    verdict: str = PASS
    findings: list[Finding] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    elapsed: float = 0.0

    def add(self, step: int, verdict: str, text: str) -> None:
        """Record a finding and lower the verdict."""
        self.findings.append(Finding(step, verdict, text))
        self.verdict = worst(self.verdict, verdict)


class StepFailed(Exception):
    """A step could not go on (the connection it needs is gone, a handshake was refused)."""


def pad_body(body: bytes, frame_length: int, sealed: bool) -> bytes:
    """``body`` (a msgpack map of fewer than 15 entries) with padding making its frame that long."""
    target = frame_length - (limits.AEAD_TAG_SIZE if sealed else 0)
    if not 0x80 <= body[0] <= 0x8E:
        raise ValueError("only a small map can be padded")
    key = ENCODER.encode(PAD_FIELD)
    base = 1 + len(body) - 1 + len(key)  # new map header, old entries, the key
    # bin 8, bin 16 or bin 32: a wider header than needed is still valid msgpack, so
    # every size is reachable.
    for marker, width in ((0xC4, 1), (0xC5, 2), (0xC6, 4)):
        size = target - base - 1 - width
        if 0 <= size < 1 << (8 * width):
            pad = bytes([marker]) + size.to_bytes(width, "big") + bytes(size)
            return bytes([body[0] + 1]) + body[1:] + key + pad
    raise ValueError(f"a frame of {frame_length} bytes cannot hold this message")


class Session:
    """Runs steps on numbered connections to one target."""

    def __init__(self, target: Target, token: bytes | None, timeout: float = 5.0) -> None:
        self.target = target
        self.token = token
        self.timeout = timeout
        self.probes: dict[int, Probe] = {}
        self.outcome = Outcome()
        self._seen_violations: dict[int, int] = {}
        self._current = 0

    # -- running -------------------------------------------------------------------------

    def run(self, script: s.Script) -> Outcome:
        """Run every step (stopping at the first that cannot go on), then close everything."""
        started = time.monotonic()
        try:
            for index, step in enumerate(script.steps):
                if not self.run_step(index, step):
                    break
        finally:
            self.close()
            self.outcome.elapsed = time.monotonic() - started
        return self.outcome

    def run_step(self, index: int, step: s.AnyStep) -> bool:
        """Run one step; False when the script cannot go on."""
        self._current = index
        try:
            self._do(step)
        except StepFailed as exc:
            self.outcome.add(index, FAIL, str(exc))
            self._collect_violations(index)
            return False
        except OSError as exc:
            self.outcome.add(index, FAIL, f"connection {step.conn}: {exc}")
            return False
        self._collect_violations(index)
        return True

    def close(self) -> None:
        """Close every connection."""
        for probe in self.probes.values():
            probe.close()

    def _collect_violations(self, index: int) -> None:
        for conn, probe in self.probes.items():
            seen = self._seen_violations.get(conn, 0)
            for text in probe.violations[seen:]:
                self.outcome.add(index, FAIL, f"connection {conn}: {text}")
            self._seen_violations[conn] = len(probe.violations)

    def log(self, text: str) -> None:
        """Add a line to the outcome's log."""
        self.outcome.log.append(text)

    def probe(self, conn: int) -> Probe:
        """The probe of connection ``conn``."""
        try:
            return self.probes[conn]
        except KeyError:
            raise StepFailed(f"connection {conn} was never opened") from None

    # -- actions -------------------------------------------------------------------------

    def _do(self, step: s.AnyStep) -> None:
        kind = type(step)
        handler = _ACTIONS.get(kind)
        if handler is None:
            raise TypeError(f"no action for {kind.__name__}")
        handler(self, step)

    def _connect(self, step: s.Connect) -> None:
        self.probes[step.conn] = Probe(self.target.connect(), self.token)
        self.log(f"[{step.conn}] connect")

    def _close(self, step: s.Close) -> None:
        self.probe(step.conn).close(step.reset)
        self.log(f"[{step.conn}] close{' (reset)' if step.reset else ''}")

    def _send_bytes(self, step: s.SendBytes) -> None:
        data = bytes.fromhex(step.hex)
        self.probe(step.conn).send_raw(data, step.split)
        self.log(f"[{step.conn}] > {len(data)} raw bytes {_short_hex(data)}")

    def _send_header(self, step: s.SendHeader) -> None:
        probe = self.probe(step.conn)
        length = s.size_of(step.length, probe.values)
        probe.send_raw(frame_header(length))
        self.log(f"[{step.conn}] > a header announcing {length} bytes")

    def _send(self, step: s.Send) -> None:
        probe = self.probe(step.conn)
        body = s.encode_body(step.body, probe.values)
        if step.pad_to is not None:
            length = s.size_of(step.pad_to, probe.values)
            body = pad_body(body, length, probe.sealed and not step.plain)
        probe.send_body(body, plain=step.plain, tamper=step.tamper, split=step.split)
        self.log(f"[{step.conn}] > {_describe_body(body)}{' (tampered)' if step.tamper else ''}")

    def _send_body(self, step: s.SendBody) -> None:
        body = bytes.fromhex(step.hex)
        self.probe(step.conn).send_body(body, split=step.split)
        self.log(f"[{step.conn}] > body of {len(body)} bytes {_short_hex(body)}")

    def _resend(self, step: s.Resend) -> None:
        source = self.probe(step.source)
        try:
            frame = source.sent[step.index].frame
        except IndexError:
            raise StepFailed(f"connection {step.source} sent no frame {step.index}") from None
        self.probe(step.conn).send_raw(frame)
        self.log(f"[{step.conn}] > frame {step.index} of connection {step.source} again")

    def _handshake(self, step: s.Handshake) -> None:
        probe = self.probe(step.conn)
        nonce = bytes.fromhex(step.nonce) if step.nonce else fresh_nonce()
        hello = Hello(
            versions=[limits.PROTOCOL_VERSION],
            nonce=nonce,
            ciphers=[step.cipher],
            max_frame=step.max_frame,
            window=step.window,
        )
        probe.send_message(hello)
        deadline = time.monotonic() + self.timeout
        probe.wait(lambda: probe.challenge is not None or probe.state == "closed", deadline)
        if probe.challenge is None:
            raise StepFailed(f"handshake ({step.cipher}): {_no_answer(probe, 'Challenge')}")
        probe.send_body(ENCODER.encode({"t": "auth", "mac": probe.auth_mac()}))
        probe.wait(lambda: probe.welcome is not None or probe.state == "closed", deadline)
        if probe.welcome is None:
            raise StepFailed(f"handshake ({step.cipher}): {_no_answer(probe, 'Welcome')}")
        self.log(f"[{step.conn}] handshake, cipher {probe.challenge.cipher}")

    def _auth(self, step: s.Auth) -> None:
        probe = self.probe(step.conn)
        if step.mac == "valid":
            mac = probe.auth_mac(step.transcript_ciphers)
        elif step.mac == "random":
            mac = os.urandom(limits.MAC_SIZE)
        else:
            mac = bytes.fromhex(step.mac)
        probe.send_body(ENCODER.encode({"t": "auth", "mac": mac}))
        self.log(f"[{step.conn}] > auth ({step.mac if len(step.mac) < 12 else 'given mac'})")

    def _upload(self, step: s.Upload) -> None:
        probe = self.probe(step.conn)
        total = s.size_of(step.total, probe.values)
        most = s.size_of(step.chunk, probe.values) if step.chunk is not None else probe.max_chunk
        sent = 0
        while True:
            size = min(most, total - sent)
            if step.respect_credit:
                deadline = time.monotonic() + self.timeout
                if not probe.wait(lambda: probe.up_credit(step.id, step.stream) > 0, deadline):
                    raise StepFailed(f"no credit for stream {step.stream!r} of call {step.id}")
                size = min(size, probe.up_credit(step.id, step.stream))
            last = sent + size >= total
            chunk = Chunk(
                id=step.id,
                stream=step.stream,
                seq=probe.next_up_seq(step.id, step.stream),
                data=s.pattern(sent, size),
                end=step.end and last,
            )
            probe.send_message(chunk)
            sent += size
            if last:
                break
            probe.pump(0)
        self.log(f"[{step.conn}] > {sent} bytes on stream {step.stream!r} of call {step.id}")

    def _grant(self, step: s.Grant) -> None:
        probe = self.probe(step.conn)
        amount = s.size_of(step.bytes, probe.values)
        probe.grant(step.id, step.stream, amount)
        self.log(f"[{step.conn}] > credit {amount} for {step.stream!r} of call {step.id}")

    def _configure(self, step: s.Configure) -> None:
        self.probe(step.conn).auto_grant = step.auto_grant

    def _sleep(self, step: s.Sleep) -> None:
        deadline = time.monotonic() + step.seconds
        probe = self.probes.get(step.conn)
        if probe is None:
            time.sleep(step.seconds)
            return
        probe.wait(lambda: False, deadline)

    # -- requirements ----------------------------------------------------------------------

    def _expect(self, step: s.Expect) -> None:
        probe = self.probe(step.conn)
        timeout = step.timeout if step.timeout is not None else self.timeout
        deadline = time.monotonic() + timeout
        judge = _JUDGES[type(step.want)]
        problem = judge(self, probe, step.want, deadline)
        if problem is None:
            self.log(f"[{step.conn}] ok: {step.want.__struct_config__.tag}")
            return
        verdict, text = problem
        if verdict == FAIL and step.otherwise == NON_STRICT:
            verdict = NON_STRICT
        self.outcome.add(self._current, verdict, f"connection {step.conn}: {text}")
        self.log(f"[{step.conn}] {verdict}: {text}")


Problem = tuple[str, str] | None
_Judge = Callable[[Session, Probe, Any, float], Problem]


def _no_answer(probe: Probe, what: str) -> str:
    if probe.abort is not None:
        return f"the server sent Abort {probe.abort.code} ({probe.abort.message!r}) instead of a {what}"
    if probe.eof:
        return f"the server closed the connection instead of sending a {what}"
    return f"no {what} came in time"


def _take(probe: Probe, match: Callable[[Message], bool]) -> Message | None:
    for message in probe.inbox:
        if match(message):
            probe.inbox.remove(message)
            return message
    return None


def _wait_take(probe: Probe, match: Callable[[Message], bool], deadline: float) -> Message | None:
    found: list[Message] = []

    def done() -> bool:
        message = _take(probe, match)
        if message is not None:
            found.append(message)
        return bool(found) or probe.state == "closed"

    probe.wait(done, deadline)
    if not found:
        message = _take(probe, match)
        if message is not None:
            found.append(message)
    return found[0] if found else None


def _judge_abort(session: Session, probe: Probe, want: s.AbortWant, deadline: float) -> Problem:
    probe.wait(lambda: probe.state == "closed", deadline)
    abort = probe.abort
    if abort is None:
        if probe.eof:
            return NON_STRICT, f"closed without an Abort where Abort {_codes(want.codes)} was due"
        return FAIL, f"no Abort {_codes(want.codes)} and the connection stayed open"
    if abort.code not in want.codes:
        text = f"Abort {abort.code} ({abort.message!r}) where {_codes(want.codes)} was due"
        if abort.code == ErrorCode.HANDSHAKE_TIMEOUT:
            # Timing out is not noticing: the violation itself went unanswered.
            return FAIL, f"no Abort {_codes(want.codes)}: the server only timed out ({text})"
        return NON_STRICT, text
    if want.message is not None and abort.message != want.message:
        return FAIL, f"the Abort's message is {abort.message!r}, not {want.message!r}"
    probe.wait(lambda: probe.eof, time.monotonic() + session.timeout)
    if not probe.eof:
        return NON_STRICT, "the server sent its Abort but kept the connection open"
    return None


def _judge_challenge(
    session: Session, probe: Probe, want: s.ChallengeWant, deadline: float
) -> Problem:
    probe.wait(lambda: probe.challenge is not None or probe.state == "closed", deadline)
    challenge = probe.challenge
    if challenge is None:
        return FAIL, _no_answer(probe, "Challenge")
    if want.version is not None and challenge.version != want.version:
        return FAIL, f"the Challenge chose version {challenge.version}, not {want.version}"
    if want.cipher is not None and challenge.cipher != want.cipher:
        return FAIL, f"the Challenge chose cipher {challenge.cipher!r}, not {want.cipher!r}"
    return None


def _judge_welcome(session: Session, probe: Probe, want: s.WelcomeWant, deadline: float) -> Problem:
    probe.wait(lambda: probe.welcome is not None or probe.state == "closed", deadline)
    if probe.welcome is None:
        return FAIL, _no_answer(probe, "Welcome")
    return None


def _answer_to(call_id: int) -> Callable[[Message], bool]:
    return lambda m: isinstance(m, Reply | Error) and m.id == call_id


def _describe_answer(message: Message | None, probe: Probe, call_id: int) -> str:
    if isinstance(message, Error):
        return f"call {call_id} failed with {message.code} ({message.message[:120]!r})"
    if isinstance(message, Reply):
        return f"call {call_id} got a Reply"
    return _no_answer(probe, f"answer to call {call_id}")


def _judge_reply(session: Session, probe: Probe, want: s.ReplyWant, deadline: float) -> Problem:
    message = _wait_take(probe, _answer_to(want.id), deadline)
    if not isinstance(message, Reply):
        return FAIL, _describe_answer(message, probe, want.id)
    if want.check_result:
        expected = s.to_value(want.result, probe.values)
        got = msgspec.msgpack.decode(message.result)
        if got != expected:
            return FAIL, f"call {want.id} returned {_short(got)}, not {_short(expected)}"
    if want.same_as is not None:
        earlier = probe.results.get(want.same_as)
        if earlier != bytes(message.result):
            return FAIL, f"call {want.id}'s result differs from call {want.same_as}'s"
    if want.capture:
        result = msgspec.msgpack.decode(message.result)
        for name in want.capture:
            value = result.get(name) if isinstance(result, dict) else None
            if not isinstance(value, int) or isinstance(value, bool):
                return FAIL, f"call {want.id}'s result has no integer {name!r}"
            probe.captured[name] = value
    return None


def _judge_event(session: Session, probe: Probe, want: s.EventWant, deadline: float) -> Problem:
    topic = s.size_of(want.topic, probe.values)
    message = _wait_take(
        probe, lambda m: isinstance(m, Event) and m.topic == topic and m.name == want.name, deadline
    )
    if message is None:
        return FAIL, _no_answer(probe, f"Event {want.name!r} of topic {topic}")
    return None


def _judge_error(session: Session, probe: Probe, want: s.ErrorWant, deadline: float) -> Problem:
    message = _wait_take(probe, _answer_to(want.id), deadline)
    if not isinstance(message, Error) or message.code not in want.codes:
        text = _describe_answer(message, probe, want.id)
        return FAIL, f"{text}; Error {_codes(want.codes)} was due"
    if want.data is not None:
        data = msgspec.msgpack.decode(message.data)
        expected = s.to_value(want.data, probe.values)
        if not isinstance(data, dict) or any(data.get(k) != v for k, v in expected.items()):
            return FAIL, f"the Error's data is {_short(data)}, not {_short(expected)}"
    return None


def _judge_answer(session: Session, probe: Probe, want: s.AnswerWant, deadline: float) -> Problem:
    message = _wait_take(probe, _answer_to(want.id), deadline)
    if isinstance(message, Reply):
        return None
    if isinstance(message, Error) and (not want.codes or message.code in want.codes):
        return None
    return FAIL, _describe_answer(message, probe, want.id)


def _judge_pong(session: Session, probe: Probe, want: s.PongWant, deadline: float) -> Problem:
    message = _wait_take(probe, lambda m: isinstance(m, Pong) and m.seq == want.seq, deadline)
    if message is None:
        return FAIL, _no_answer(probe, f"Pong {want.seq}")
    return None


def _judge_alive(session: Session, probe: Probe, want: s.AliveWant, deadline: float) -> Problem:
    if probe.state == "closed" or probe.eof:
        return FAIL, _no_answer(probe, "Pong (the connection should have lived)")
    seq = probe.ping()
    return _judge_pong(session, probe, s.PongWant(seq=seq), deadline)


def _judge_closed(session: Session, probe: Probe, want: s.ClosedWant, deadline: float) -> Problem:
    before = len(probe.received)
    probe.wait(lambda: probe.eof, deadline)
    if not probe.eof:
        return FAIL, "the server did not close the connection"
    answered = probe.received[before:]
    if want.quiet and answered:
        names = ", ".join(type(m).__name__ for m in answered)
        return FAIL, f"the server answered ({names}) where it must send nothing"
    return None


def _judge_chunks(session: Session, probe: Probe, want: s.ChunksWant, deadline: float) -> Problem:
    size = s.size_of(want.bytes, probe.values)

    def done() -> bool:
        got, ended = probe.down_received(want.id, want.stream)
        return got >= size and (ended or not want.end)

    if not probe.wait(done, deadline):
        got, ended = probe.down_received(want.id, want.stream)
        state = "ended" if ended else "not ended"
        return FAIL, f"{got} of {size} bytes on stream {want.stream!r} of call {want.id} ({state})"
    return None


def _judge_no_chunks(
    session: Session, probe: Probe, want: s.NoChunksWant, deadline: float
) -> Problem:
    before, _ = probe.down_received(want.id, want.stream)
    probe.wait(lambda: False, time.monotonic() + want.seconds)
    after, _ = probe.down_received(want.id, want.stream)
    if after > before:
        return FAIL, f"{after - before} more bytes arrived on stream {want.stream!r}"
    return None


def _judge_nonces(
    session: Session, probe: Probe, want: s.DistinctNoncesWant, deadline: float
) -> Problem:
    nonces = []
    for conn in want.conns:
        other = session.probe(conn)
        other.wait(lambda o=other: o.challenge is not None or o.state == "closed", deadline)
        if other.challenge is None:
            return FAIL, f"connection {conn}: {_no_answer(other, 'Challenge')}"
        nonces.append(other.challenge.nonce)
    if len(set(nonces)) != len(nonces):
        return FAIL, "two Challenges carry the same server nonce"
    return None


def _judge_first_accepted(
    session: Session, probe: Probe, want: s.FirstAcceptedWant, deadline: float
) -> Problem:
    accepted = set()
    for conn in want.probes:
        other = session.probe(conn)
        other.wait(lambda o=other: o.challenge is not None or o.state == "closed", deadline)
        if other.challenge is not None and other.hello is not None:
            accepted.add(other.hello.ciphers[0])
    probe.wait(lambda: probe.challenge is not None or probe.state == "closed", deadline)
    if probe.hello is None:
        return FAIL, "no Hello was sent"
    due = next((c for c in probe.hello.ciphers if c in accepted), None)
    if probe.challenge is None:
        if due is None:
            return None
        return FAIL, f"{_no_answer(probe, 'Challenge')} although {due!r} is accepted"
    if probe.challenge.cipher != due:
        return FAIL, f"the server chose {probe.challenge.cipher!r} where {due!r} came first"
    return None


_JUDGES: Final[dict[type[s.Want], _Judge]] = {
    s.AbortWant: _judge_abort,
    s.ChallengeWant: _judge_challenge,
    s.WelcomeWant: _judge_welcome,
    s.ReplyWant: _judge_reply,
    s.ErrorWant: _judge_error,
    s.AnswerWant: _judge_answer,
    s.EventWant: _judge_event,
    s.PongWant: _judge_pong,
    s.AliveWant: _judge_alive,
    s.ClosedWant: _judge_closed,
    s.ChunksWant: _judge_chunks,
    s.NoChunksWant: _judge_no_chunks,
    s.DistinctNoncesWant: _judge_nonces,
    s.FirstAcceptedWant: _judge_first_accepted,
}

_ACTIONS: Final[dict[type[s.Step], Callable[[Session, Any], None]]] = {
    s.Connect: Session._connect,
    s.Close: Session._close,
    s.SendBytes: Session._send_bytes,
    s.SendHeader: Session._send_header,
    s.Send: Session._send,
    s.SendBody: Session._send_body,
    s.Resend: Session._resend,
    s.Handshake: Session._handshake,
    s.Auth: Session._auth,
    s.Upload: Session._upload,
    s.Grant: Session._grant,
    s.Configure: Session._configure,
    s.Sleep: Session._sleep,
    s.Expect: Session._expect,
}


def _codes(codes: list[int]) -> str:
    return " or ".join(str(c) for c in codes)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _short_hex(data: bytes) -> str:
    return data[:24].hex() + ("..." if len(data) > 24 else "")


def _describe_body(body: bytes) -> str:
    try:
        value = msgspec.msgpack.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return f"body of {len(body)} bytes {_short_hex(body)}"
    if isinstance(value, dict) and isinstance(value.get("t"), str):
        return f"{value['t']} ({len(body)} bytes)"
    return f"body of {len(body)} bytes {_short_hex(body)}"
