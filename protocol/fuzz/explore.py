"""Open-ended fuzzing after the catalogue, for a time or example budget (needs the ``fuzz`` extra).

Theory of operation
-------------------
Two phases share the budget, each as hypothesis runs of a few dozen examples
with seeds drawn from the run's seed (reported, so ``--seed`` repeats a run):

1. *Bytes before the handshake.* Mutations of valid and invalid Hellos and of
   random frame streams (:mod:`protocol.fuzz.strategies`) go to a fresh
   connection. The reference :class:`~protocol.connection.ServerConnection`,
   fed the same bytes, says what the spec requires back: a Challenge, an
   Abort with a given code, or nothing yet (an incomplete frame). The server
   must do the same (another Abort code is non-strict, not a failure).
2. *Sessions after it* (with the token): the connection state machine of
   :mod:`protocol.fuzz.machine` against the server.

After every example the runner's checks run (a healthy client is served;
locally descriptors, memory and marked processes). A failing example is
shrunk by hypothesis, within a time bound, and its script saved as a repro
with its seed. A phase stops at its first failure.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.stateful import run_state_machine_as_test

from protocol import limits
from protocol.codec import decode_message
from protocol.connection import ServerConnection
from protocol.errors import RemoteProtocolError
from protocol.framing import FrameReader
from protocol.fuzz import script as s
from protocol.fuzz import strategies as fz
from protocol.fuzz.interpreter import FAIL, Outcome
from protocol.fuzz.machine import connection_machine
from protocol.fuzz.report import FuzzResult
from protocol.fuzz.repro import Repro, signature
from protocol.fuzz.runner import Runner
from protocol.messages import Challenge, Hello

#: Examples per hypothesis run.
BATCH = 40
#: Seconds hypothesis may spend shrinking one failure.
SHRINK_SECONDS = 20.0


class FuzzFailure(AssertionError):
    """An example broke the specification (raised from one place, so hypothesis sees one bug)."""


class _Kind:
    """What a repro of the fuzzing names as its case."""

    def __init__(self, name: str, requires: str) -> None:
        self.id = f"fuzz.{name}"
        self.title = name
        self.requires = requires


def expected_preauth(data: bytes, ciphers: tuple[str, ...]) -> list[s.AnyStep]:
    """What the spec requires back for ``data`` sent before the handshake, as Expect steps."""
    conn = ServerConnection(b"reference-token", ciphers=ciphers or limits.KNOWN_CIPHERS)
    try:
        conn.receive_data(data)
        code = None
    except RemoteProtocolError as exc:
        code = int(exc.code)
    out = conn.data_to_send()
    steps: list[s.AnyStep] = []
    reader = FrameReader(limits.PREAUTH_MAX_FRAME)
    reader.feed(out)
    while (frame := reader.next_frame()) is not None:
        if isinstance(decode_message(frame), Challenge):
            steps.append(s.Expect(want=s.ChallengeWant()))
    if code is not None:
        steps.append(s.Expect(want=s.AbortWant(codes=[code])))
    return steps


def _hello_frame() -> bytes:
    hello = Hello(
        versions=[1],
        nonce=bytes(32),
        ciphers=list(limits.KNOWN_CIPHERS),
        max_frame=limits.DEFAULT_MAX_FRAME,
        window=limits.DEFAULT_STREAM_WINDOW,
    )
    body = msgspec.msgpack.encode(hello)
    return len(body).to_bytes(4, "big") + body


def preauth_inputs() -> st.SearchStrategy[bytes]:
    """Bytes a fuzzer sends first: mutated Hellos, broken Hellos, random frames, raw bytes."""
    frame = _hello_frame()
    broken = fz.invalid_hellos().map(lambda pair: len(pair[0]).to_bytes(4, "big") + pair[0])
    valid = fz.hellos().map(msgspec.msgpack.encode).map(lambda b: len(b).to_bytes(4, "big") + b)
    return st.one_of(
        fz.mutations(frame),
        broken,
        valid.flatmap(fz.mutations),
        fz.frame_streams(max_size=3),
        st.binary(max_size=64),
    )


class _Budget:
    def __init__(self, seconds: float, examples: int | None) -> None:
        self.deadline = time.monotonic() + seconds
        self.left = examples
        self.count = 0

    def spent(self) -> bool:
        return time.monotonic() >= self.deadline or (
            self.left is not None and self.count >= self.left
        )


def explore(
    runner: Runner, seconds: float, examples: int | None, master_seed: int | None, out: Path
) -> FuzzResult:
    """Fuzz the runner's target for ``seconds`` (and at most ``examples``); report what broke."""
    master = master_seed if master_seed is not None else random.SystemRandom().randrange(2**32)
    rng = random.Random(master)
    result = FuzzResult(seed=master)
    started = time.monotonic()
    phases = [_preauth_phase]
    if runner.token is not None:
        phases.append(_session_phase)
    for index, phase in enumerate(phases):
        share = (seconds - (time.monotonic() - started)) / (len(phases) - index)
        left = None if examples is None else max(0, examples - result.examples)
        budget = _Budget(share, left)
        phase(runner, budget, rng, result, out)
        result.examples += budget.count
    result.elapsed = time.monotonic() - started
    return result


def _save(
    result: FuzzResult,
    kind: _Kind,
    script: s.Script,
    outcome: Outcome,
    runner: Runner,
    batch_seed: int,
    out: Path,
) -> None:
    repro = Repro.of(kind, script, outcome, runner.target.name, batch_seed)
    path = repro.save(out / "repros")
    finding = next((f.text for f in outcome.findings if f.verdict == FAIL), "failed")
    result.failures.append(
        {"kind": kind.id, "finding": finding, "repro": str(path), "seed": batch_seed}
    )


def _preauth_phase(
    runner: Runner, budget: _Budget, rng: random.Random, result: FuzzResult, out: Path
) -> None:
    kind = _Kind("preauth-bytes", "what the reference server machine answers the same bytes with")
    while not budget.spent():
        batch_seed = rng.randrange(2**32)
        found = _preauth_batch(runner, budget, batch_seed)
        if found is not None:
            _save(result, kind, found[0], found[1], runner, batch_seed, out)
            return


def _preauth_batch(
    runner: Runner, budget: _Budget, batch_seed: int
) -> tuple[s.Script, Outcome] | None:
    """One hypothesis run of pre-authentication examples: its shrunk failure, if any."""
    last: dict[str, Any] = {}

    @seed(batch_seed)
    @settings(
        max_examples=BATCH,
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate, Phase.shrink],
    )
    @given(data=preauth_inputs())
    def example(data: bytes) -> None:
        failure = last.get("frozen")
        if failure is None and budget.spent() and "script" not in last:
            return  # out of time: the rest of this batch does nothing
        if failure is None:
            budget.count += 1
            expected = expected_preauth(data, runner.facts.ciphers)
            script = s.script(s.Connect(), s.SendBytes(hex=data.hex()), *expected)
            outcome = runner.judge(script)
            if outcome.verdict == FAIL:
                last.update(script=script, outcome=outcome)
                last.setdefault("first", time.monotonic())
                failure = sorted(signature(outcome))
                if time.monotonic() - last["first"] > SHRINK_SECONDS:
                    last["frozen"] = failure
        if failure is not None:
            raise FuzzFailure(failure)

    try:
        example()
    except FuzzFailure:
        return last["script"], last["outcome"]
    except HypothesisException:
        return None
    return None


def _session_phase(
    runner: Runner, budget: _Budget, rng: random.Random, result: FuzzResult, out: Path
) -> None:
    assert runner.token is not None
    base = connection_machine(
        lambda: runner.target,
        runner.token,
        ciphers=runner.facts.ciphers or (limits.CIPHER_NONE,),
        timeout=runner.options.timeout,
    )
    kind = _Kind("sessions", "every rule's requirement (see protocol.fuzz.machine)")

    frozen: dict[str, Any] = {}

    class Checked(base):  # type: ignore[valid-type,misc]
        """The machine, with the runner's checks after each run and bounds on its time."""

        def do(self, *steps: s.AnyStep) -> None:
            if "failure" in frozen:
                raise FuzzFailure(frozen["failure"])
            if budget.spent() and "first" not in frozen:
                return  # out of time: the rest of this run does nothing
            try:
                super().do(*steps)
            except AssertionError as exc:
                self._failed(str(exc))

        def _failed(self, text: str) -> None:
            first = frozen.setdefault("first", time.monotonic())
            if time.monotonic() - first > SHRINK_SECONDS:
                frozen["failure"] = text
            raise FuzzFailure(text)

        def teardown(self) -> None:
            budget.count += 1
            super().teardown()
            if "failure" in frozen or any(f.verdict == FAIL for f in self.session.outcome.findings):
                return
            outcome = Outcome()
            runner.check_after(outcome, s.Script(steps=list(self.steps), needs_token=True))
            if outcome.verdict == FAIL:
                type(self).last_failure = list(self.steps)
                self._failed("; ".join(f.text for f in outcome.findings))

    while not budget.spent():
        batch_seed = rng.randrange(2**32)
        Checked.last_failure = None
        machine_settings = settings(
            max_examples=max(1, BATCH // 4),
            stateful_step_count=25,
            deadline=None,
            database=None,
            report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck),
        )
        seeded = seed(batch_seed)(Checked)
        try:
            run_state_machine_as_test(seeded, settings=machine_settings)
        except (AssertionError, HypothesisException) as exc:
            steps = Checked.last_failure or []
            script = s.Script(steps=steps, needs_token=True)
            outcome = runner.judge(script)
            if outcome.verdict != FAIL:
                # Not reproduced by the steps alone: keep what the run itself saw.
                outcome.add(-1, FAIL, f"in the fuzzing run (not reproduced on replay): {exc}")
            _save(result, kind, script, outcome, runner, batch_seed, out)
            return
