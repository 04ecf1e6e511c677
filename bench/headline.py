"""The headline of a bench report: what one tool call costs, beside the floor and every baseline.

Three calls an agent's tools make all the time: a call that does nothing,
``true`` as a command, and a 4 KiB file read. For each, the p50 of execd,
of the floor (the least a uvloop server in another process does for the
same call: echo a frame, spawn ``true``, send 4 KiB from memory) and of each
baseline that makes such a call. Every figure comes from a row of the same
run; next to a non-execd figure is how many times execd's p50 it is, against
the execd row measured beside it in the same batches (SWE-ReX's and
OpenSSH's sections time an execd of their own next to them). A baseline
with no rows in the report (not installed, skipped, or ``--only`` left its
section out) has no column.

:func:`markdown` gives the lines at the top of ``bench.md`` and the terminal
output, :func:`to_json` the same figures for ``bench.json``, and
:func:`write_plot` draws them as ``bench.png``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from bench.stats import with_unit

if TYPE_CHECKING:
    from bench.report import Report, Row


@dataclass(frozen=True, slots=True)
class Cell:
    """Where one figure of the headline comes from: its row, and the execd row it is compared with."""

    key: str
    execd: str


@dataclass(frozen=True, slots=True)
class Call:
    """One headline call: its name, execd's rows (the first present counts), the other columns'."""

    name: str
    execd: tuple[str, ...]
    cells: dict[str, Cell]


COLUMNS: Final = ("execd", "floor", "FastAPI (HTTP)", "gRPC", "SWE-ReX", "OpenSSH")
CALLS: Final = (
    Call(
        "no-op",
        ("noop.execd", "swerex.noop.execd"),
        {
            "floor": Cell("noop.floor", "noop.execd"),
            "FastAPI (HTTP)": Cell("noop.http", "noop.execd"),
            "gRPC": Cell("noop.grpc", "noop.execd"),
            "SWE-ReX": Cell("swerex.noop.swerex", "swerex.noop.execd"),
        },
    ),
    Call(
        "`true`",
        ("spawn.execd", "ssh.true.execd", "swerex.true.execd"),
        {
            "floor": Cell("spawn.floor", "spawn.execd"),
            "SWE-ReX": Cell("swerex.true.swerex", "swerex.true.execd"),
            "OpenSSH": Cell("ssh.true.ssh", "ssh.true.execd"),
        },
    ),
    Call(
        "4 KiB read",
        ("files.small.execd_read", "ssh.read.execd", "swerex.read.execd"),
        {
            "floor": Cell("files.small.raw_read", "files.small.execd_read"),
            "SWE-ReX": Cell("swerex.read.swerex", "swerex.read.execd"),
            "OpenSSH": Cell("ssh.read.ssh", "ssh.read.execd"),
        },
    ),
)
EXPLANATION: Final = (
    "p50 of one call at a time on loopback, this run. (Nx): times the p50 of execd measured "
    "beside it in the same batches. Floor: the least a uvloop server in another process does "
    "for the same call (echo a frame, spawn true, send 4 KiB from memory)."
)
_SECONDS: Final = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True, slots=True)
class Figure:
    """One cell's figure: the p50 in seconds, and its ratio to the execd row beside it."""

    seconds: float
    ratio: float | None


def figures(report: Report) -> dict[str, dict[str, Figure]]:
    """Per call (that has an execd figure), per column (that has any figure): the figures."""
    by_key = {row.key: row for row in report.rows}
    table: dict[str, dict[str, Figure]] = {}
    for call in CALLS:
        execd = next((by_key[key] for key in call.execd if key in by_key), None)
        if execd is None:
            continue
        found = {"execd": Figure(_seconds(execd), None)}
        for column, cell in call.cells.items():
            row, base = by_key.get(cell.key), by_key.get(cell.execd)
            if row is not None and base is not None and base.p50 > 0:
                found[column] = Figure(_seconds(row), row.p50 / base.p50)
        table[call.name] = found
    return table


def _seconds(row: Row) -> float:
    return row.p50 * _SECONDS[row.unit]


def _columns(table: dict[str, dict[str, Figure]]) -> list[str]:
    return [column for column in COLUMNS if any(column in cells for cells in table.values())]


def markdown(report: Report) -> list[str]:
    """The headline's lines (a title, a small table, what it means); none without an execd figure."""
    table = figures(report)
    if not table:
        return []
    columns = _columns(table)
    lines = [
        f"One tool call ({'quick' if report.quick else 'full'} run): {EXPLANATION}",
        "",
        "| call | " + " | ".join(columns) + " |",
        "| --- |" + " ---: |" * len(columns),
    ]
    for name, cells in table.items():
        texts = [_cell_text(cells.get(column)) for column in columns]
        lines.append(f"| {name} | " + " | ".join(texts) + " |")
    return [*lines, ""]


def _cell_text(figure: Figure | None) -> str:
    if figure is None:
        return "-"
    text = duration_text(figure.seconds)
    if figure.ratio is None:
        return text
    ratio = f"{figure.ratio:.0f}x" if figure.ratio >= 10 else f"{figure.ratio:.2f}x"
    return f"{text} ({ratio})"


def duration_text(seconds: float) -> str:
    """``87.8 us``, ``1.24 ms``, ``118 ms``, ``1.20 s``: about three significant figures."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return with_unit(seconds / scale, unit)
    return with_unit(seconds / 1e-6, "us")


def to_json(report: Report) -> list[dict[str, Any]]:
    """The headline's figures: per call, per column, the p50 in milliseconds and the ratio."""
    return [
        {
            "call": name,
            "figures": {
                column: {"p50_ms": figure.seconds * 1000, "times_execd": figure.ratio}
                for column, figure in cells.items()
            },
        }
        for name, cells in figures(report).items()
    ]


#: One colour per column, the same in every picture.
_COLOURS: Final = {
    "execd": "#1565c0",
    "floor": "#9e9e9e",
    "FastAPI (HTTP)": "#ef6c00",
    "gRPC": "#6a1b9a",
    "SWE-ReX": "#2e7d32",
    "OpenSSH": "#c62828",
}


def write_plot(report: Report, path: Path) -> bool:
    """The headline as grouped bars on a log scale; False without matplotlib or figures."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return False
    table = figures(report)
    if not table:
        return False
    columns = _columns(table)
    height = 0.8 / len(columns)
    fig, axis = plt.subplots(figsize=(10, 1.2 + 0.35 * len(columns) * len(table)))
    for index, column in enumerate(columns):
        spots, values = [], []
        for group, cells in enumerate(table.values()):
            if column in cells:
                spots.append(group + index * height)
                values.append(cells[column].seconds * 1000)
        bars = axis.barh(spots, values, height=height * 0.9, color=_COLOURS[column], label=column)
        axis.bar_label(
            bars, labels=[duration_text(v / 1000) for v in values], padding=3, fontsize=8
        )
    axis.set_yticks([group + height * (len(columns) - 1) / 2 for group in range(len(table))])
    axis.set_yticklabels([name.replace("`", "") for name in table])
    axis.invert_yaxis()
    axis.set_xscale("log")
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_xlim(right=axis.get_xlim()[1] * 4)
    axis.set_xlabel("p50 latency of one call (ms, log scale; shorter is faster)")
    axis.set_title(
        f"One tool call on loopback: execd beside the floor and the baselines\n"
        f"({'quick' if report.quick else 'full'} run, {report.facts.get('cores')} cores, "
        f"Python {report.facts.get('python')})"
    )
    axis.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
