"""Repro files: a failing script, minimized, saved as JSON that ``--replay`` runs again.

A repro names the case (or fuzz run) it came from, the seed when hypothesis
found it, what the specification required, what was observed, and the script
itself (:class:`~protocol.fuzz.script.Script` JSON). :func:`minimize` shrinks a
failing script before it is saved: it drops one step at a time (and then
halves raw byte payloads) while the same failures still occur, within a
budget of runs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import msgspec

from protocol.fuzz import script as s
from protocol.fuzz.interpreter import FAIL, Outcome

FORMAT: Final = 1
_DIGITS: Final = re.compile(r"\d+")


class Repro(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One saved failure."""

    kit: str = "splitexec-fuzz"
    format: int = FORMAT
    case: str
    title: str = ""
    requires: str = ""
    target: str = ""
    seed: int | None = None
    verdict: str = FAIL
    findings: list[str] = msgspec.field(default_factory=list)
    script: s.Script

    @classmethod
    def of(
        cls, case: Any, script: s.Script, outcome: Outcome, target: str, seed: int | None
    ) -> Repro:
        """A repro of ``case`` (a Case, or anything with id, title and requires)."""
        return cls(
            case=case.id,
            title=case.title,
            requires=case.requires,
            target=target,
            seed=seed,
            verdict=outcome.verdict,
            findings=[f.text for f in outcome.findings],
            script=script,
        )

    def save(self, folder: Path) -> Path:
        """Write the repro into ``folder`` (created); return the file's path."""
        folder.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.case)
        path = folder / f"{stem}.json"
        n = 1
        while path.exists():
            n += 1
            path = folder / f"{stem}-{n}.json"
        path.write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n")
        return path

    @classmethod
    def load(cls, path: Path) -> Repro:
        """Read a repro file; raises ``msgspec.DecodeError`` for a malformed one."""
        return msgspec.json.decode(path.read_bytes(), type=cls)


def signature(outcome: Outcome) -> set[str]:
    """The failures of an outcome, numbers left out, to tell one failure from another."""
    return {_DIGITS.sub("#", f.text) for f in outcome.findings if f.verdict == FAIL}


Judge = Callable[[s.Script], Outcome]


def minimize(
    script: s.Script, outcome: Outcome, judge: Judge, budget: int = 40, seconds: float = 30.0
) -> s.Script:
    """The smallest script found (fewer steps, shorter payloads) that still fails the same way."""
    wanted = signature(outcome)
    if not wanted:
        return script
    deadline = time.monotonic() + seconds
    runs = 0

    def still_fails(candidate: s.Script) -> bool:
        nonlocal runs
        runs += 1
        return bool(signature(judge(candidate)) & wanted)

    def spent() -> bool:
        return runs >= budget or time.monotonic() > deadline

    steps = list(script.steps)
    # A requirement that failed at a step needs everything that led up to it: before it only
    # other requirements may go. A failure found after the script (a leak, a crash) may come
    # from any step: any may go.
    at = [f.step for f in outcome.findings if f.verdict == FAIL]
    keep_before = min(at) if at and min(at) >= 0 else -1
    changed = True
    while changed and not spent():
        changed = False
        for index in range(len(steps) - 1, -1, -1):
            if spent():
                break
            step = steps[index]
            if index < keep_before and not isinstance(step, s.Expect):
                continue
            if index == keep_before or (isinstance(step, s.Connect) and index == 0):
                continue
            candidate = _with(script, steps[:index] + steps[index + 1 :])
            if still_fails(candidate):
                steps = list(candidate.steps)
                keep_before -= 1 if index < keep_before else 0
                changed = True
    for index, step in enumerate(steps):
        if spent():
            break
        if keep_before < 0 and isinstance(step, s.SendBytes | s.SendBody) and len(step.hex) > 8:
            shorter = msgspec.structs.replace(step, hex=step.hex[: len(step.hex) // 4 * 2])
            candidate = _with(script, [*steps[:index], shorter, *steps[index + 1 :]])
            if still_fails(candidate):
                steps = list(candidate.steps)
    return _with(script, steps)


def _with(script: s.Script, steps: list[s.AnyStep]) -> s.Script:
    return s.Script(steps=steps, needs_token=script.needs_token)
