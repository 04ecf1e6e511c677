"""What a bench report says: the headline, what did not run, verdicts only for a full run.

Reports are built from rows as the sections make them, and rendered as the
bench writes them (markdown, JSON, the pictures).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import headline
from bench.report import Report, Row, Skip, Target, link_ratios

FACTS = {
    "cores": "2",
    "cpu": "test cpu",
    "kernel": "6.1",
    "python": "3.11.7",
    "uvloop": "0.21",
    "msgspec": "0.18",
    "fastapi": "0.110",
    "uvicorn": "0.29",
    "httpx": "0.27",
    "grpcio": "1.60",
    "swe-rex": "1.4.0",
    "openssh": "OpenSSH_9.2",
    "asyncssh": "2.14",
}


def row(key: str, p50: float, unit: str = "ms", baselines: tuple[str, ...] = ()) -> Row:
    return Row(
        key=key,
        section=f"section of {key.split('.', 1)[0]}",
        label=key,
        unit=unit,
        p50=p50,
        p99=p50 * 2,
        n=10,
        baselines=baselines,
    )


def report(rows: list[Row], *, quick: bool, skipped: list[Skip] | None = None) -> Report:
    link_ratios(rows)
    return Report(rows=rows, facts=FACTS, quick=quick, seconds=3.0, skipped=skipped or [])


def full_rows() -> list[Row]:
    noop = row("noop.execd", 90.0, "us", ("noop.floor",))
    noop.target = Target("p50 <= 1.3x floor", 90.0 / 80.0, 1.3)
    spawn = row("spawn.execd", 1.2, baselines=("spawn.floor",))
    spawn.target = Target("p50 <= floor + 0.08 ms", 0.2, 0.08)
    return [
        row("noop.floor", 80.0, "us"),
        row("noop.http", 720.0, "us"),
        row("noop.grpc", 320.0, "us"),
        noop,
        row("spawn.floor", 1.0),
        spawn,
        row("files.small.raw_read", 0.09),
        row("files.small.execd_read", 0.14),
        row("ssh.true.execd", 1.5),
        row("ssh.true.ssh", 4.5, baselines=("ssh.true.execd",)),
        row("ssh.read.execd", 0.2),
        row("ssh.read.ssh", 1.0, baselines=("ssh.read.execd",)),
    ]


def table_lines(text: str) -> list[str]:
    """The main table's lines, from its header on (the headline has a table of its own above)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| figure |"))
    return [line for line in lines[start:] if line.startswith("| ")]


def test_a_full_run_judges_its_targets() -> None:
    text = report(full_rows(), quick=False).to_markdown()
    lines = table_lines(text)
    assert lines[0] == "| figure | p50 | p99 | ratio (p50) | target | met |"
    noop = next(line for line in lines if line.startswith("| noop.execd "))
    spawn = next(line for line in lines if line.startswith("| spawn.execd "))
    assert noop.endswith("| p50 <= 1.3x floor | met |")
    assert spawn.endswith("| p50 <= floor + 0.08 ms | **missed** |")


def test_a_quick_run_shows_figures_without_verdicts() -> None:
    built = report(full_rows(), quick=True)
    text = built.to_markdown()
    lines = table_lines(text)
    assert lines[0] == "| figure | p50 | p99 | ratio (p50) |"
    assert all(line.count("|") == 5 for line in lines), lines
    assert "met" not in " ".join(lines) and "missed" not in text
    assert "no verdicts" in text
    targets = [item["target"] for item in built.to_json()["rows"] if item["target"]]
    assert len(targets) == 2
    assert all(target["met"] is None for target in targets)
    assert {target["limit"] for target in targets} == {1.3, 0.08}


def test_the_headline_opens_the_report_with_each_call_beside_the_floor_and_baselines() -> None:
    built = report(full_rows(), quick=False)
    text = built.to_markdown()
    assert text.startswith("One tool call (full run): ")
    lines = text.splitlines()
    assert lines[2] == "| call | execd | floor | FastAPI (HTTP) | gRPC | OpenSSH |"
    assert lines[4] == (
        "| no-op | 90.0 us | 80.0 us (0.89x) | 720 us (8.00x) | 320 us (3.56x) | - |"
    )
    # OpenSSH's ratio is against the execd measured beside it (1.5 ms), not section 3's.
    assert lines[5] == "| `true` | 1.20 ms | 1.00 ms (0.83x) | - | - | 4.50 ms (3.00x) |"
    assert lines[6] == "| 4 KiB read | 140 us | 90.0 us (0.64x) | - | - | 1.00 ms (5.00x) |"
    figures = {item["call"]: item["figures"] for item in built.to_json()["headline"]}
    assert figures["`true`"]["OpenSSH"] == {"p50_ms": pytest.approx(4.5), "times_execd": 3.0}
    assert figures["no-op"]["execd"] == {"p50_ms": pytest.approx(0.09), "times_execd": None}


def test_without_the_main_sections_the_headline_takes_execd_from_a_peer_section() -> None:
    rows = [row("ssh.true.execd", 1.5), row("ssh.true.ssh", 4.5, baselines=("ssh.true.execd",))]
    lines = headline.markdown(report(rows, quick=True))
    assert lines[2] == "| call | execd | OpenSSH |"
    assert lines[4] == "| `true` | 1.50 ms | 4.50 ms (3.00x) |"
    assert len(lines) == 6


def test_no_execd_figure_no_headline() -> None:
    built = report([row("model.floor", 0.1)], quick=True)
    assert headline.markdown(built) == []
    assert built.to_markdown().startswith("Machine: ")


def test_skipped_sections_are_listed_and_the_header_names_only_baselines_that_ran() -> None:
    skips = [
        Skip("12. SWE-ReX", "SWE-ReX's client cannot be imported (No module named 'aiohttp')"),
        Skip("13. OpenSSH", "sshd is not installed"),
    ]
    built = report(full_rows()[:4], quick=True, skipped=skips)
    text = built.to_markdown()
    assert "Not measured:\n\n- 12. SWE-ReX: SWE-ReX's client cannot be imported" in text
    assert "\n- 13. OpenSSH: sshd is not installed\n" in text
    machine = next(line for line in text.splitlines() if line.startswith("Machine: "))
    assert "FastAPI 0.110" in machine and "grpcio 1.60" in machine
    assert "SWE-ReX" not in machine and "OpenSSH" not in machine
    assert built.to_json()["skipped"] == [
        {"section": skip.section, "reason": skip.reason} for skip in skips
    ]


def test_the_pictures(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    full = report(full_rows(), quick=False).write(tmp_path / "full")
    quick = report(full_rows(), quick=True).write(tmp_path / "quick")
    assert [path.name for path in full] == [
        "bench.md",
        "bench.json",
        "bench.png",
        "bench-targets.png",
    ]
    # The target view colours verdicts, which a quick run does not give.
    assert [path.name for path in quick] == ["bench.md", "bench.json", "bench.png"]
    for path in [*full[2:], quick[2]]:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(full[1].read_text())["quick"] is False
