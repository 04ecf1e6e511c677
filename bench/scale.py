"""Section 9: one harness process, a thousand sessions over a few local execds.

    python -m bench.scale [--quick] [--sessions N] [--execds M] [--json] [--profile FILE]

A fresh process (this module's ``main``) plays the harness, so its CPU time,
resident set and descriptors are its own: it starts ``M`` execds (20 by
default, each its own process), then measures, in this order:

1. *One session, one call at a time.* A single connection runs the
   tool-call mix -- ``server.noop``, ``true`` through ``shell.run``, a 4 KiB
   ``files.write`` (not atomic: the fsync would measure the disk, not the
   harness) and a 4 KiB ``files.read`` -- with a short pause before each call
   (an agent's model time, shrunk): the latency of a call to an execd that
   was busy a moment ago, shown for reference.
2. *Open loop, one session and then ``N``.* At each of three offered rates,
   first one session, then ``N`` sessions (1,000 by default, spread evenly
   over the execds and connected all at once with ``harnessd.connect``) are
   Poisson sources of calls (the mix, in turn) adding up to that rate (one
   Poisson source of that rate whose arrivals each fall on a session drawn at
   random: the same arrivals): a call is issued when its time comes, whether
   or not the session's previous call has finished, as agents waiting on
   their models issue them. The ``N``
   sessions are connected afresh for each rate, so the two measurements of a
   rate follow each other and the machine's drift hits both alike. Between
   the two, ``M`` sessions, one per execd, take the same arrivals: the calls
   spread over every execd as the ``N`` sessions' are, with no more sessions
   in the harness than execds (no target; it tells the cost of the spread
   from the cost of the sessions). For each:
   per-call latency (issue to answer), harness CPU per call, and the cores
   used by the harness and the execds together (their own CPU time, which
   includes the reaped ``true`` processes, so other work on a shared machine
   does not count). The first connect of all ``N`` is timed, and the
   harness's resident set and descriptors are read before and after it.
3. *Idle, then keepalive.* ``N`` sessions without keepalive idle for a few
   seconds (the harness's CPU floor); then ``N`` new ones with ``connect``'s
   default keepalive, after one interval, over a window of several
   intervals: the harness's CPU as a share of one core.

Targets: harness CPU per call at ``N`` sessions within 1.2x one session's
at the same offered rates, 64 KiB of harness RSS per idle session, all
connected within one second, p50 at ``N`` sessions within 1.5x one
session's at the same rate, at every rate that keeps our processes below half
of the machine's cores, keepalive under 2% of one core. The latency target
compares with one session in the same open loop, not with phase 1: the same
calls from one session after pauses of a few milliseconds meet an execd and
a CPU that are still warm, and an open loop at these rates leaves them idle
for 2-10 ms between calls, which costs a round trip here a third more with
one session on one execd (the same calls, only the pause longer), whatever
the number of sessions. Nor does it cover the spread: at these rates each
of 20 execds is woken 5-25 times a second, and here one session per execd
measured 1.6-1.9x one session while 60 sessions on one execd measured
0.97-1.05x (``--sessions 20`` and ``--sessions 60 --execds 1``); the rows
of one session per execd show that share in every run.
``--profile FILE`` runs the open-loop phases under cProfile and writes the
stats to ``FILE``; the top functions go to stderr.

The suite (:func:`run`) runs this as a child process and turns its JSON into
table rows, then adds the agent sessions of :mod:`bench.agents`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import inspect
import io
import json
import math
import os
import pstats
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from bench import agents, runner
from bench.env import Env
from bench.execd_proc import ExecdProcess, start_execd
from bench.report import Row, Target
from bench.settings import KIB, default_tmp
from bench.stats import percentile
from harnessd.api import ExecdClient, connect

SECTION = "9. One harness process, {sessions:,} sessions over {execds} execds"

CPU_TARGET = 1.2
RSS_TARGET_KIB = 64.0
CONNECT_TARGET_S = 1.0
LATENCY_TARGET = 1.5
KEEPALIVE_TARGET_PERCENT = 2.0

KINDS: Final = ("noop", "true", "write", "read")
PAYLOAD: Final = 4 * KIB
RATE_KEYS: Final = ("low", "mid", "high")
#: connect()'s own keepalive interval: what a harness gets unless it asks otherwise.
DEFAULT_KEEPALIVE: Final[float] = float(inspect.signature(connect).parameters["keepalive"].default)
CLOSE_BATCH: Final = 200


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    """How many sessions and execds, and how long each phase runs."""

    sessions: int = 1000
    execds: int = 20
    single_calls: int = 2000
    think: float = 0.002
    rates: tuple[float, float, float] = (100.0, 250.0, 500.0)
    rate_seconds: float = 8.0
    idle_seconds: float = 3.0
    keepalive: float = DEFAULT_KEEPALIVE
    keepalive_intervals: int = 5
    seed: int = 1
    tmp_dir: str = field(default_factory=default_tmp)

    @classmethod
    def quick(cls, tmp_dir: str | None = None) -> ScaleConfig:
        """Every figure, with short phases: seconds, not minutes."""
        return cls(
            sessions=200,
            execds=4,
            single_calls=100,
            rate_seconds=1.0,
            idle_seconds=0.5,
            keepalive=1.0,
            keepalive_intervals=2,
            tmp_dir=tmp_dir or default_tmp(),
        )


@dataclass(slots=True)
class RateFigures:
    """One open-loop phase."""

    offered: float
    seconds: float
    calls: int
    p50_us: float
    p99_us: float
    p50_by_kind: dict[str, float]
    harness_cpu_us_per_call: float
    cores_used: float
    harness_cores: float
    machine_busy_cores: float
    lag_p99_us: float


@dataclass(slots=True)
class ScaleFigures:
    """Everything :func:`measure` reports (JSON-ready)."""

    sessions: int
    execds: int
    cores: int
    load_before: tuple[float, float, float]
    single_calls: int
    single_p50_us: float
    single_p99_us: float
    single_p50_by_kind: dict[str, float]
    connect_seconds: float
    reconnect_seconds: list[float]
    rss_before_kib: int
    rss_after_kib: int
    rss_per_session_kib: float
    fds_before: int
    fds_after: int
    fds_per_session: float
    one: list[RateFigures]
    spread: list[RateFigures]
    many: list[RateFigures]
    one_cpu_us_per_call: float
    spread_cpu_us_per_call: float
    many_cpu_us_per_call: float
    idle_cpu_percent: float
    keepalive_interval: float
    keepalive_seconds: float
    keepalive_pings: int
    keepalive_cpu_percent: float
    load_after: tuple[float, float, float]
    seconds: float


# -- what the harness process can see of itself and its execds -------------------------------


def harness_cpu() -> float:
    """User plus system CPU seconds of this process (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_kib() -> int:
    """This process's resident set, KiB."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def fd_count() -> int:
    """Open descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def tree_cpu(pids: Sequence[int]) -> float:
    """CPU seconds of ``pids`` including their reaped children (the ``true`` commands)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(value) for value in fields[11:15]) / tick
    return total


def machine_busy() -> tuple[float, float]:
    """Busy and total jiffies of the whole machine (every core), from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return float(total - idle), float(total)


def raise_fd_limit(needed: int) -> None:
    """Lift the soft descriptor limit to what ``needed`` sessions take, within the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        limit = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


# -- the tool-call mix --------------------------------------------------------------------------


class Mix:
    """One session's calls: each kind as a coroutine factory, checked end to end."""

    __slots__ = ("client", "path", "turn")

    def __init__(self, client: ExecdClient, path: str, turn: int) -> None:
        self.client = client
        self.path = path
        """The file read; writes go beside it, so calls in flight together never race."""
        self.turn = turn

    def next_kind(self) -> str:
        kind = KINDS[self.turn % len(KINDS)]
        self.turn += 1
        return kind

    async def call(self, kind: str) -> None:
        client = self.client
        if kind == "noop":
            await client.noop()
        elif kind == "true":
            result = await client.run(["true"])
            if result.exit_code != 0:
                raise RuntimeError(f"true exited with {result.exit_code}")
        elif kind == "write":
            await client.write_file(self.path + OUTPUT_SUFFIX, DATA, atomic=False)
        else:
            data = await client.read_file(self.path)
            if len(data) != PAYLOAD:
                raise RuntimeError(f"read {len(data)} bytes of {PAYLOAD}")


DATA: Final = b"x" * PAYLOAD
OUTPUT_SUFFIX: Final = ".out"
"""A session's writes go to its input's path with this suffix."""


@dataclass(slots=True)
class Samples:
    """Latencies (microseconds) by kind, and how late calls were issued."""

    by_kind: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    lag: list[float] = field(default_factory=list)

    def all(self) -> list[float]:
        return [value for values in self.by_kind.values() for value in values]

    @property
    def count(self) -> int:
        return sum(len(values) for values in self.by_kind.values())

    def p50_by_kind(self) -> dict[str, float]:
        return {kind: percentile(v, 0.5) for kind, v in self.by_kind.items() if v}


async def timed(mix: Mix, kind: str, samples: Samples) -> None:
    started = time.perf_counter()
    await mix.call(kind)
    samples.by_kind[kind].append((time.perf_counter() - started) * 1e6)


# -- phases ---------------------------------------------------------------------------------------


async def one_at_a_time(execd: ExecdProcess, path: str, calls: int, think: float) -> Samples:
    """One session, one call at a time with a pause before each: the latency baseline."""
    client = await execd.connect()
    try:
        mix = Mix(client, path, 0)
        for _ in range(8 * len(KINDS)):
            await mix.call(mix.next_kind())
        samples = Samples()
        for _ in range(calls):
            await asyncio.sleep(think)
            await timed(mix, mix.next_kind(), samples)
    finally:
        await client.close()
    return samples


async def connect_all(
    execds: Sequence[ExecdProcess], count: int, keepalive: float | None
) -> list[ExecdClient]:
    """``count`` connections opened at once, spread evenly over ``execds``."""
    openings = [
        connect(e.host, e.port, e.token, keepalive=keepalive, timeout=60.0)
        for e in (execds[i % len(execds)] for i in range(count))
    ]
    results = await asyncio.gather(*(asyncio.ensure_future(o) for o in openings))
    return list(results)


async def close_all(clients: Sequence[ExecdClient]) -> None:
    for start in range(0, len(clients), CLOSE_BATCH):
        await asyncio.gather(*(c.close() for c in clients[start : start + CLOSE_BATCH]))
    await asyncio.sleep(0.2)


def arrivals(
    rate: float, seconds: float, sessions: int, rng: random.Random
) -> Iterator[tuple[float, int]]:
    """The calls of ``sessions`` Poisson sources adding up to ``rate`` calls/s, for ``seconds``.

    Yields each call's time (seconds from the start, ascending) and its
    session's index: one Poisson stream of ``rate`` whose every arrival falls
    on a session drawn at random, which is what that many independent sources
    of ``rate / sessions`` each add up to.
    """
    at = rng.expovariate(rate)
    while at < seconds:
        yield at, rng.randrange(sessions)
        at += rng.expovariate(rate)


async def open_loop(
    mixes: Sequence[Mix],
    rate: float,
    seconds: float,
    execd_pids: Sequence[int],
    seed: int,
) -> tuple[Samples, RateFigures]:
    """Every session a Poisson source at ``rate / len(mixes)`` calls/s for ``seconds``.

    The calls come from one timer (:func:`arrivals`): a coroutine per session
    sleeping on its own timer would charge the load generator's cost (a
    thousand coroutines, timers and random generators, and at 100 calls/s
    more sessions than calls) to the harness's CPU per call, and only when
    there are many sessions.
    """
    samples = Samples()
    failures: list[BaseException] = []
    running: set[asyncio.Task[None]] = set()
    schedule = arrivals(rate, seconds, len(mixes), random.Random(seed))
    gc.collect()
    cpu_before, tree_before = harness_cpu(), tree_cpu(execd_pids)
    busy_before, total_before = machine_busy()
    started = time.perf_counter()
    for offset, index in schedule:
        due = started + offset
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        samples.lag.append(max(0.0, time.perf_counter() - due) * 1e6)
        mix = mixes[index]
        task = asyncio.ensure_future(timed(mix, mix.next_kind(), samples))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        for result in await asyncio.gather(*running, return_exceptions=True):
            if isinstance(result, BaseException):
                failures.append(result)
    wall = time.perf_counter() - started
    cpu = harness_cpu() - cpu_before
    tree = tree_cpu(execd_pids) - tree_before
    busy_after, total_after = machine_busy()
    if failures:
        raise RuntimeError(f"{len(failures)} calls failed, first: {failures[0]!r}")
    everything = samples.all()
    cores = os.cpu_count() or 1
    share = (busy_after - busy_before) / max(1.0, total_after - total_before)
    return samples, RateFigures(
        offered=rate,
        seconds=wall,
        calls=len(everything),
        p50_us=percentile(everything, 0.5),
        p99_us=percentile(everything, 0.99),
        p50_by_kind=samples.p50_by_kind(),
        harness_cpu_us_per_call=cpu / len(everything) * 1e6,
        cores_used=(cpu + tree) / wall,
        harness_cores=cpu / wall,
        machine_busy_cores=share * cores,
        lag_p99_us=percentile(samples.lag, 0.99) if samples.lag else 0.0,
    )


async def measure(config: ScaleConfig, profile: str | None = None) -> ScaleFigures:
    """Run every phase (see the module docstring) and return the figures."""
    raise_fd_limit(config.sessions * 2 + config.execds * 8)
    began = time.perf_counter()
    load_before = os.getloadavg()
    workdir = tempfile.mkdtemp(prefix="bench-scale-", dir=config.tmp_dir)
    try:
        async with contextlib.AsyncExitStack() as stack:
            execds = await asyncio.gather(
                *(
                    stack.enter_async_context(start_execd(workdir, timeout=120.0))
                    for _ in range(config.execds)
                )
            )
            return await _phases(config, list(execds), workdir, began, load_before, profile)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _phases(
    config: ScaleConfig,
    execds: list[ExecdProcess],
    workdir: str,
    began: float,
    load_before: tuple[float, float, float],
    profile: str | None,
) -> ScaleFigures:
    pids = [e.pid for e in execds]
    count = config.sessions
    paths = [os.path.join(workdir, f"s{i}.dat") for i in range(count)]
    _write_inputs(paths)

    single = await one_at_a_time(execds[0], paths[0], config.single_calls, config.think)
    everything = single.all()

    profiler = cProfile.Profile() if profile else None
    one: list[RateFigures] = []
    spread: list[RateFigures] = []
    many: list[RateFigures] = []
    connects: list[float] = []
    rss_before = rss_after = fds_before = fds_after = 0
    idle_percent = 0.0
    for index, rate in enumerate(config.rates):
        seed = config.seed + index
        alone = await execds[0].connect()
        try:
            _, figures = await open_loop(
                [Mix(alone, paths[0], 0)], rate, config.rate_seconds, pids, seed
            )
            one.append(figures)
        finally:
            await alone.close()
        apart = await connect_all(execds, len(execds), None)
        try:
            mixes = [Mix(client, paths[i], i) for i, client in enumerate(apart)]
            _, figures = await open_loop(mixes, rate, config.rate_seconds, pids, seed)
            spread.append(figures)
        finally:
            await close_all(apart)
        gc.collect()
        await asyncio.sleep(0.2)
        if index == 0:
            rss_before, fds_before = rss_kib(), fd_count()
        started = time.perf_counter()
        clients = await connect_all(execds, count, None)
        connects.append(time.perf_counter() - started)
        try:
            if index == 0:
                await asyncio.sleep(0.5)
                gc.collect()
                rss_after, fds_after = rss_kib(), fd_count()
            mixes = [Mix(client, paths[i], i) for i, client in enumerate(clients)]
            if profiler is not None:
                profiler.enable()
            try:
                _, figures = await open_loop(mixes, rate, config.rate_seconds, pids, seed)
            finally:
                if profiler is not None:
                    profiler.disable()
            many.append(figures)
            if index == len(config.rates) - 1:
                idle_before = harness_cpu()
                await asyncio.sleep(config.idle_seconds)
                idle_percent = (harness_cpu() - idle_before) / config.idle_seconds * 100
        finally:
            await close_all(clients)
    if profiler is not None and profile is not None:
        profiler.dump_stats(profile)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue(), file=sys.stderr)

    interval = config.keepalive
    pinging = await connect_all(execds, count, interval)
    try:
        await asyncio.sleep(interval)
        window = interval * config.keepalive_intervals
        before = harness_cpu()
        await asyncio.sleep(window)
        keepalive_percent = (harness_cpu() - before) / window * 100
    finally:
        await close_all(pinging)

    return ScaleFigures(
        sessions=count,
        execds=len(execds),
        cores=os.cpu_count() or 1,
        load_before=load_before,
        single_calls=len(everything),
        single_p50_us=percentile(everything, 0.5),
        single_p99_us=percentile(everything, 0.99),
        single_p50_by_kind=single.p50_by_kind(),
        connect_seconds=connects[0],
        reconnect_seconds=connects[1:],
        rss_before_kib=rss_before,
        rss_after_kib=rss_after,
        rss_per_session_kib=(rss_after - rss_before) / count,
        fds_before=fds_before,
        fds_after=fds_after,
        fds_per_session=(fds_after - fds_before) / count,
        one=one,
        spread=spread,
        many=many,
        one_cpu_us_per_call=_cpu_per_call(one),
        spread_cpu_us_per_call=_cpu_per_call(spread),
        many_cpu_us_per_call=_cpu_per_call(many),
        idle_cpu_percent=idle_percent,
        keepalive_interval=interval,
        keepalive_seconds=window,
        keepalive_pings=int(count * window / interval),
        keepalive_cpu_percent=keepalive_percent,
        load_after=os.getloadavg(),
        seconds=time.perf_counter() - began,
    )


def _write_inputs(paths: Sequence[str]) -> None:
    """Each session's 4 KiB file, there before its first read, and its write's target.

    The targets exist before the first write so that every phase overwrites
    a file: one session's phase writes one file again and again, while a
    thousand sessions would otherwise each create theirs, and creating a file
    (an inode allocated on the disk's filesystem) costs 0.07-0.7 ms here, a
    cost of the filesystem and not of the number of sessions.
    """
    for path in paths:
        for name in (path, path + OUTPUT_SUFFIX):
            with open(name, "wb") as handle:
                handle.write(DATA)


def _cpu_per_call(phases: Sequence[RateFigures]) -> float:
    """Harness CPU per call over several open-loop phases, weighted by their calls."""
    calls = sum(p.calls for p in phases)
    return sum(p.harness_cpu_us_per_call * p.calls for p in phases) / calls


# -- the suite's section -----------------------------------------------------------------------------


def figures_from_json(data: dict[str, Any]) -> ScaleFigures:
    """The inverse of ``asdict`` for :class:`ScaleFigures`."""
    fields = {
        **data,
        "one": [RateFigures(**item) for item in data["one"]],
        "spread": [RateFigures(**item) for item in data["spread"]],
        "many": [RateFigures(**item) for item in data["many"]],
    }
    fields["load_before"] = tuple(data["load_before"])
    fields["load_after"] = tuple(data["load_after"])
    return ScaleFigures(**fields)


async def run_child(quick: bool, tmp_dir: str) -> ScaleFigures:
    """Run the measurement in a fresh harness process and read its JSON."""
    argv = [sys.executable, "-m", "bench.scale", "--json", "--tmp", tmp_dir]
    if quick:
        argv.append("--quick")
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        out, err = await proc.communicate()
    except asyncio.CancelledError:
        # The child stops its execds and removes their directories on SIGTERM.
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench.scale exited with {proc.returncode}:\n{err.decode(errors='replace')[-4000:]}"
        )
    return figures_from_json(json.loads(out))


async def run(env: Env) -> list[Row]:
    """Section 9 rows from a fresh harness process, then the agent sessions' rows."""
    settings = env.settings
    figures = await run_child(settings.quick, settings.tmp_dir)
    rows = rows_from(figures)
    agent_config = agents.AgentsConfig.quick() if settings.quick else agents.AgentsConfig()
    report = await agents.run_agents(agent_config, settings.tmp_dir)
    if not report.ok:
        raise RuntimeError(f"agent sessions at scale failed: {report.problems[:5]}")
    return rows + agents.rows_from(report)


def _single(key: str, section: str, label: str, unit: str, value: float, **kw: Any) -> Row:
    return Row(key=key, section=section, label=label, unit=unit, p50=value, p99=value, n=1, **kw)


def _rate_row(
    key: str,
    section: str,
    label: str,
    rate: RateFigures,
    *,
    baselines: tuple[str, ...],
    short: str = "",
    note: str = "",
    **extra: float,
) -> Row:
    """The per-call latency row of one open-loop phase; ``extra`` joins its usual figures."""
    return Row(
        key=key,
        section=section,
        label=label,
        short=short,
        unit="us",
        p50=rate.p50_us,
        p99=rate.p99_us,
        n=rate.calls,
        baselines=baselines,
        note=note,
        extra={
            "offered_per_s": rate.offered,
            "achieved_per_s": rate.calls / rate.seconds,
            "cores_used": rate.cores_used,
            **extra,
            **{f"p50_{k}_us": v for k, v in rate.p50_by_kind.items()},
        },
    )


def rows_from(f: ScaleFigures) -> list[Row]:
    """Table rows (with targets) from one measurement."""
    section = SECTION.format(sessions=f.sessions, execds=f.execds)
    n = f"{f.sessions:,}"
    load = f"load {f.load_before[0]:.1f}"
    rows: list[Row] = []
    connect_row = _single(
        "scale.connect", section, f"connect {n} sessions at once", "s", f.connect_seconds
    )
    connect_row.target = Target(f"< {CONNECT_TARGET_S:g} s", f.connect_seconds, CONNECT_TARGET_S)
    rows.append(connect_row)
    rss = _single(
        "scale.rss",
        section,
        f"harness RSS per idle session ({f.rss_before_kib / 1024:.0f} -> "
        f"{f.rss_after_kib / 1024:.0f} MiB)",
        "KiB",
        f.rss_per_session_kib,
        extra={"rss_before_kib": float(f.rss_before_kib), "rss_after_kib": float(f.rss_after_kib)},
    )
    rss.target = Target(f"<= {RSS_TARGET_KIB:g} KiB", f.rss_per_session_kib, RSS_TARGET_KIB)
    rows.append(rss)
    rows.append(
        _single(
            "scale.fds",
            section,
            "harness descriptors per session",
            "fds",
            f.fds_per_session,
            extra={"fds_before": float(f.fds_before), "fds_after": float(f.fds_after)},
        )
    )
    rows.append(
        _single(
            "scale.cpu_one",
            section,
            "harness CPU per call, one session, open loop at the three rates below",
            "us",
            f.one_cpu_us_per_call,
            short="one session",
            extra={f"at_{r.offered:g}_per_s": r.harness_cpu_us_per_call for r in f.one},
        )
    )
    apart = f"{f.execds} sessions, one per execd"
    rows.append(
        _single(
            "scale.cpu_spread",
            section,
            f"harness CPU per call, {apart}, open loop at the same rates",
            "us",
            f.spread_cpu_us_per_call,
            short="one per execd",
            baselines=("scale.cpu_one",),
            extra={f"at_{r.offered:g}_per_s": r.harness_cpu_us_per_call for r in f.spread},
        )
    )
    cpu_many = _single(
        "scale.cpu_many",
        section,
        f"harness CPU per call, {n} sessions, open loop at the same rates",
        "us",
        f.many_cpu_us_per_call,
        baselines=("scale.cpu_one", "scale.cpu_spread"),
        extra={f"at_{r.offered:g}_per_s": r.harness_cpu_us_per_call for r in f.many},
    )
    cpu_many.target = Target(
        f"<= {CPU_TARGET:g}x one session",
        f.many_cpu_us_per_call / f.one_cpu_us_per_call,
        CPU_TARGET,
    )
    rows.append(cpu_many)
    rows.append(
        Row(
            key="scale.latency_single",
            section=section,
            label="per-call latency, one session, one call at a time after a pause",
            short="one at a time",
            unit="us",
            p50=f.single_p50_us,
            p99=f.single_p99_us,
            n=f.single_calls,
            extra={f"p50_{k}_us": v for k, v in f.single_p50_by_kind.items()},
        )
    )
    half = f.cores / 2
    for key, alone in zip(RATE_KEYS, f.one, strict=True):
        rows.append(
            _rate_row(
                f"scale.one_{key}",
                section,
                f"per-call latency, one session, open loop at {alone.offered:g} calls/s",
                alone,
                short=f"one session at {alone.offered:g}/s",
                baselines=("scale.latency_single",),
                issue_lag_p99_us=alone.lag_p99_us,
            )
        )
    for key, apart_rate in zip(RATE_KEYS, f.spread, strict=True):
        rows.append(
            _rate_row(
                f"scale.spread_{key}",
                section,
                f"per-call latency, {apart}, open loop at {apart_rate.offered:g} calls/s",
                apart_rate,
                short=f"one per execd at {apart_rate.offered:g}/s",
                baselines=(f"scale.one_{key}",),
                harness_cpu_us_per_call=apart_rate.harness_cpu_us_per_call,
            )
        )
    for key, alone, rate in zip(RATE_KEYS, f.one, f.many, strict=True):
        row = _rate_row(
            f"scale.open_{key}",
            section,
            f"per-call latency, {n} sessions, open loop at {rate.offered:g} calls/s",
            rate,
            baselines=(f"scale.one_{key}", "scale.latency_single", f"scale.spread_{key}"),
            note=f"our processes used {rate.cores_used:.2f} of {f.cores} cores",
            harness_cores=rate.harness_cores,
            machine_busy_cores=rate.machine_busy_cores,
            harness_cpu_us_per_call=rate.harness_cpu_us_per_call,
            issue_lag_p99_us=rate.lag_p99_us,
            one_session_p50_us=alone.p50_us,
            one_session_p99_us=alone.p99_us,
        )
        if rate.cores_used < half:
            row.target = Target(
                f"p50 <= {LATENCY_TARGET:g}x one session at the same rate (below {half:g} cores)",
                rate.p50_us / alone.p50_us,
                LATENCY_TARGET,
            )
        rows.append(row)
    keepalive = _single(
        "scale.keepalive",
        section,
        f"harness CPU, {n} idle sessions, keepalive every {f.keepalive_interval:g} s",
        "% core",
        f.keepalive_cpu_percent,
        note=(
            f"{f.keepalive_pings:,} pings in {f.keepalive_seconds:g} s; without keepalive "
            f"{f.idle_cpu_percent:.2f}%; {load}"
        ),
        extra={
            "pings": float(f.keepalive_pings),
            "window_s": f.keepalive_seconds,
            "no_keepalive_percent": f.idle_cpu_percent,
        },
    )
    keepalive.target = Target(
        f"< {KEEPALIVE_TARGET_PERCENT:g}% of one core",
        f.keepalive_cpu_percent,
        KEEPALIVE_TARGET_PERCENT,
    )
    rows.append(keepalive)
    return rows


# -- command line ------------------------------------------------------------------------------------


def print_figures(f: ScaleFigures) -> None:
    """A readable summary of one run."""
    print(f"{f.sessions} sessions over {f.execds} execds, {f.cores} cores, load {f.load_before}")
    print(
        f"connect all: {f.connect_seconds:.3f} s (again: "
        + ", ".join(f"{v:.3f}" for v in f.reconnect_seconds)
        + " s)"
    )
    print(
        f"RSS per session: {f.rss_per_session_kib:.1f} KiB "
        f"({f.rss_before_kib} -> {f.rss_after_kib} KiB); fds per session {f.fds_per_session:.2f}"
    )
    print(
        f"one session, one call at a time: p50 {f.single_p50_us:.0f} us, "
        f"p99 {f.single_p99_us:.0f} us; by kind "
        + ", ".join(f"{k} {v:.0f}" for k, v in f.single_p50_by_kind.items())
    )
    spread = f"{f.execds} (one per execd)"
    for sessions, phases in ((1, f.one), (spread, f.spread), (f.sessions, f.many)):
        for r, alone in zip(phases, f.one, strict=True):
            print(
                f"{sessions} sessions, open loop {r.offered:g}/s: {r.calls} calls, "
                f"p50 {r.p50_us:.0f} us ({r.p50_us / alone.p50_us:.2f}x one session at that rate, "
                f"{r.p50_us / f.single_p50_us:.2f}x one at a time), p99 {r.p99_us:.0f} us, "
                f"CPU {r.harness_cpu_us_per_call:.1f} us/call, cores used {r.cores_used:.2f} "
                f"(harness {r.harness_cores:.2f}, machine {r.machine_busy_cores:.2f}), "
                f"issue lag p99 {r.lag_p99_us:.0f} us; by kind "
                + ", ".join(f"{k} {v:.0f}" for k, v in r.p50_by_kind.items())
            )
    print(
        f"CPU per call: {f.one_cpu_us_per_call:.1f} us at one session, "
        f"{f.spread_cpu_us_per_call:.1f} us at {spread}, "
        f"{f.many_cpu_us_per_call:.1f} us at {f.sessions} "
        f"({f.many_cpu_us_per_call / f.one_cpu_us_per_call:.2f}x)"
    )
    print(f"idle, no keepalive: {f.idle_cpu_percent:.2f}% of a core")
    print(
        f"keepalive every {f.keepalive_interval:g} s: {f.keepalive_cpu_percent:.2f}% of a core "
        f"({f.keepalive_pings} pings in {f.keepalive_seconds:g} s)"
    )
    print(f"load after: {f.load_after}; {f.seconds:.1f} s in all")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.scale``."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale", description=__doc__.split("\n\n", 1)[0]
    )
    parser.add_argument("--quick", action="store_true", help="short phases")
    parser.add_argument("--sessions", type=int, default=None, help="sessions (default 1000)")
    parser.add_argument("--execds", type=int, default=None, help="execds (default 20)")
    parser.add_argument(
        "--rates", default=None, help="three offered rates, calls/s (default 100,250,500)"
    )
    parser.add_argument("--seconds", type=float, default=None, help="seconds per rate")
    parser.add_argument("--tmp", default=None, help="scratch directory")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--profile", default=None, help="cProfile the open-loop phases into FILE")
    args = parser.parse_args(argv)
    config = (
        ScaleConfig.quick(args.tmp)
        if args.quick
        else ScaleConfig(tmp_dir=args.tmp or default_tmp())
    )
    changes: dict[str, Any] = {}
    if args.sessions is not None:
        changes["sessions"] = args.sessions
    if args.execds is not None:
        changes["execds"] = args.execds
    if args.rates is not None:
        values = tuple(float(v) for v in args.rates.split(","))
        if len(values) != 3 or not all(v > 0 and math.isfinite(v) for v in values):
            parser.error("--rates takes three positive numbers")
        changes["rates"] = values
    if args.seconds is not None:
        changes["rate_seconds"] = args.seconds
    if changes:
        config = ScaleConfig(**{**asdict(config), **changes})
    figures = runner.run(measure(config, args.profile), "python -m bench.scale")
    if args.json:
        print(json.dumps(asdict(figures)))
    else:
        print_figures(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
