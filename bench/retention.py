"""Section 7, one row: the memory of execd's retention window of request outcomes, under load.

Every call the client makes carries a request id, so execd keeps each
finished call's outcome in its retention window (PROTOCOL.md 8.1), bounded
by count (4096) and bytes (64 MiB) by default. A fresh execd is loaded with
32 calls in flight: ``server.echo`` of 64 KiB until four times the byte bound
has passed through the window (the byte bound evicts), then ``server.noop``
for three times the count bound (the count bound evicts). Its resident set
is sampled all along; the row gives the samples and the peak (VmHWM), beside
the same execd's idle resident set before the load. The target: the peak
stays under idle + the byte bound + 32 MiB (the window itself, plus the
transient buffers of the calls in flight).
"""

from __future__ import annotations

import asyncio

from bench.env import Env
from bench.execd_proc import read_status_kib, sampling_rss, start_execd
from bench.report import Row, Target
from bench.stats import summarize
from execd.config import Limits
from harnessd.api import ExecdClient

IN_FLIGHT = 32
PAYLOAD = 64 * 1024
SLACK_MIB = 32.0
SAMPLE_INTERVAL = 0.01


async def retention_row(env: Env, section: str, idle_mib: float) -> Row:
    """RSS while the retention window fills and evicts, against its bound."""
    defaults = Limits()
    scale = 1 if env.settings.quick else 4
    echoes = scale * defaults.request_retention_bytes // PAYLOAD
    noops = 3 * defaults.request_retention
    async with start_execd(env.workdir) as proc:
        client = await proc.connect()
        try:
            for _ in range(20):
                await client.noop()
            before = read_status_kib(proc.pid, "VmRSS") / 1024
            samples, peak = await _load(client, proc.pid, echoes, noops)
        finally:
            await client.close()
    summary = summarize(samples)
    bound = defaults.request_retention_bytes / 2**20
    row = Row(
        key="memory.retention",
        section=section,
        label=(
            f"execd RSS while {echoes} echoes of 64 KiB and {noops} no-ops pass through the "
            f"retention window ({defaults.request_retention} outcomes, {bound:g} MiB)"
        ),
        unit="MiB",
        **summary.figures(),
        baselines=("memory.idle",),
        note=f"peak VmHWM {peak:.1f} MiB; {before:.1f} MiB before the load",
        extra={"vmhwm_mib": peak, "before_mib": before, "bound_mib": bound},
    )
    limit = idle_mib + bound + SLACK_MIB
    row.target = Target(f"peak < idle + {bound:g} + {SLACK_MIB:g} MiB", peak, limit)
    return row


async def _load(
    client: ExecdClient, pid: int, echoes: int, noops: int
) -> tuple[list[float], float]:
    payload = b"x" * PAYLOAD
    queue = iter([True] * echoes + [False] * noops)

    async def worker() -> None:
        for echo in queue:
            if echo:
                if await client.echo(payload) != payload:
                    raise RuntimeError("echo came back changed")
            else:
                await client.noop()

    async with sampling_rss(pid, SAMPLE_INTERVAL) as samples:
        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    peak = read_status_kib(pid, "VmHWM") / 1024
    return samples or [peak], peak
