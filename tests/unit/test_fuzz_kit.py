"""The fuzz kit's own parts, without a server: the spec it reads, its scripts, its catalogue."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from protocol import limits
from protocol.fuzz import script as s
from protocol.fuzz.cases import Case, Facts, catalogue
from protocol.fuzz.export import vectors
from protocol.fuzz.interpreter import PASS, Session, pad_body
from protocol.fuzz.loopback import LoopbackTarget
from protocol.fuzz.repro import Repro, minimize
from protocol.fuzz.spec import spec_limits
from protocol.vectors import all_vectors

TOKEN = b"k" * 32


def test_the_numbers_read_from_the_spec_are_the_protocols() -> None:
    table = spec_limits()
    assert len(table) >= 15
    for name, value in table.items():
        assert getattr(limits, name) == value, name


def test_case_ids_are_unique_and_every_section_has_cases() -> None:
    ids = [case.id for case in catalogue()]
    assert len(ids) == len(set(ids))
    sections = Counter(case.section for case in catalogue())
    assert set(sections) >= {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16}


@pytest.mark.parametrize("case", catalogue(), ids=lambda c: c.id)
def test_every_script_survives_json(case: Case) -> None:
    built = case.script_for(Facts())
    assert isinstance(built, s.Script)
    assert s.Script.from_json(built.to_json()) == built


#: Cases the in-process application cannot stand for: it answers these methods
#: only as the state machine's vocabulary needs, not as execd does.
_NOT_EMULATED = ("shell.run",)


def _reference_cases() -> list[Case]:
    chosen: list[Case] = []
    for case in catalogue():
        if case.slow or any(m in _NOT_EMULATED for m in case.methods):
            continue
        if (
            case.id.startswith("15.")
            and "/" in case.id
            and not case.id.startswith(("15.server.", "15.request."))
        ):
            continue
        chosen.append(case)
    return chosen


@pytest.mark.parametrize("case", _reference_cases(), ids=lambda c: c.id)
def test_the_reference_machine_passes_the_catalogue(case: Case) -> None:
    """The sans-I/O ServerConnection (with the loopback application) meets every requirement."""
    target = LoopbackTarget(TOKEN)
    built = case.script_for(Facts(methods=target.methods))
    if isinstance(built, str):
        pytest.skip(built)
    outcome = Session(target, TOKEN, 0.2).run(built)
    assert outcome.verdict == PASS, [f.text for f in outcome.findings]


def test_a_broken_requirement_fails_and_minimizes_to_what_provokes_it(tmp_path: Path) -> None:
    target = LoopbackTarget(TOKEN)
    script = s.script(
        s.Connect(),
        s.Handshake(),
        s.Send(body={"t": "ping", "seq": 1}),
        s.Expect(want=s.PongWant(seq=1)),
        s.Send(body={"t": "call", "id": 1, "method": "server.noop"}),
        s.Expect(want=s.ReplyWant(id=1)),
        s.Send(body={"t": "ping", "seq": 2}),
        # Wrong on purpose: a Ping is not answered by an Abort.
        s.Expect(want=s.AbortWant(codes=[5])),
    )
    outcome = Session(target, TOKEN, 0.1).run(script)
    assert outcome.verdict == "fail"
    smaller = minimize(
        script, outcome, lambda sc: Session(LoopbackTarget(TOKEN), TOKEN, 0.1).run(sc)
    )
    kinds = [type(step).__name__ for step in smaller.steps]
    assert kinds == ["Connect", "Handshake", "Send", "Send", "Send", "Expect"], kinds
    path = Repro.of(_Named(), smaller, outcome, "loopback", 7).save(tmp_path)
    loaded = Repro.load(path)
    assert loaded.script == smaller and loaded.seed == 7
    assert json.loads(path.read_text())["script"]["steps"][0] == {"op": "connect"}


class _Named:
    id = "example"
    title = "a Ping answered by an Abort"
    requires = "nothing: this requirement is wrong"


def test_padding_makes_frames_of_the_exact_size() -> None:
    body = msgspec.msgpack.encode({"t": "ping", "seq": 1})
    for size in (64, 274, 275, 276, 65_560, 70_000, limits.PREAUTH_MAX_FRAME):
        assert len(pad_body(body, size, sealed=False)) == size
        assert len(pad_body(body, size, sealed=True)) == size - limits.AEAD_TAG_SIZE


def test_the_export_holds_section_16_and_every_case() -> None:
    data = vectors()
    first = all_vectors()[0]
    assert data["handshake"][0]["client mac"] == first.client_mac.hex()
    assert data["handshake"][0]["hello frame"] == first.hello_frame.hex()
    assert len(data["cases"]) == len(catalogue())
    assert all(case["requires"] and case["script"] for case in data["cases"])
