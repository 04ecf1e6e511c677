"""Sections 6 and 7: ledger append cost as the ledger grows, and execd's memory.

6. Three ledgers grown to 1 MiB, 64 MiB and 1 GiB (full run) with large
   batches, as ``python -m bench.ledger_append`` grows its one ledger; then
   durable appends of one 1 KiB entry (written, fdatasync-ed, indexed) are
   timed in rounds that take turns between the three, so the disk's noise
   (fdatasync latency on a shared disk drifts by tens of percent over
   seconds) hits every size alike. Flat means an append neither scans nor
   rewrites the ledger: the largest size's p50 is compared with the
   smallest's.
7. A fresh execd: its idle resident set (VmRSS sampled after a few calls),
   then the resident set sampled every few milliseconds while it streams
   ``head -c 1G /dev/zero`` through ``run_streaming`` to a client that
   consumes the output, and its high-water mark (VmHWM) at the end. The
   baseline is the raw floor server, a bare uvloop process. Then the
   retention window of request outcomes under load (:mod:`bench.retention`).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

from bench import ledger_append
from bench.env import Env
from bench.execd_proc import read_status_kib, sampling_rss, start_execd
from bench.report import Row, SectionRows, Step, Target
from bench.retention import retention_row
from bench.settings import size_label
from bench.stats import summarize
from execd.ledger import LedgerStore
from harnessd.api import ExecdClient

LEDGER = "6. Ledger append (1 KiB entry, durable) as the ledger grows"
MEMORY = "7. execd memory"

LEDGER_TARGET = 1.2
IDLE_TARGET_MIB = 40.0
STREAM_TARGET_MIB = 72.0
SAMPLE_INTERVAL = 0.005
LEDGER_BATCH = 10


async def ledger_rows(env: Env) -> list[Row]:
    """Append p50/p99 at each ledger size."""
    settings = env.settings
    with tempfile.TemporaryDirectory(prefix="ledger-bench-", dir=settings.tmp_dir) as directory:
        measured = await _measure_ledgers(directory, settings.ledger_sizes, settings.ledger_samples)
    rows: list[Row] = []
    for index, (nominal, (size, entries, samples)) in enumerate(
        zip(settings.ledger_sizes, measured, strict=True)
    ):
        summary = summarize(samples)
        rows.append(
            SectionRows(LEDGER, "us").row(
                f"ledger.{('small', 'medium', 'large')[index]}",
                f"append at ledger size {size_label(nominal)}",
                summary,
                short=size_label(nominal),
                baselines=() if index == 0 else ("ledger.small",),
                extra={"ledger_bytes": float(size), "entries": float(entries)},
            )
        )
    largest, smallest = rows[-1], rows[0]
    largest.target = Target(
        f"p50 <= {LEDGER_TARGET:g}x the smallest size", largest.p50 / smallest.p50, LEDGER_TARGET
    )
    return rows


async def _measure_ledgers(
    directory: str, sizes: tuple[int, ...], samples: int
) -> list[tuple[int, int, list[float]]]:
    """Per ledger: its final size, entry count and append times in microseconds."""
    fill = os.urandom(ledger_append.FILL_ENTRY)
    small = os.urandom(ledger_append.SMALL_ENTRY)
    sessions = [f"size{index}" for index in range(len(sizes))]
    store = LedgerStore(directory)
    try:
        heads = [await store.head(session) for session in sessions]
        for index, (session, target) in enumerate(zip(sessions, sizes, strict=True)):
            path = os.path.join(directory, session + ".ledger")
            while (missing := target - _file_size(path)) > 0:
                count = min(
                    ledger_append.FILL_BATCH, -(-missing // (ledger_append.FILL_ENTRY + 48))
                )
                head = heads[index]
                heads[index] = await store.append(session, head.seq + 1, head.hash, [fill] * count)
        times: list[list[float]] = [[] for _ in sessions]
        rounds = max(1, samples // LEDGER_BATCH)
        for round_ in range(rounds + 1):
            for index, session in enumerate(sessions):
                for _ in range(LEDGER_BATCH):
                    head = heads[index]
                    started = time.perf_counter_ns()
                    heads[index] = await store.append(session, head.seq + 1, head.hash, [small])
                    if round_:  # the first round warms every ledger up
                        times[index].append((time.perf_counter_ns() - started) / 1000)
    finally:
        await store.close()
    return [
        (_file_size(os.path.join(directory, session + ".ledger")), heads[index].seq, times[index])
        for index, session in enumerate(sessions)
    ]


def _file_size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


async def memory_rows(env: Env) -> list[Row]:
    """Idle RSS and RSS while streaming, of a fresh execd."""
    settings = env.settings
    floor_samples = await _sample_idle(env.raw.pid, settings.idle_samples)
    async with start_execd(env.workdir) as proc:
        client = await proc.connect()
        try:
            for _ in range(20):
                await client.noop()
            await client.run(["true"])
            idle = await _sample_idle(proc.pid, settings.idle_samples)
            streaming, peak, seconds = await _stream(client, proc.pid, settings.stream_bytes)
        finally:
            await client.close()
    floor = summarize(floor_samples)
    idle_summary = summarize(idle)
    stream_summary = summarize(streaming)
    mib = SectionRows(MEMORY, "MiB")
    base, idle_row = mib.ladder(
        Step(
            "memory.floor",
            "raw floor server (bare uvloop process), RSS",
            floor,
            "bare uvloop process",
        ),
        Step("memory.idle", "execd idle RSS", idle_summary, "idle"),
    )
    idle_row.target = Target(f"< {IDLE_TARGET_MIB:g} MiB", idle_summary.p99, IDLE_TARGET_MIB)
    stream_row = mib.row(
        "memory.stream",
        f"execd RSS while streaming {settings.stream_label} of output",
        stream_summary,
        baselines=("memory.idle",),
        note=f"peak VmHWM {peak:.1f} MiB, {settings.stream_bytes / seconds / 1e6:.0f} MB/s",
        extra={"vmhwm_mib": peak, "stream_mb_per_s": settings.stream_bytes / seconds / 1e6},
    )
    stream_row.target = Target(f"peak (VmHWM) < {STREAM_TARGET_MIB:g} MiB", peak, STREAM_TARGET_MIB)
    retention = await retention_row(env, MEMORY, idle_summary.p50)
    return [base, idle_row, stream_row, retention]


async def _sample_idle(pid: int, count: int) -> list[float]:
    samples: list[float] = []
    for _ in range(count):
        samples.append(read_status_kib(pid, "VmRSS") / 1024)
        await asyncio.sleep(0.05)
    return samples


async def _stream(client: ExecdClient, pid: int, size: int) -> tuple[list[float], float, float]:
    started = time.perf_counter()
    received = 0
    async with sampling_rss(pid, SAMPLE_INTERVAL) as samples:
        command = client.run_streaming(["head", "-c", str(size), "/dev/zero"])
        async for _, data in command.output():
            received += len(data)
        result = await command.result()
    seconds = time.perf_counter() - started
    if received != size or result.exit_code != 0:
        raise RuntimeError(f"streamed {received} of {size} bytes, exit {result.exit_code}")
    peak = read_status_kib(pid, "VmHWM") / 1024
    if not samples:
        samples.append(read_status_kib(pid, "VmRSS") / 1024)
    return samples, max(peak, max(samples)), seconds
