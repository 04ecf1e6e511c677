"""Rows, targets, machine facts, and the three outputs: markdown, JSON and a PNG plot.

A :class:`Row` is one figure: its p50 and p99 in its unit, the keys of the
baseline rows it is compared with (ratios are p50 over p50, computed by
:func:`link_ratios`), and optionally a :class:`Target`. Rates (unit ending in
``/s``) compare the other way round: their ratio is this rate over the
baseline's, so 0.5 means half the baseline's throughput. A :class:`Skip` is a
section, or a part of one, that could not run, and why: the report lists them
under its headline (:mod:`bench.headline`). A quick run's samples are too
small to judge a target by: its report shows the figures without verdicts.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from bench import headline
from bench.stats import Summary, with_unit


@dataclass(frozen=True, slots=True)
class Target:
    """A goal for one figure: ``value`` (the compared quantity) against ``limit``."""

    text: str
    value: float
    limit: float
    higher_is_better: bool = False

    @property
    def met(self) -> bool:
        """Whether the figure reaches its goal."""
        if self.higher_is_better:
            return self.value >= self.limit
        return self.value <= self.limit

    @property
    def budget(self) -> float:
        """How much of the allowance is used: at most 1.0 when met."""
        if self.higher_is_better:
            return self.limit / self.value if self.value > 0 else float("inf")
        return self.value / self.limit if self.limit > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class Skip:
    """A section, or a part of one, that did not run, and why."""

    section: str
    reason: str


@dataclass(slots=True)
class Row:
    """One measured figure."""

    key: str
    section: str
    label: str
    unit: str
    p50: float
    p99: float
    n: int
    baselines: tuple[str, ...] = ()
    short: str = ""
    ratios: dict[str, float] = field(default_factory=dict)
    target: Target | None = None
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def is_rate(self) -> bool:
        """True for throughputs (higher is better)."""
        return self.unit.endswith("/s")


class Verdict(Protocol):
    """A stand-alone run's report: whether it passed, and its figures as JSON values."""

    @property
    def ok(self) -> bool: ...

    def summary(self) -> Mapping[str, object]: ...


V = TypeVar("V", bound=Verdict)


def finish(report: V, as_json: bool, show: Callable[[V], None]) -> int:
    """Print ``report`` as one JSON line or through ``show``; the exit status: 0 when ok."""
    if as_json:
        print(json.dumps(report.summary()))
    else:
        show(report)
    return 0 if report.ok else 1


@dataclass(frozen=True, slots=True)
class Step:
    """One figure of a ladder (see :meth:`SectionRows.ladder`): its key, label, summary and plot name."""

    key: str
    label: str
    summary: Summary
    short: str = ""


@dataclass(frozen=True, slots=True)
class SectionRows:
    """Builds the rows of one report section: its title and unit are said once."""

    section: str
    unit: str

    def row(
        self,
        key: str,
        label: str,
        summary: Summary,
        *,
        short: str = "",
        baselines: tuple[str, ...] = (),
        note: str = "",
        extra: dict[str, float] | None = None,
    ) -> Row:
        """The row of ``summary`` (its p50, p99 and count) under ``key``."""
        return Row(
            key=key,
            section=self.section,
            label=label,
            unit=self.unit,
            **summary.figures(),
            baselines=baselines,
            short=short,
            note=note,
            extra=extra or {},
        )

    def ladder(self, *steps: Step) -> list[Row]:
        """One row per step, each compared with every step before it: a floor, then what stands on it."""
        rows: list[Row] = []
        for step in steps:
            baselines = tuple(row.key for row in rows)
            rows.append(
                self.row(step.key, step.label, step.summary, short=step.short, baselines=baselines)
            )
        return rows


def link_ratios(rows: list[Row]) -> None:
    """Fill every row's ``ratios`` from the p50 of the baseline rows it names."""
    by_key = {row.key: row for row in rows}
    for row in rows:
        for key in row.baselines:
            base = by_key.get(key)
            if base is None or base.p50 == 0:
                continue
            row.ratios[key] = row.p50 / base.p50


def machine_facts() -> dict[str, str]:
    """Cores, CPU, kernel, Python and the versions of the libraries that matter."""
    facts = {
        "cores": str(os.cpu_count()),
        "usable cores": str(len(os.sched_getaffinity(0))),
        "cpu": _cpu_model(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
    }
    for name in (
        "uvloop",
        "msgspec",
        "cryptography",
        "fastapi",
        "uvicorn",
        "httpx",
        "grpcio",
        "swe-rex",
        "asyncssh",
    ):
        try:
            facts[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            facts[name] = "not installed"
    return facts


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


@dataclass(slots=True)
class Report:
    """Everything one run produced."""

    rows: list[Row]
    facts: dict[str, str]
    quick: bool
    seconds: float
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    skipped: list[Skip] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: facts, settings and every row."""
        rows = []
        for row in self.rows:
            item = asdict(row)
            item["target"] = (
                None
                if row.target is None
                else {
                    **asdict(row.target),
                    # A quick run's samples are too small to judge by.
                    "met": None if self.quick else row.target.met,
                    "budget": row.target.budget,
                }
            )
            rows.append(item)
        return {
            "facts": self.facts,
            "quick": self.quick,
            "seconds": self.seconds,
            "started": self.started,
            "notes": self.notes,
            "headline": headline.to_json(self),
            "skipped": [asdict(skip) for skip in self.skipped],
            "rows": rows,
        }

    def to_markdown(self) -> str:
        """The headline, what did not run, the machine facts and the table."""
        lines = [*headline.markdown(self), *self._skipped_lines(), self._machine_line(), ""]
        if self.quick:
            lines += [
                "Quick run: samples too small to judge a target by, so no verdicts.",
                "",
                "| figure | p50 | p99 | ratio (p50) |",
                "| --- | ---: | ---: | --- |",
            ]
        else:
            lines += [
                "| figure | p50 | p99 | ratio (p50) | target | met |",
                "| --- | ---: | ---: | --- | --- | :---: |",
            ]
        by_key = {row.key: row for row in self.rows}
        section = None
        for row in self.rows:
            if row.section != section:
                section = row.section
                lines.append(f"| **{section}** | | | |" + ("" if self.quick else " | |"))
            ratios = ", ".join(
                _ratio_text(row, by_key[key], value) for key, value in row.ratios.items()
            )
            label = row.label + (f" ({row.note})" if row.note else "")
            line = f"| {label} | {with_unit(row.p50, row.unit)} | {with_unit(row.p99, row.unit)} | {ratios} |"
            if not self.quick:
                target = row.target.text if row.target else ""
                met = "" if row.target is None else ("met" if row.target.met else "**missed**")
                line += f" {target} | {met} |"
            lines.append(line)
        if self.notes:
            lines.append("")
            lines.extend(f"- {note}" for note in self.notes)
        return "\n".join(lines) + "\n"

    def _skipped_lines(self) -> list[str]:
        if not self.skipped:
            return []
        lines = ["Not measured:", ""]
        lines += [f"- {skip.section}: {skip.reason}" for skip in self.skipped]
        return [*lines, ""]

    def _machine_line(self) -> str:
        facts = self.facts
        run = "Quick run" if self.quick else "Full run"
        return (
            f"Machine: {facts.get('cores')} cores ({facts.get('cpu')}), Linux "
            f"{facts.get('kernel')}, Python {facts.get('python')}, uvloop {facts.get('uvloop')}, "
            f"msgspec {facts.get('msgspec')}{self._baselines_text()}. {run} in "
            f"{self.seconds:.0f} s, everything on loopback."
        )

    def _baselines_text(self) -> str:
        """The baselines this report has rows of, with their versions (none that did not run)."""
        facts = self.facts
        keys = {row.key for row in self.rows}
        named = []
        if "noop.http" in keys:
            named.append(
                f"FastAPI {facts.get('fastapi')} on uvicorn {facts.get('uvicorn')} + httpx "
                f"{facts.get('httpx')}"
            )
        if "noop.grpc" in keys:
            named.append(f"grpcio {facts.get('grpcio')}")
        if any(key.startswith("swerex.") for key in keys):
            named.append(f"SWE-ReX {facts.get('swe-rex')}")
        if any(key.startswith("ssh.") for key in keys):
            named.append(f"{facts.get('openssh')} + asyncssh {facts.get('asyncssh')}")
        return f"; baselines: {', '.join(named)}" if named else ""

    def write(self, out_dir: Path, *, plot: bool = True) -> list[Path]:
        """Write bench.md, bench.json and (with matplotlib) the pictures; return the paths.

        ``bench.png`` is the headline's latencies; a full run also writes
        ``bench-targets.png``, how much of each target's allowance is used.
        """
        out_dir.mkdir(parents=True, exist_ok=True)
        written = [out_dir / "bench.md", out_dir / "bench.json"]
        written[0].write_text(self.to_markdown(), encoding="utf-8")
        written[1].write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        if plot:
            pictures = [(out_dir / "bench.png", headline.write_plot)]
            if not self.quick:
                pictures.append((out_dir / "bench-targets.png", write_plot))
            for path, draw in pictures:
                if draw(self, path):
                    written.append(path)
        return written


def _ratio_text(row: Row, base: Row, value: float) -> str:
    name = base.short or base.label
    if row.is_rate:
        return f"{value:.2f} of {name}"
    return f"{value:.2f}x {name}"


def write_plot(report: Report, path: Path) -> bool:
    """A bar chart of every target's budget use (1.0 = exactly at target); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [row for row in report.rows if row.target is not None]
    if not rows:
        return False
    # The section number keeps labels apart (a label may recur in two sections).
    labels = [f"{row.section.split('.', 1)[0]}. {row.label}" for row in rows]
    budgets = [min(row.target.budget, 10.0) if row.target else 0.0 for row in rows]
    colors = ["#2e7d32" if row.target and row.target.met else "#c62828" for row in rows]
    fig, axis = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    axis.barh(labels, budgets, color=colors)
    axis.axvline(1.0, color="black", linewidth=1)
    axis.invert_yaxis()
    axis.set_xlabel("share of the target's allowance used (1.0 = at target; green met, red missed)")
    axis.set_title(
        f"execd bench ({'quick' if report.quick else 'full'}): "
        f"{report.facts.get('cores')} cores, Python {report.facts.get('python')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
