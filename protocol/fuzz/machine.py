"""A rule-based state machine of one client connection, for any target (needs the ``fuzz`` extra).

Theory of operation
-------------------
:func:`connection_machine` builds a :class:`hypothesis.stateful.RuleBasedStateMachine`
whose rules are what a client does with a connection: connect (a handshake
with one of the target's ciphers), calls answered at once (``server.noop``,
``server.echo``), calls that stay in flight until cancelled, a stream-echo
call (uploads within the server's credit, every byte coming back within the
credit the machine grants, then the end and the reply), cancels, pings,
request ids and ``request.attach``, one deliberate violation (answered by an
Abort with the spec's code), and an orderly close. Each rule is a few
:mod:`~protocol.fuzz.script` steps, run at once through a
:class:`~protocol.fuzz.interpreter.Session`, so the probe holds the server
to the spec throughout, and the steps of a failing run are its repro: the
machine keeps them in ``ConnectionMachine.steps``, and hypothesis
shrinks the run to the fewest rules that still fail.

The methods it calls are a :class:`Vocabulary`: by default execd's (PROTOCOL.md
section 15: ``watch.wait_for_path`` on a path that never appears stays in
flight; ``shell.run`` of ``cat`` with both streams echoes). A target with
other methods passes its own; the in-process target of
:mod:`protocol.fuzz.loopback` serves the default one.

Usage::

    from protocol.fuzz.machine import connection_machine
    from protocol.fuzz.loopback import LoopbackTarget

    TestLoopback = connection_machine(lambda: LoopbackTarget(b"t" * 32), b"t" * 32).TestCase
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protocol import limits
from protocol.fuzz import script as s
from protocol.fuzz.interpreter import FAIL, Session
from protocol.fuzz.link import Target


@dataclass(frozen=True)
class Vocabulary:
    """The methods the machine calls, and their params."""

    noop: str = "server.noop"
    echo: str = "server.echo"
    #: A call that stays in flight until cancelled.
    slow: str = "watch.wait_for_path"
    slow_params: dict[str, Any] = field(
        default_factory=lambda: {"path": "/nonexistent/splitexec-fuzz/never", "timeout": 600.0}
    )
    #: A call that sends back on ``stream_out`` what it reads on ``stream_in``, then replies.
    stream: str = "shell.run"
    stream_params: dict[str, Any] = field(
        default_factory=lambda: {"argv": ["cat"], "stdin_stream": True, "stream": True}
    )
    stream_in: str = "stdin"
    stream_out: str = "stdout"
    attach: str | None = "request.attach"


#: Violations whose answer cannot depend on timing: body, then the Abort code required.
VIOLATIONS: tuple[tuple[str, Any, int], ...] = (
    ("unknown tag", {"t": "fuzz-unknown", "id": 1}, 4),
    ("malformed body", {"$raw": "c1"}, 3),
    ("tag not a string", {"t": 7}, 5),
    ("hello after the handshake", {"t": "hello", "versions": [1]}, 5),
    ("reply sent to the server", {"t": "reply", "id": 1}, 6),
    ("ping seq out of range", {"t": "ping", "seq": -1}, 5),
)


@dataclass
class _Call:
    kind: str
    uploaded: int = 0
    ended: bool = False


class ConnectionMachine(RuleBasedStateMachine):
    """Random client sessions against a target; see the module docstring."""

    make_target: ClassVar[Callable[[], Target]]
    token: ClassVar[bytes]
    vocabulary: ClassVar[Vocabulary]
    ciphers: ClassVar[tuple[str, ...]]
    timeout: ClassVar[float] = 5.0
    #: The steps of the last run, kept when it failed: its repro.
    last_failure: ClassVar[list[s.AnyStep] | None] = None

    def __init__(self) -> None:
        super().__init__()
        machine = type(self)
        self.session = Session(machine.make_target(), machine.token, machine.timeout)
        self.steps: list[s.AnyStep] = []
        self.conn = -1
        self.open = False
        self.calls: dict[int, _Call] = {}
        self.next_id = 1

    # -- running steps ---------------------------------------------------------------------

    def do(self, *steps: s.AnyStep) -> None:
        """Run steps on the current connection, record them, fail on the first finding."""
        for step in steps:
            step = _on(step, self.conn)
            self.steps.append(step)
            self.session.run_step(len(self.steps) - 1, step)
            failed = [f.text for f in self.session.outcome.findings if f.verdict == FAIL]
            if failed:
                if type(self).last_failure is None or len(self.steps) <= len(
                    type(self).last_failure or []
                ):
                    type(self).last_failure = list(self.steps)
                raise AssertionError("; ".join(failed))

    def new_id(self) -> int:
        call_id = self.next_id
        self.next_id += 1
        return call_id

    def in_flight(self, kind: str) -> list[int]:
        return sorted(i for i, c in self.calls.items() if c.kind == kind and not c.ended)

    # -- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: not self.open)
    @rule(cipher_index=st.integers(0, 7))
    def connect(self, cipher_index: int) -> None:
        self.conn += 1
        cipher = self.ciphers[cipher_index % len(self.ciphers)]
        self.do(s.Connect(), s.Handshake(cipher=cipher))
        self.open = True
        self.calls.clear()

    @precondition(lambda self: self.open)
    @rule(data=st.binary(max_size=2000))
    def echo(self, data: bytes) -> None:
        call_id = self.new_id()
        body = {
            "t": "call",
            "id": call_id,
            "method": self.vocabulary.echo,
            "params": {"data": {"$bin": data.hex()}},
        }
        self.do(
            s.Send(body=body),
            s.Expect(want=s.ReplyWant(id=call_id, result={"$bin": data.hex()}, check_result=True)),
        )

    @precondition(lambda self: self.open)
    @rule()
    def noop(self) -> None:
        call_id = self.new_id()
        self.do(
            s.Send(body={"t": "call", "id": call_id, "method": self.vocabulary.noop}),
            s.Expect(want=s.ReplyWant(id=call_id)),
        )

    @precondition(lambda self: self.open and len(self.in_flight("slow")) < 4)
    @rule()
    def slow_call(self) -> None:
        call_id = self.new_id()
        self.calls[call_id] = _Call("slow")
        body = {
            "t": "call",
            "id": call_id,
            "method": self.vocabulary.slow,
            "params": self.vocabulary.slow_params,
        }
        self.do(s.Send(body=body))

    @precondition(
        lambda self: self.open and bool(self.in_flight("slow") or self.in_flight("stream"))
    )
    @rule(index=st.integers(0, 15))
    def cancel(self, index: int) -> None:
        ids = self.in_flight("slow") + self.in_flight("stream")
        call_id = ids[index % len(ids)]
        self.calls[call_id].ended = True
        self.do(
            s.Send(body={"t": "cancel", "id": call_id}),
            s.Expect(want=s.AnswerWant(id=call_id, codes=[102]), timeout=self.timeout * 2),
        )

    @precondition(lambda self: self.open and len(self.in_flight("stream")) < 2)
    @rule()
    def stream_call(self) -> None:
        call_id = self.new_id()
        self.calls[call_id] = _Call("stream")
        body = {
            "t": "call",
            "id": call_id,
            "method": self.vocabulary.stream,
            "params": self.vocabulary.stream_params,
        }
        self.do(s.Send(body=body))

    @precondition(lambda self: self.open and bool(self.in_flight("stream")))
    @rule(index=st.integers(0, 15), size=st.integers(0, 3 * limits.MIN_STREAM_WINDOW))
    def upload(self, index: int, size: int) -> None:
        ids = self.in_flight("stream")
        call_id = ids[index % len(ids)]
        call = self.calls[call_id]
        call.uploaded += size
        vocabulary = self.vocabulary
        self.do(
            s.Upload(id=call_id, stream=vocabulary.stream_in, total=size, end=False),
            s.Expect(
                want=s.ChunksWant(id=call_id, stream=vocabulary.stream_out, bytes=call.uploaded),
                timeout=self.timeout * 2,
            ),
        )

    @precondition(lambda self: self.open and bool(self.in_flight("stream")))
    @rule(index=st.integers(0, 15))
    def end_stream(self, index: int) -> None:
        ids = self.in_flight("stream")
        call_id = ids[index % len(ids)]
        call = self.calls[call_id]
        call.ended = True
        vocabulary = self.vocabulary
        self.do(
            s.Upload(id=call_id, stream=vocabulary.stream_in, total=0, end=True),
            s.Expect(
                want=s.ChunksWant(
                    id=call_id, stream=vocabulary.stream_out, bytes=call.uploaded, end=True
                ),
                timeout=self.timeout * 2,
            ),
            s.Expect(want=s.ReplyWant(id=call_id), timeout=self.timeout * 2),
        )

    @precondition(lambda self: self.open)
    @rule()
    def ping(self) -> None:
        self.do(s.Expect(want=s.AliveWant()))

    @precondition(lambda self: self.open and self.vocabulary.attach is not None)
    @rule(data=st.binary(max_size=64), known=st.booleans())
    def attach(self, data: bytes, known: bool) -> None:
        rid = {"$bin": os.urandom(limits.REQUEST_ID_SIZE).hex()}
        call_id = self.new_id()
        want: s.Requirement = s.ErrorWant(id=call_id, codes=[800])
        if known:
            first, call_id = call_id, self.new_id()
            echo = {"data": {"$bin": data.hex()}}
            body = {
                "t": "call",
                "id": first,
                "method": self.vocabulary.echo,
                "params": echo,
                "rid": rid,
            }
            self.do(s.Send(body=body), s.Expect(want=s.ReplyWant(id=first)))
            want = s.ReplyWant(id=call_id, same_as=first)
        body = {
            "t": "call",
            "id": call_id,
            "method": self.vocabulary.attach,
            "params": {"rid": rid},
        }
        self.do(s.Send(body=body), s.Expect(want=want))

    @precondition(lambda self: self.open)
    @rule(which=st.sampled_from(VIOLATIONS))
    def violate(self, which: tuple[str, Any, int]) -> None:
        _, body, code = which
        if "$raw" in body:
            self.do(s.SendBody(hex=body["$raw"]))
        else:
            self.do(s.Send(body=body))
        self.open = False
        self.do(s.Expect(want=s.AbortWant(codes=[code])))

    @precondition(lambda self: self.open)
    @rule(reset=st.booleans())
    def close(self, reset: bool) -> None:
        self.open = False
        if reset:
            self.do(s.Close(reset=True))
        else:
            self.do(
                s.Send(body={"t": "abort", "code": 15}), s.Expect(want=s.ClosedWant(quiet=True))
            )

    # -- the end -------------------------------------------------------------------------------

    @invariant()
    def nothing_failed(self) -> None:
        failed = [f.text for f in self.session.outcome.findings if f.verdict == FAIL]
        assert not failed, failed

    def teardown(self) -> None:
        try:
            failed = any(f.verdict == FAIL for f in self.session.outcome.findings)
            if self.open and not failed:
                for call_id in self.in_flight("slow") + self.in_flight("stream"):
                    self.calls[call_id].ended = True
                    self.do(
                        s.Send(body={"t": "cancel", "id": call_id}),
                        s.Expect(
                            want=s.AnswerWant(id=call_id, codes=[102]), timeout=self.timeout * 2
                        ),
                    )
        finally:
            self.session.close()


def _on(step: s.AnyStep, conn: int) -> s.AnyStep:
    import msgspec

    return msgspec.structs.replace(step, conn=conn)


def connection_machine(
    target_factory: Callable[[], Target],
    token: bytes,
    *,
    ciphers: tuple[str, ...] = (limits.CIPHER_NONE,),
    vocabulary: Vocabulary | None = None,
    timeout: float = 5.0,
) -> type[ConnectionMachine]:
    """A machine class for one target (``target_factory()`` is called once per run)."""
    return type(
        "ConnectionMachineFor",
        (ConnectionMachine,),
        {
            "make_target": staticmethod(target_factory),
            "token": token,
            "ciphers": ciphers,
            "vocabulary": vocabulary or Vocabulary(),
            "timeout": timeout,
            "last_failure": None,
        },
    )
