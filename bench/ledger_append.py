"""Cost of one durable ledger append as the ledger grows.

    python -m bench.ledger_append [--quick] [--dir DIR] [--samples N] [--max-ratio R]

One ledger is grown to 1 MiB, 64 MiB and 1 GiB (``--quick``: 1 MiB and
16 MiB) with large batches; at each size the bench times ``--samples``
appends of one small entry (each one written, fdatasync-ed, indexed and
fdatasync-ed, as in production) and the reopen of the ledger (tail recovery
by a fresh store). It prints p50/p99 in microseconds per append and the ratio
largest/smallest size, which must stay flat (about 1.0x): an append neither
rewrites nor scans the ledger. With ``--max-ratio`` the exit status is 1 when
the p50 ratio exceeds it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from execd.ledger import LedgerStore

MIB = 1 << 20
SESSION = "bench"
FILL_ENTRY = 64 * 1024
FILL_BATCH = 64
SMALL_ENTRY = 1024


@dataclass(frozen=True)
class Row:
    """Timings at one ledger size."""

    size: int
    entries: int
    p50_us: float
    p99_us: float
    reopen_ms: float


def _percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


async def _measure(directory: str, sizes: list[int], samples: int) -> list[Row]:
    fill = os.urandom(FILL_ENTRY)
    small = os.urandom(SMALL_ENTRY)
    rows: list[Row] = []
    store = LedgerStore(directory)
    head = await store.head(SESSION)
    data_path = os.path.join(directory, SESSION + ".ledger")
    try:
        for target in sizes:
            while (missing := target - _size(data_path)) > 0:
                count = min(FILL_BATCH, -(-missing // (FILL_ENTRY + 48)))
                head = await store.append(SESSION, head.seq + 1, head.hash, [fill] * count)
            for _ in range(5):
                head = await store.append(SESSION, head.seq + 1, head.hash, [small])
            timings: list[float] = []
            for _ in range(samples):
                started = time.perf_counter_ns()
                head = await store.append(SESSION, head.seq + 1, head.hash, [small])
                timings.append((time.perf_counter_ns() - started) / 1000)
            await store.close()
            started = time.perf_counter_ns()
            store = LedgerStore(directory)
            reopened = await store.head(SESSION)
            reopen_ms = (time.perf_counter_ns() - started) / 1e6
            if reopened != head:
                raise RuntimeError("the reopened ledger has a different head")
            rows.append(
                Row(
                    size=_size(data_path),
                    entries=head.seq,
                    p50_us=statistics.median(timings),
                    p99_us=_percentile(timings, 0.99),
                    reopen_ms=reopen_ms,
                )
            )
    finally:
        await store.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the bench and print its table; the exit status reflects ``--max-ratio``."""
    parser = argparse.ArgumentParser(prog="python -m bench.ledger_append", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="sizes 1 MiB and 16 MiB only")
    parser.add_argument("--dir", default=None, help="where to build the ledger (a temp dir)")
    parser.add_argument("--samples", type=int, default=0, help="timed appends per size")
    parser.add_argument("--max-ratio", type=float, default=None, help="fail above this p50 ratio")
    args = parser.parse_args(argv)
    sizes = [1 * MIB, 16 * MIB] if args.quick else [1 * MIB, 64 * MIB, 1024 * MIB]
    samples = args.samples or (100 if args.quick else 300)

    with tempfile.TemporaryDirectory(prefix="ledger-bench-", dir=args.dir) as directory:
        rows = asyncio.run(_measure(directory, sizes, samples))

    print(f"ledger append: 1 entry of {SMALL_ENTRY} B per append, {samples} samples per size")
    print(f"{'ledger size':>12} {'entries':>9} {'p50 us':>10} {'p99 us':>10} {'reopen ms':>10}")
    for row in rows:
        print(
            f"{row.size / MIB:>8.1f} MiB {row.entries:>9} {row.p50_us:>10.1f} "
            f"{row.p99_us:>10.1f} {row.reopen_ms:>10.2f}"
        )
    p50_ratio = rows[-1].p50_us / rows[0].p50_us
    p99_ratio = rows[-1].p99_us / rows[0].p99_us
    print(f"ratio largest/smallest: p50 {p50_ratio:.2f}x, p99 {p99_ratio:.2f}x")
    if args.max_ratio is not None and p50_ratio > args.max_ratio:
        print(f"FAIL: p50 ratio {p50_ratio:.2f}x is above {args.max_ratio:.2f}x", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
