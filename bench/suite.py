"""The whole bench in one run: every section, one table, JSON and the pictures.

``python -m bench [--quick] [--out DIR] [--tmp DIR] [--only SECTION] [--sshd PATH] [--no-plot]``
and ``harnessd bench`` (same options) start the raw floor servers and one
execd, run the sections in order, compute every ratio against the baselines
measured in the same run, and write ``bench.md`` (the headline of
:mod:`bench.headline` first, then what did not run and why, then the table),
``bench.json`` and (with matplotlib) ``bench.png`` and, for a full run,
``bench-targets.png`` into the output directory (default ``bench-results/``
under the current directory). The report is printed too. The exit status is
0 when the bench ran, whatever the targets say: a full run's table tells
which were met; a quick run's gives no verdicts.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from bench import (
    agent_loop,
    model_turn,
    resources,
    roundtrip,
    runner,
    scale,
    ssh_peer,
    swerex_peer,
    transfer,
    turn,
    workspace,
)
from bench.baselines import missing_packages
from bench.env import Env
from bench.execd_proc import start_execd
from bench.options import SECTION_NAMES, add_arguments
from bench.report import Report, Row, Skip, link_ratios, machine_facts
from bench.servers import start_server
from bench.settings import Settings, full, quick
from harnessd import connect

Section = Callable[[Env], Awaitable[list[Row]]]

#: Every row a run produces, in table order (full and quick runs alike).
ROW_KEYS: Final[tuple[str, ...]] = (
    "noop.floor",
    "noop.http",
    "noop.grpc",
    "noop.execd",
    "noop.execd_aes",
    "noop.execd_noid",
    "noop1.floor",
    "noop1.execd",
    "noop1.execd_aes",
    "pipe.floor",
    "pipe.execd",
    "pipe.execd_aes",
    "pipe.execd_noid",
    "pipe.grpc",
    "spawn.local",
    "spawn.floor",
    "spawn.execd",
    "spawn.execd_cwd",
    "files.small.noop",
    *(f"files.small.{kind}" for kind in ("raw_read", "execd_read", "raw_write", "execd_write")),
    "files.small.local_atomic",
    "files.small.local_atomic_dir",
    "files.small.floor_atomic",
    "files.small.execd_write_atomic",
    "files.small.execd_write_durable",
    *(f"files1.small.{kind}" for kind in ("noop", "execd_read", "execd_write")),
    *(f"files.medium.{kind}" for kind in ("raw_read", "execd_read", "raw_write", "execd_write")),
    "files.large.raw_read",
    "files.large.execd_read",
    "files.large.raw_write",
    "files.large.raw_write_file",
    "files.large.execd_write",
    "files.large.execd_write_atomic",
    "watch.handler",
    "watch.execd",
    "start.python",
    "start.imports",
    "start.execd",
    "ledger.small",
    "ledger.medium",
    "ledger.large",
    "memory.floor",
    "memory.idle",
    "memory.stream",
    "memory.retention",
    "turn.round_trip",
    "turn.sequential",
    "turn.concurrent",
    "loop.bare_hot",
    "loop.bare",
    "loop.call",
    "loop.turn",
    "scale.connect",
    "scale.rss",
    "scale.fds",
    "scale.cpu_one",
    "scale.cpu_spread",
    "scale.cpu_many",
    "scale.latency_single",
    "scale.one_low",
    "scale.one_mid",
    "scale.one_high",
    "scale.spread_low",
    "scale.spread_mid",
    "scale.spread_high",
    "scale.open_low",
    "scale.open_mid",
    "scale.open_high",
    "scale.keepalive",
    "agents.launch",
    "agents.run",
    "agents.close",
    "model.floor",
    "model.httpx",
    "model.turn",
    "model.floor_tls",
    "model.turn_tls",
    "model.floor_lan",
    "model.turn_lan",
    *swerex_peer.ROW_KEYS,
    *ssh_peer.ROW_KEYS,
)


async def _turns(env: Env) -> list[Row]:
    """Section 8 (a turn over a simulated LAN) and 8b (the agent loop around one call)."""
    return [*await turn.run(env), *await agent_loop.run(env)]


SECTIONS: Final[tuple[tuple[str, Section], ...]] = (
    ("roundtrip", roundtrip.run),
    # Not pinned: execd's children inherit its affinity, and the commands it runs are the
    # workload here, not the server.
    ("shell", workspace.spawn_rows),
    # Pins its rows between processes as section 1 does, but not the small atomic writes: their
    # local floor (a fsync in this process) is itself slower on a pinned core
    # (0.29-0.34 -> 0.43-0.48 ms), which would flatter execd (bench/transfer.py).
    ("files", transfer.run),
    ("watch", workspace.watch_rows),
    ("start", workspace.cold_start_rows),
    ("ledger", resources.ledger_rows),
    ("memory", resources.memory_rows),
    ("turn", _turns),
    ("scale", scale.run),
    ("model", model_turn.run),
    ("swerex", swerex_peer.run),
    ("ssh", ssh_peer.run),
)


async def run_suite(
    settings: Settings, *, only: frozenset[str] | None = None, progress: bool = True
) -> Report:
    """Run every section (or those named in ``only``); return the report with ratios linked."""
    missing = missing_packages()
    if missing:
        raise RuntimeError(
            f"baseline packages missing: {', '.join(missing)} "
            "(install the project's bench extra: pip install -e '.[bench]')"
        )
    started = time.perf_counter()
    rows: list[Row] = []
    skipped: list[Skip] = []
    facts: dict[str, str] = {}
    workdir = tempfile.mkdtemp(prefix="bench-workspace-", dir=settings.tmp_dir)
    try:
        async with (
            start_server("raw", "--scratch", workdir) as raw,
            start_execd(workdir) as execd,
        ):
            env = Env(settings=settings, workdir=workdir, execd=execd, raw=raw, skipped=skipped)
            # Sections that start execds of their own can outlast the shared one's
            # lease on a loaded machine: one connection with keepalive holds it.
            holder = await connect(execd.host, execd.port, execd.token, keepalive=5.0)
            try:
                await _run_sections(env, only, progress, rows)
            finally:
                facts.update(env.facts)
                await holder.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    order = {key: index for index, key in enumerate(ROW_KEYS)}
    rows.sort(key=lambda row: order.get(row.key, len(order)))
    link_ratios(rows)
    notes = [
        "p50/p99 are over all samples; for rates, p99 is the rate of the slow-end run.",
        "Ratios compare p50s: for times, x = times the baseline; for rates, the share of the "
        "baseline's rate.",
        "execd, the floor, HTTP and gRPC servers each run in their own process; clients run "
        "in the bench process on uvloop.",
        "Sections 1 and 2 pin the bench process (the clients) to one core and the servers to "
        "another (bench/placement.py); section 1 then runs the floor and execd once more with "
        "everything on one core. Section 4 pins its rows between processes (all of its "
        "largest size's) the same way and times its smallest read, write and no-op once more "
        "on one core; its small atomic writes and their local floors run unpinned, as do the "
        "other sections.",
        "Section 9's harness is a fresh process of its own (python -m bench.scale) with its "
        "own execds; section 10 starts one execd per session (python -m bench.agents).",
        "Sections 12 and 13 time an execd of their own beside SWE-ReX and OpenSSH; OpenSSH's "
        "sessions get an empty HOME, so no login shell startup file is timed.",
    ]
    return Report(
        rows=rows,
        facts={**machine_facts(), **facts},
        quick=settings.quick,
        seconds=time.perf_counter() - started,
        notes=notes,
        skipped=skipped,
    )


async def _run_sections(
    env: Env, only: frozenset[str] | None, progress: bool, rows: list[Row]
) -> None:
    for name, section in SECTIONS:
        if only is not None and name not in only:
            continue
        began = time.perf_counter()
        if progress:
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
        rows += await section(env)
        if progress:
            print(
                f"bench: {name} done in {time.perf_counter() - began:.1f} s",
                file=sys.stderr,
                flush=True,
            )


assert tuple(name for name, _ in SECTIONS) == SECTION_NAMES


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options, write the outputs, print the table."""
    settings = quick(args.tmp, args.sshd) if args.quick else full(args.tmp, args.sshd)
    only = frozenset(args.only) if args.only else None
    report = runner.run(run_suite(settings, only=only), "bench")
    written = report.write(Path(args.out), plot=not args.no_plot)
    print(report.to_markdown())
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Tool-call latency and throughput of execd beside the floor and the "
        "alternatives, in one run.",
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
