"""Reports of a run: a terminal summary, Markdown, HTML, JSON and JUnit XML.

All of them are made from one :class:`Report`: the target, when and how long,
every case's result, and what the open-ended fuzzing found.
"""

from __future__ import annotations

import html
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec

from protocol.fuzz.interpreter import FAIL, NON_STRICT, PASS, SKIPPED, worst
from protocol.fuzz.runner import CaseResult

VERDICTS: Final = (PASS, NON_STRICT, FAIL, SKIPPED)
_MARK: Final = {PASS: "ok", NON_STRICT: "NON-STRICT", FAIL: "FAIL", SKIPPED: "skip"}
_COLOUR: Final = {PASS: "#d7f5d7", NON_STRICT: "#fff2c2", FAIL: "#f8c8c8", SKIPPED: "#e8e8e8"}


@dataclass
class FuzzResult:
    """What the open-ended fuzzing did and found."""

    examples: int = 0
    elapsed: float = 0.0
    seed: int | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Report:
    """One run."""

    target: str
    started: str
    elapsed: float = 0.0
    token: bool = False
    local_pid: int | None = None
    ciphers: list[str] = field(default_factory=list)
    restarts: int = 0
    cases: list[CaseResult] = field(default_factory=list)
    fuzz: FuzzResult | None = None

    @property
    def verdict(self) -> str:
        """The worst verdict of the run (fuzz failures count as failures)."""
        verdicts = [c.verdict for c in self.cases]
        if self.fuzz is not None and self.fuzz.failures:
            verdicts.append(FAIL)
        return worst(*verdicts)

    def counts(self) -> Counter[str]:
        """Cases by verdict."""
        return Counter(c.verdict for c in self.cases)

    def by_section(self) -> dict[int, Counter[str]]:
        """Cases by section, then verdict."""
        sections: dict[int, Counter[str]] = {}
        for case in self.cases:
            sections.setdefault(int(case.id.split(".")[0]), Counter())[case.verdict] += 1
        return dict(sorted(sections.items()))

    # -- writers ------------------------------------------------------------------------

    def terminal(self) -> str:
        """The summary printed at the end of a run."""
        lines = [f"protocol conformance of {self.target}: {self.verdict.upper()}"]
        lines.append(f"{'section':>8}  " + "  ".join(f"{v:>10}" for v in VERDICTS))
        for section, counts in self.by_section().items():
            lines.append(f"{section:>8}  " + "  ".join(f"{counts[v]:>10}" for v in VERDICTS))
        total = self.counts()
        lines.append(f"{'all':>8}  " + "  ".join(f"{total[v]:>10}" for v in VERDICTS))
        for case in self.cases:
            if case.verdict in (FAIL, NON_STRICT):
                lines.append(f"  {_MARK[case.verdict]:<10} {case.id} {case.title}")
                lines.extend(f"             {text}" for text in case.findings[:4])
                if case.repro:
                    lines.append(f"             repro: {case.repro}")
        if self.fuzz is not None:
            fuzz = self.fuzz
            lines.append(
                f"fuzzing: {fuzz.examples} examples in {fuzz.elapsed:.1f} s (seed {fuzz.seed}), "
                f"{len(fuzz.failures)} failures"
            )
            for failure in fuzz.failures:
                lines.append(f"  FAIL       {failure['kind']}: {failure['finding']}")
                lines.append(f"             repro: {failure['repro']} (seed {failure['seed']})")
        lines.append(f"{len(self.cases)} cases in {self.elapsed:.1f} s")
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (what the JSON report holds)."""
        return {
            "kit": "splitexec-fuzz",
            "target": self.target,
            "started": self.started,
            "elapsed": round(self.elapsed, 3),
            "verdict": self.verdict,
            "token": self.token,
            "local_pid": self.local_pid,
            "ciphers": self.ciphers,
            "restarts": self.restarts,
            "summary": {v: self.counts()[v] for v in VERDICTS},
            "sections": {str(k): {v: c[v] for v in VERDICTS} for k, c in self.by_section().items()},
            "cases": [asdict(c) for c in self.cases],
            "fuzz": asdict(self.fuzz) if self.fuzz is not None else None,
        }

    def json(self) -> bytes:
        """The JSON report."""
        return msgspec.json.format(msgspec.json.encode(self.to_dict()), indent=2) + b"\n"

    def markdown(self) -> str:
        """The Markdown report."""
        out = [
            f"# Protocol conformance of `{self.target}`",
            "",
            f"Verdict: **{self.verdict}**. Started {self.started}, {self.elapsed:.1f} s, "
            f"token {'given' if self.token else 'not given'}, "
            f"local checks {'on (pid ' + str(self.local_pid) + ')' if self.local_pid else 'off'}, "
            f"ciphers accepted: {', '.join(self.ciphers) or 'none'}.",
            "",
            "| section | " + " | ".join(VERDICTS) + " |",
            "|---|" + "---|" * len(VERDICTS),
        ]
        for section, counts in self.by_section().items():
            out.append(f"| {section} | " + " | ".join(str(counts[v]) for v in VERDICTS) + " |")
        out += ["", "| case | PROTOCOL.md | title | verdict |", "|---|---|---|---|"]
        for case in self.cases:
            out.append(f"| {case.id} | {case.ref} | {case.title} | {case.verdict} |")
        troubles = [c for c in self.cases if c.verdict in (FAIL, NON_STRICT)]
        if troubles:
            out += ["", "## Findings", ""]
            for case in troubles:
                out += [f"### {case.id} {case.title}: {case.verdict}", ""]
                out += [f"* sends: {case.sends}", f"* requires: {case.requires}"]
                out += [f"* found: {text}" for text in case.findings]
                if case.repro:
                    out.append(f"* repro: `{case.repro}`")
                out.append("")
        if self.fuzz is not None:
            out += ["", "## Open-ended fuzzing", ""]
            out.append(
                f"{self.fuzz.examples} examples in {self.fuzz.elapsed:.1f} s, seed {self.fuzz.seed}, "
                f"{len(self.fuzz.failures)} failures."
            )
            for failure in self.fuzz.failures:
                out.append(
                    f"* {failure['kind']}: {failure['finding']} (repro `{failure['repro']}`)"
                )
        return "\n".join(out) + "\n"

    def html(self) -> str:
        """The HTML report: one table row per case, coloured by verdict, findings below it."""
        rows = []
        for case in self.cases:
            details = "".join(f"<li>{html.escape(t)}</li>" for t in case.findings)
            if case.repro:
                details += f"<li>repro: <code>{html.escape(case.repro)}</code></li>"
            rows.append(
                f'<tr style="background:{_COLOUR[case.verdict]}"><td>{html.escape(case.id)}</td>'
                f"<td>{html.escape(case.ref)}</td><td>{html.escape(case.title)}"
                f"<br><small>sends: {html.escape(case.sends)}<br>requires: "
                f"{html.escape(case.requires)}</small>{'<ul>' + details + '</ul>' if details else ''}"
                f"</td><td>{case.verdict}</td><td>{case.elapsed:.2f} s</td></tr>"
            )
        counts = self.counts()
        summary = ", ".join(f"{counts[v]} {v}" for v in VERDICTS)
        return (
            "<!doctype html><meta charset=utf-8>"
            f"<title>Protocol conformance of {html.escape(self.target)}</title>"
            "<style>body{font-family:sans-serif}td{vertical-align:top;padding:4px}"
            "table{border-collapse:collapse}</style>"
            f"<h1>Protocol conformance of {html.escape(self.target)}: {self.verdict}</h1>"
            f"<p>{html.escape(self.started)}, {self.elapsed:.1f} s: {summary}.</p>"
            "<table><tr><th>case</th><th>PROTOCOL.md</th><th>what</th><th>verdict</th>"
            f"<th>time</th></tr>{''.join(rows)}</table>\n"
        )

    def junit(self) -> bytes:
        """JUnit XML: a test suite per section, a test case per case."""
        suites = ET.Element("testsuites", name=f"protocol conformance of {self.target}")
        for section in self.by_section():
            cases = [c for c in self.cases if int(c.id.split(".")[0]) == section]
            counts = Counter(c.verdict for c in cases)
            suite = ET.SubElement(
                suites,
                "testsuite",
                name=f"PROTOCOL.md section {section}",
                tests=str(len(cases)),
                failures=str(counts[FAIL]),
                skipped=str(counts[SKIPPED]),
                time=f"{sum(c.elapsed for c in cases):.3f}",
            )
            for case in cases:
                element = ET.SubElement(
                    suite, "testcase", classname=f"section{section}", name=f"{case.id} {case.title}",
                    time=f"{case.elapsed:.3f}",
                )  # fmt: skip
                text = "\n".join(case.findings)
                if case.verdict == FAIL:
                    failure = ET.SubElement(
                        element, "failure", message=case.findings[0] if case.findings else ""
                    )
                    failure.text = text + (f"\nrepro: {case.repro}" if case.repro else "")
                elif case.verdict == SKIPPED:
                    ET.SubElement(element, "skipped", message=text)
                elif case.verdict == NON_STRICT:
                    ET.SubElement(element, "system-out").text = f"non-strict: {text}"
        if self.fuzz is not None:
            suite = ET.SubElement(
                suites, "testsuite", name="open-ended fuzzing", tests="1",
                failures=str(min(1, len(self.fuzz.failures))), time=f"{self.fuzz.elapsed:.3f}",
            )  # fmt: skip
            fuzzing = ET.SubElement(suite, "testcase", classname="fuzz", name="fuzzing")
            for found in self.fuzz.failures:
                ET.SubElement(fuzzing, "failure", message=str(found["finding"])).text = str(found)
        data: bytes = ET.tostring(suites, encoding="utf-8", xml_declaration=True)
        return data

    def write(self, folder: Path) -> list[Path]:
        """Write every report format into ``folder``; return the paths."""
        folder.mkdir(parents=True, exist_ok=True)
        files = {
            "report.json": self.json(),
            "report.md": self.markdown().encode(),
            "report.html": self.html().encode(),
            "junit.xml": self.junit(),
        }
        paths = []
        for name, data in files.items():
            path = folder / name
            path.write_bytes(data)
            paths.append(path)
        return paths
