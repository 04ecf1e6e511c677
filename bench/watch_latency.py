"""Write-to-event latency of ``watch.subscribe``, measured at the handler level.

Usage: ``python -m bench.watch_latency [--count N] [--recursive] [--depth D]
[--loop uvloop|asyncio]``

A :class:`~execd.watch.WatchCapability` watches a fresh temporary directory
through an in-memory call context. For each of ``count`` rounds the bench
writes a file (open, write, close) ``depth`` directories below the root and
waits for the matching ``closed_write`` event to reach ``push_event``; the
latency is the time from just before the write to the event's arrival. One
write is in flight at a time, so this measures latency, not throughput. Prints
p50, p99 and max in milliseconds (plus the setup, for context).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvloop

from execd.config import Config
from execd.watch import WatchCapability
from protocol.rpc.watch import SubscribeParams, WatchEvent


class _TimingContext:
    """A CallContext that timestamps every pushed event (streams are unused)."""

    def __init__(self) -> None:
        self.arrivals: asyncio.Queue[tuple[float, str, WatchEvent]] = asyncio.Queue()
        self._on_close: list[Callable[[], Awaitable[None] | None]] = []

    @property
    def call_id(self) -> int:
        return 1

    @property
    def connection_id(self) -> int:
        return 1

    @property
    def max_chunk(self) -> int:
        return 64 * 1024

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        raise RuntimeError(f"the watch bench sends no stream data ({stream!r})")

    async def receive(self, stream: str) -> AsyncIterator[bytes]:
        raise RuntimeError(f"the watch bench receives no stream data ({stream!r})")
        yield b""  # pragma: no cover - makes this an async generator

    async def push_event(self, topic: int, name: str, data: Any) -> None:
        assert isinstance(data, WatchEvent)
        self.arrivals.put_nowait((time.perf_counter(), name, data))

    def on_close(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        self._on_close.append(callback)


def write_byte(path: str) -> None:
    """Write one byte to ``path``, created or truncated: the change each round waits for."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list."""
    rank = max(1, min(len(sorted_values), round(fraction * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


async def measure(count: int, recursive: bool, depth: int) -> dict[str, float]:
    """Run the bench; returns milliseconds keyed by statistic."""
    cap = WatchCapability(Config())
    ctx = _TimingContext()
    with tempfile.TemporaryDirectory(prefix="watch-bench-") as root:
        target_dir = os.path.join(root, *(f"level{i}" for i in range(depth)))
        os.makedirs(target_dir, exist_ok=True)
        watched = root if recursive else target_dir
        started = time.perf_counter()
        await cap.watch_subscribe(SubscribeParams(path=watched, recursive=recursive), ctx)
        setup = time.perf_counter() - started
        latencies: list[float] = []
        try:
            for round_ in range(count):
                path = os.path.join(target_dir, f"f{round_ % 16}")
                before = time.perf_counter()
                write_byte(path)
                while True:
                    arrived, name, event = await asyncio.wait_for(ctx.arrivals.get(), 10.0)
                    if name == "closed_write" and event.path == path:
                        latencies.append(arrived - before)
                        break
        finally:
            await cap.close()
    latencies.sort()
    return {
        "setup_ms": setup * 1000,
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "max_ms": latencies[-1] * 1000,
    }


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, print one line of results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=1000, help="writes to time")
    parser.add_argument("--recursive", action="store_true", help="watch the root recursively")
    parser.add_argument("--depth", type=int, default=0, help="directories below the root")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args(argv)
    if args.count < 1 or args.depth < 0:
        parser.error("--count must be positive and --depth not negative")
    coroutine = measure(args.count, args.recursive, args.depth)
    if args.loop == "uvloop":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            stats = runner.run(coroutine)
    else:
        stats = asyncio.run(coroutine)
    print(
        f"watch latency over {args.count} writes ({args.loop}, "
        f"{'recursive' if args.recursive else 'flat'}, depth {args.depth}): "
        f"p50 {stats['p50_ms']:.3f} ms  p99 {stats['p99_ms']:.3f} ms  "
        f"max {stats['max_ms']:.3f} ms  (subscribe {stats['setup_ms']:.3f} ms)"
    )


if __name__ == "__main__":
    main()
