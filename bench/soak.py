"""A bounded soak: many clients, mixed calls, one execd, memory watched over time.

    python -m bench.soak --clients N --duration S [--max-rss-growth-mib M] [--seed K] [--json]

Starts one execd (a child of this process, in a private temporary directory),
connects ``N`` clients and lets each of them loop over a mix of operations
for ``S`` seconds, every one of them checked end to end:

* ``shell``: a collected command with stdout and stderr, and a streamed one;
* ``files``: write, read back, stat, list and remove a file of random size;
* ``watch``: subscribe to a fresh directory, write into it, wait for the event;
* ``service``: start a service with a log probe, read its status and logs, stop it;
* ``ledger``: append a batch to the client's ledger and read it back chain-checked.

Meanwhile execd's resident set size is sampled from ``/proc``. At the end the
session is closed (marker cleanup) and execd exits. The report gives the
operations and RPC calls per second, every error (there must be none), and
RSS over time: the first sample, the *baseline* (the first sample after the
warm-up, by when allocator pools have grown to their working size), the last
and the max. The exit status is 1 when any operation failed, when a marked
process survived the close, or when RSS grew from the baseline to the last
sample by more than ``--max-rss-growth-mib`` (default 32 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import harnessd
from bench.execd_proc import ExecdProcess, start_execd
from bench.report import finish
from execd.marker import cleanup, find_marked
from harnessd.api import ExecdClient
from protocol.ledger_chain import GENESIS_HASH
from protocol.rpc.services import LogProbe
from protocol.values import DEFAULT_MARKER_VAR

MIB = 1024 * 1024
DEFAULT_MAX_RSS_GROWTH_MIB = 32.0
OP_TIMEOUT = 60.0
"""Seconds one operation may take before it counts as an error."""

MAX_ERROR_SAMPLES = 20


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """How long, how many clients, and the memory bound."""

    clients: int = 8
    duration: float = 20.0
    sample_interval: float = 0.5
    warmup: float | None = None
    """Seconds before the RSS baseline is taken (default: a quarter of the run, at most 5)."""
    max_rss_growth_kib: int = int(DEFAULT_MAX_RSS_GROWTH_MIB * 1024)
    seed: int = 1

    @property
    def warmup_seconds(self) -> float:
        if self.warmup is not None:
            return self.warmup
        return min(5.0, self.duration / 4)


@dataclass(slots=True)
class SoakReport:
    """What a soak run did and saw."""

    clients: int
    duration: float
    operations: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    rss_samples: list[tuple[float, int]] = field(default_factory=list)
    rss_baseline: int = 0
    killed_at_close: int = 0
    leftover: list[int] = field(default_factory=list)
    """Marked processes still alive after the close (killed by a last sweep)."""
    max_rss_growth_kib: int = 0

    @property
    def calls_per_second(self) -> float:
        return self.calls / self.duration if self.duration > 0 else 0.0

    @property
    def operations_per_second(self) -> float:
        total = sum(self.operations.values())
        return total / self.duration if self.duration > 0 else 0.0

    @property
    def rss_first(self) -> int:
        return self.rss_samples[0][1] if self.rss_samples else 0

    @property
    def rss_last(self) -> int:
        return self.rss_samples[-1][1] if self.rss_samples else 0

    @property
    def rss_max(self) -> int:
        return max((rss for _, rss in self.rss_samples), default=0)

    @property
    def rss_growth_kib(self) -> int:
        """Growth from the post-warm-up baseline to the last sample."""
        return self.rss_last - self.rss_baseline

    @property
    def ok(self) -> bool:
        """No error, no survivor of the close, RSS growth within the bound."""
        return (
            self.errors == 0
            and not self.leftover
            and bool(self.rss_samples)
            and self.rss_growth_kib <= self.max_rss_growth_kib
        )

    def summary(self) -> dict[str, object]:
        """Everything as plain JSON-able values."""
        data = asdict(self)
        data.update(
            calls_per_second=round(self.calls_per_second, 1),
            operations_per_second=round(self.operations_per_second, 1),
            rss_first=self.rss_first,
            rss_last=self.rss_last,
            rss_max=self.rss_max,
            rss_growth_kib=self.rss_growth_kib,
            ok=self.ok,
        )
        return data


class _Worker:
    """One client's loop over the operation mix."""

    def __init__(self, index: int, client: ExecdClient, root: str, report: SoakReport, seed: int):
        self.index = index
        self.client = client
        self.root = os.path.join(root, f"client-{index}")
        self.report = report
        self.rng = random.Random(seed * 1_000_003 + index)
        self.ledger = f"soak-{index}"
        self.ledger_seq = 0
        self.ledger_hash = GENESIS_HASH
        self.counter = 0

    def _next(self) -> int:
        self.counter += 1
        return self.counter

    async def run(self, until: float) -> None:
        await self.client.mkdir(self.root)
        ops: list[tuple[str, Callable[[], Awaitable[int]]]] = [
            ("shell", self.shell),
            ("files", self.files),
            ("watch", self.watch),
            ("service", self.service),
            ("ledger", self.ledger_round),
        ]
        position = self.index % len(ops)
        while time.monotonic() < until:
            name, op = ops[position]
            position = (position + 1) % len(ops)
            try:
                async with asyncio.timeout(OP_TIMEOUT):
                    calls = await op()
            except Exception as exc:
                self.report.errors += 1
                if len(self.report.error_samples) < MAX_ERROR_SAMPLES:
                    detail = f"client {self.index} {name}: {type(exc).__name__}: {exc}"
                    self.report.error_samples.append(detail[:500])
                continue
            self.report.operations[name] = self.report.operations.get(name, 0) + 1
            self.report.calls += calls

    async def shell(self) -> int:
        token = secrets.token_hex(4)
        result = await self.client.run(["sh", "-c", f"echo out {token}; echo err {token} >&2"])
        _expect(result.exit_code == 0, f"exit code {result.exit_code}")
        _expect(result.stdout == f"out {token}\n".encode(), f"stdout {result.stdout!r}")
        _expect(result.stderr == f"err {token}\n".encode(), f"stderr {result.stderr!r}")
        lines = self.rng.randint(1, 200)
        command = self.client.run_streaming(command=f"seq 1 {lines}")
        received = b"".join([data async for _, data in command.output()])
        ended = await command.result()
        _expect(ended.exit_code == 0, f"streamed exit code {ended.exit_code}")
        expected = "".join(f"{n}\n" for n in range(1, lines + 1)).encode()
        _expect(received == expected, "streamed output differs")
        return 2

    async def files(self) -> int:
        path = os.path.join(self.root, f"file-{self._next()}.bin")
        data = self.rng.randbytes(self.rng.choice((0, 1, 4096, 65_536, 300_000)))
        written = await self.client.write_file(path, data)
        _expect(written.size == len(data), f"wrote {written.size} of {len(data)} bytes")
        _expect(await self.client.read_file(path) == data, "read back differs")
        stat = await self.client.stat(path)
        _expect(stat.size == len(data), f"stat size {stat.size}")
        listing = await self.client.list_dir(self.root)
        _expect(
            any(entry.path.endswith(os.path.basename(path)) for entry in listing.entries),
            "the file is not listed",
        )
        await self.client.remove(path)
        return 5

    async def watch(self) -> int:
        directory = os.path.join(self.root, f"watched-{self._next()}")
        await self.client.mkdir(directory)
        watch = await self.client.watch(directory)
        try:
            target = os.path.join(directory, "event.txt")
            await self.client.write_file(target, b"changed\n", atomic=False)
            while True:
                kind, event = await watch.next(timeout=20)
                if kind == "closed_write" and event.path == target:
                    break
        finally:
            await watch.close()
        await self.client.remove(directory, recursive=True)
        return 5

    async def service(self) -> int:
        name = f"soak-{self.index}-{self._next()}"
        token = secrets.token_hex(4)
        info = await self.client.start_service(
            name,
            command=f"echo up {token}; exec sleep 60",
            probe=LogProbe(pattern=f"up {token}", timeout=30),
        )
        _expect(info.state == "running" and info.ready, f"service state {info.state}")
        status = await self.client.service_status(name)
        _expect(status.state == "running", f"status {status.state}")
        logs = await self.client.service_logs(name, lines=5)
        _expect(f"up {token}".encode() in logs.data, "the log misses the ready line")
        stopped = await self.client.stop_service(name, grace=5)
        _expect(stopped.state == "stopped", f"stopped state {stopped.state}")
        return 4

    async def ledger_round(self) -> int:
        count = self.rng.randint(1, 8)
        entries = [self.rng.randbytes(self.rng.randint(1, 2048)) for _ in range(count)]
        first = self.ledger_seq + 1
        head = await self.client.ledger_append(self.ledger, first, self.ledger_hash, entries)
        _expect(head.seq == first + count - 1, f"head {head.seq} after appending {count}")
        records = await self.client.ledger_read(self.ledger, first, prev_hash=self.ledger_hash)
        _expect([r.payload for r in records] == entries, "ledger read back differs")
        self.ledger_seq, self.ledger_hash = head.seq, head.hash
        remote = await self.client.ledger_head(self.ledger)
        _expect(remote == head, "ledger head differs")
        return 3


class SoakFailure(AssertionError):
    """An operation's result was not what was asked for."""


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise SoakFailure(what)


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


async def _sample(pid: int, report: SoakReport, interval: float, started: float) -> None:
    while True:
        report.rss_samples.append((round(time.monotonic() - started, 3), rss_kib(pid)))
        await asyncio.sleep(interval)


async def soak(
    host: str, port: int, token: str, pid: int, root: str, config: SoakConfig
) -> SoakReport:
    """Run the clients against the execd at ``host:port`` (process ``pid``) for the duration.

    ``root`` is a directory execd may write the clients' files into. The
    execd is left running; closing it is the caller's business.
    """
    if config.clients < 1 or config.duration <= 0:
        raise ValueError("a soak needs at least one client and a positive duration")
    report = SoakReport(
        clients=config.clients,
        duration=config.duration,
        max_rss_growth_kib=config.max_rss_growth_kib,
    )
    clients = [await harnessd.connect(host, port, token) for _ in range(config.clients)]
    started = time.monotonic()
    sampler = asyncio.create_task(_sample(pid, report, config.sample_interval, started))
    try:
        workers = [
            _Worker(index, client, root, report, config.seed)
            for index, client in enumerate(clients)
        ]
        until = started + config.duration
        await asyncio.gather(*(worker.run(until) for worker in workers))
        report.duration = time.monotonic() - started
        report.rss_samples.append((round(report.duration, 3), rss_kib(pid)))
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        for client in clients:
            await client.close()
    warm = [rss for at, rss in report.rss_samples if at >= config.warmup_seconds]
    report.rss_baseline = warm[0] if warm else report.rss_last
    return report


async def _shutdown(daemon: ExecdProcess) -> int:
    client = await harnessd.connect(daemon.host, daemon.port, daemon.token)
    try:
        closed = await client.shutdown(timeout=20)
    finally:
        await client.close()
    async with asyncio.timeout(30):
        await daemon.process.wait()
    return closed.killed


async def run_soak_async(config: SoakConfig, directory: str | None = None) -> SoakReport:
    """Start an execd, soak it, close the session, stop it; return the report."""
    root = tempfile.mkdtemp(prefix="execd-soak-", dir=directory)
    marker: str | None = None
    try:
        async with start_execd(root) as daemon:
            marker = daemon.marker
            work = os.path.join(root, "work")
            os.mkdir(work)
            report = await soak(daemon.host, daemon.port, daemon.token, daemon.pid, work, config)
            report.killed_at_close = await _shutdown(daemon)
            report.leftover = find_marked(DEFAULT_MARKER_VAR, daemon.marker)
            return report
    finally:
        if marker is not None:
            await asyncio.to_thread(cleanup, DEFAULT_MARKER_VAR, marker, timeout=10.0)
        shutil.rmtree(root, ignore_errors=True)


def run_soak(config: SoakConfig, directory: str | None = None) -> SoakReport:
    """:func:`run_soak_async` in a fresh event loop."""
    return asyncio.run(run_soak_async(config, directory))


def _digest(samples: list[tuple[float, int]], points: int = 10) -> str:
    if len(samples) <= points:
        chosen = samples
    else:
        step = (len(samples) - 1) / (points - 1)
        chosen = [samples[round(i * step)] for i in range(points)]
    return "  ".join(f"{at:.1f}s:{rss / 1024:.1f}" for at, rss in chosen)


def print_report(report: SoakReport) -> None:
    """The human-readable report."""
    ops = ", ".join(f"{name} {count}" for name, count in sorted(report.operations.items()))
    print(f"soak: {report.clients} clients for {report.duration:.1f} s")
    print(
        f"  operations: {sum(report.operations.values())} ({ops}); "
        f"{report.operations_per_second:.1f} ops/s, {report.calls_per_second:.1f} calls/s"
    )
    print(f"  errors: {report.errors}")
    for sample in report.error_samples:
        print(f"    {sample}")
    print(
        f"  execd RSS MiB: first {report.rss_first / 1024:.1f}, baseline "
        f"{report.rss_baseline / 1024:.1f}, last {report.rss_last / 1024:.1f}, max "
        f"{report.rss_max / 1024:.1f}; growth {report.rss_growth_kib / 1024:+.1f} "
        f"(bound {report.max_rss_growth_kib / 1024:.1f}) over {len(report.rss_samples)} samples"
    )
    print(f"  RSS over time (MiB): {_digest(report.rss_samples)}")
    print(f"  close: {report.killed_at_close} killed by marker, leftover {report.leftover}")
    print(f"  result: {'ok' if report.ok else 'FAILED'}")


def main(argv: list[str] | None = None) -> int:
    """Run the soak; exit status 0 when it is ok (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds (default 20)")
    parser.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=DEFAULT_MAX_RSS_GROWTH_MIB,
        help=f"fail when RSS grows more than this after the warm-up (default {DEFAULT_MAX_RSS_GROWTH_MIB:g})",
    )
    parser.add_argument("--warmup", type=float, default=None, help="seconds before the baseline")
    parser.add_argument("--interval", type=float, default=0.5, help="RSS sampling interval")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random payloads")
    parser.add_argument("--dir", default=None, help="where the temporary directory goes")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.interval <= 0:
        parser.error("--clients, --duration and --interval must be positive")
    config = SoakConfig(
        clients=args.clients,
        duration=args.duration,
        sample_interval=args.interval,
        warmup=args.warmup,
        max_rss_growth_kib=int(args.max_rss_growth_mib * 1024),
        seed=args.seed,
    )
    report = run_soak(config, args.dir)
    return finish(report, args.json, print_report)


if __name__ == "__main__":
    sys.exit(main())
