"""Agent sessions at scale: many scripted agents in one process, each with its own execd.

    python -m bench.agents [--sessions 200] [--think SECONDS] [--lease SECONDS] [--json]

1. *Launch.* ``harnessd.serve`` starts one execd per session (its own
   working directory and state directory, a marker of this run, a lease so
   a bench killed midway leaves nothing behind for long), at most
   ``--launch-concurrency`` at a time: on one machine the execds' cold starts
   compete for the same cores, where a trainer's would each have their own
   workspace.
2. *Run.* Every agent session runs at once: a scripted model that waits
   ``--think`` seconds before each turn (the model's time) asks for a 4 KiB
   file write, ``true``, a command that leaves a process running in the
   background (``sleep`` detached from the shell: only the marker finds it),
   then a read of the file back, a listing and a pipeline, then finishes.
   Every result is checked.
3. *Close.* Every session is closed at once: marker cleanup (which must kill
   the background ``sleep``), then execd exits.

Then the whole machine is searched for any process carrying this run's
marker prefix in its environment or command line: there must be none. The
exit status is 1 on any failed check. The suite's quick bench and
``tests/e2e/test_agent_scale.py`` run the same code with fewer sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from bench import runner
from bench.report import Row, finish
from bench.settings import default_tmp
from bench.stats import percentile
from harnessd.agent import AgentResult, AgentSession
from harnessd.launcher import CloseResult, Session, serve
from harnessd.runtime import LocalRuntime
from harnessd.scripted_model import PacedModel, ScriptedModel
from harnessd.toolbox import ToolConfig

SECTION = "10. Agent sessions at scale: one harness process, one execd each"
NOTE_BYTES: Final = 4096


@dataclass(frozen=True, slots=True)
class AgentsConfig:
    """How many sessions, how paced, how bounded."""

    sessions: int = 200
    think: float = 0.05
    lease: float = 30.0
    launch_concurrency: int = 16
    start_timeout: float = 120.0

    @classmethod
    def quick(cls) -> AgentsConfig:
        """The quick run's size: every figure, a few sessions."""
        return cls(sessions=8)


@dataclass(slots=True)
class AgentsReport:
    """What one run did: per-session timings, failures, and what was left running."""

    sessions: int
    tag: str
    launch_s: list[float] = field(default_factory=list)
    run_s: list[float] = field(default_factory=list)
    close_s: list[float] = field(default_factory=list)
    launch_wall: float = 0.0
    run_wall: float = 0.0
    close_wall: float = 0.0
    tool_calls: int = 0
    killed_at_close: int = 0
    exits_seen: int = 0
    """Sessions whose close saw execd's exit in its log within its wait (the final
    process search is what checks that every execd is gone)."""
    leftover: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rss_peak_kib: int = 0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def ok(self) -> bool:
        """Every session finished and closed cleanly, and nothing of the run is left."""
        return not self.problems and not self.leftover and len(self.run_s) == self.sessions

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def script(n: int) -> list[dict[str, Any]]:
    """Session ``n``'s turns."""
    note = (f"session {n}\n" * NOTE_BYTES)[:NOTE_BYTES]
    return [
        {
            "content": "write, run, leave something running",
            "tool_calls": [
                {"name": "write_file", "arguments": {"path": "note.txt", "content": note}},
                {"name": "shell", "arguments": {"command": "true"}},
                {"name": "shell", "arguments": {"command": "sleep 600 >/dev/null 2>&1 &"}},
            ],
        },
        {
            "tool_calls": [
                {"name": "read_file", "arguments": {"path": "note.txt"}},
                {"name": "list_files", "arguments": {"path": "."}},
                {"name": "shell", "arguments": {"command": "head -n 1 note.txt | wc -c"}},
            ]
        },
        {"content": f"session {n} done"},
    ]


def check_result(n: int, result: AgentResult) -> list[str]:
    """What is wrong with session ``n``'s result (nothing, when it went as scripted)."""
    problems: list[str] = []
    if result.stop_reason != "finished" or result.final_text != f"session {n} done":
        problems.append(f"session {n} stopped with {result.stop_reason}: {result.error}")
    if result.tool_errors:
        failed = [r.text[:200] for t in result.turns for r in t.results if not r.ok]
        problems.append(f"session {n}: {result.tool_errors} tool errors: {failed}")
    elif len(result.turns) == 3:
        read = result.turns[1].results[0].text
        if not read.startswith(f"session {n}\n"):
            problems.append(f"session {n} read back {read[:40]!r}")
    if result.synced_seq != result.ledger_seq:
        problems.append(f"session {n}: ledger synced {result.synced_seq} of {result.ledger_seq}")
    return problems


def processes_mentioning(tag: str) -> list[str]:
    """Live processes (``pid: cmdline``) with ``tag`` in their environment or command line.

    Catches marked processes (the marker is in their environment) and execd
    and its supervisor (the marker is in their argv). This process and its
    ancestors are skipped; processes that vanish or cannot be read are too.
    """
    needle = tag.encode()
    skip = {os.getpid()}
    pid = os.getpid()
    while pid > 1:
        pid = _parent(pid)
        skip.add(pid)
    found: list[str] = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                cmdline = handle.read()
            with open(f"/proc/{name}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:
            continue
        if needle in cmdline or needle in environ:
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(f"{name}: {shown[:200]}")
    return found


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 1


async def wait_for_no_process(tag: str, timeout: float) -> list[str]:
    """Poll until no process mentions ``tag`` (or ``timeout``); what is still there."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_mentioning(tag)
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.1)


async def run_agents(config: AgentsConfig, tmp_dir: str | None = None) -> AgentsReport:
    """Launch, run and close ``config.sessions`` agent sessions; see the module docstring."""
    tag = f"agents-{secrets.token_hex(6)}"
    report = AgentsReport(sessions=config.sessions, tag=tag)
    report.load = os.getloadavg()
    base = tempfile.mkdtemp(prefix="bench-agents-", dir=tmp_dir or default_tmp())
    runtime = LocalRuntime()
    limit = asyncio.Semaphore(config.launch_concurrency)

    async def launch(n: int) -> Session:
        async with limit:
            started = time.perf_counter()
            session = await serve(
                runtime,
                workdir=os.path.join(base, f"execd-{n}"),
                marker=f"{tag}-{n}",
                lease=config.lease,
                start_timeout=config.start_timeout,
                extra_args=("--state-dir", os.path.join(base, f"state-{n}")),
            )
            report.launch_s.append(time.perf_counter() - started)
            return session

    async def run_one(n: int, session: Session) -> None:
        root = os.path.join(base, f"ws-{n}")
        os.makedirs(root)
        model = PacedModel(ScriptedModel(script(n)), config.think, jitter=0.5)
        agent = AgentSession(model, lambda: session.client, tools=ToolConfig(root=root))
        started = time.perf_counter()
        try:
            result = await agent.run(f"session {n}")
        except Exception as exc:
            report.problems.append(f"session {n} raised {type(exc).__name__}: {exc}")
            return
        report.run_s.append(time.perf_counter() - started)
        report.tool_calls += result.tool_calls
        report.problems += check_result(n, result)

    async def close_one(n: int, session: Session) -> None:
        started = time.perf_counter()
        closed: CloseResult = await session.close(keep_log=False)
        report.close_s.append(time.perf_counter() - started)
        report.killed_at_close += closed.killed
        report.exits_seen += closed.worker_exited
        if not closed.clean or closed.killed < 1:
            report.problems.append(f"session {n} closed unclean: {closed}")

    sessions: list[Session | BaseException] = []
    try:
        began = time.perf_counter()
        sessions = list(
            await asyncio.gather(
                *(launch(n) for n in range(config.sessions)), return_exceptions=True
            )
        )
        report.launch_wall = time.perf_counter() - began
        live = [(n, s) for n, s in enumerate(sessions) if isinstance(s, Session)]
        for n, s in enumerate(sessions):
            if not isinstance(s, Session):
                report.problems.append(f"session {n} did not launch: {s!r}")
        began = time.perf_counter()
        await asyncio.gather(*(run_one(n, s) for n, s in live))
        report.run_wall = time.perf_counter() - began
        report.rss_peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        began = time.perf_counter()
        await asyncio.gather(*(close_one(n, s) for n, s in live))
        report.close_wall = time.perf_counter() - began
    finally:
        leftovers = [s for s in sessions if isinstance(s, Session) and not s.closed]
        with contextlib.suppress(Exception):
            await asyncio.gather(*(s.close(keep_log=False) for s in leftovers))
        report.leftover = await wait_for_no_process(tag, 10.0)
        shutil.rmtree(base, ignore_errors=True)
    return report


def rows_from(report: AgentsReport) -> list[Row]:
    """Table rows of one run: per-session launch, run and close times, with the wall times."""
    n = report.sessions
    run_note = (
        f"{n} at once, wall {report.run_wall:.1f} s, {report.tool_calls:,} tool calls, "
        f"{len(report.leftover)} processes left; load {report.load[0]:.1f}"
    )
    figures = (
        (
            "agents.launch",
            f"launch one of {n} execds (serve)",
            report.launch_s,
            report.launch_wall,
            "",
        ),
        (
            "agents.run",
            f"one of {n} scripted agent sessions, 3 turns",
            report.run_s,
            report.run_wall,
            run_note,
        ),
        ("agents.close", f"close one of {n} sessions", report.close_s, report.close_wall, ""),
    )
    return [
        Row(
            key=key,
            section=SECTION,
            label=label,
            unit="s",
            p50=percentile(values, 0.5),
            p99=percentile(values, 0.99),
            n=len(values),
            note=note,
            extra={"wall_s": wall},
        )
        for key, label, values, wall, note in figures
    ]


def print_report(report: AgentsReport) -> None:
    """A readable summary."""

    def spread(values: Sequence[float]) -> str:
        if not values:
            return "none"
        return f"p50 {percentile(values, 0.5):.2f} s, p99 {percentile(values, 0.99):.2f} s"

    print(f"{report.sessions} agent sessions (load {report.load}), marker prefix {report.tag}")
    print(f"launch: wall {report.launch_wall:.1f} s; per session {spread(report.launch_s)}")
    print(f"run:    wall {report.run_wall:.1f} s; per session {spread(report.run_s)}")
    print(f"close:  wall {report.close_wall:.1f} s; per session {spread(report.close_s)}")
    print(
        f"tool calls {report.tool_calls}, processes killed at close {report.killed_at_close}, "
        f"execd exits seen by close {report.exits_seen}, "
        f"harness peak RSS {report.rss_peak_kib / 1024:.0f} MiB"
    )
    print(f"processes left with the marker prefix: {len(report.leftover)}")
    for line in report.leftover[:20]:
        print(f"  {line}")
    for problem in report.problems[:20]:
        print(f"problem: {problem}")
    print("ok" if report.ok else "FAILED")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.agents``."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.agents", description=__doc__.split("\n\n", 1)[0]
    )
    parser.add_argument("--sessions", type=int, default=200, help="sessions (default 200)")
    parser.add_argument("--think", type=float, default=0.05, help="model seconds per turn")
    parser.add_argument("--lease", type=float, default=30.0, help="execd lease, seconds")
    parser.add_argument(
        "--launch-concurrency", type=int, default=16, help="execds starting at once (default 16)"
    )
    parser.add_argument("--tmp", default=None, help="scratch directory")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    config = AgentsConfig(
        sessions=args.sessions,
        think=args.think,
        lease=args.lease,
        launch_concurrency=args.launch_concurrency,
    )
    report = runner.run(run_agents(config, args.tmp), "python -m bench.agents")
    return finish(report, args.json, print_report)


if __name__ == "__main__":
    sys.exit(main())
