"""Percentiles and timing helpers shared by the bench sections."""

from __future__ import annotations

import asyncio
import functools
import gc
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

Call = Callable[[], Awaitable[object]]
Timed = Callable[[], Awaitable[float]]
"""A call that returns the microseconds its timed part took."""


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (``fraction`` in [0, 1]) of a non-empty sequence."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]


class Figures(TypedDict):
    """The figures of a summary a report row shows: ``Row(..., **summary.figures())``."""

    p50: float
    p99: float
    n: int


@dataclass(frozen=True, slots=True)
class Summary:
    """p50, p99 and mean of a sample set, in the samples' unit."""

    p50: float
    p99: float
    mean: float
    n: int

    def figures(self) -> Figures:
        """The p50, p99 and count, as a report row's fields."""
        return {"p50": self.p50, "p99": self.p99, "n": self.n}


def with_unit(value: float, unit: str) -> str:
    """``value`` to about three significant figures, then ``unit``: ``1,287 MB/s``, ``87.8 us``."""
    if value >= 100:
        text = f"{value:,.0f}"
    elif value >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text} {unit}"


def summarize(values: Sequence[float]) -> Summary:
    """The Summary of ``values``."""
    return Summary(
        p50=percentile(values, 0.50),
        p99=percentile(values, 0.99),
        mean=math.fsum(values) / len(values),
        n=len(values),
    )


def rate_summary(amount: float, seconds: Sequence[float]) -> Summary:
    """Rates (``amount`` per second) of repeated timed runs.

    ``p50`` is the rate of the median run; ``p99`` the rate of the run at the
    99th percentile of duration (the slow end), so both read like latencies
    turned into rates.
    """
    times = summarize(seconds)
    return Summary(
        p50=amount / times.p50,
        p99=amount / times.p99,
        mean=amount / times.mean,
        n=times.n,
    )


async def time_calls(call: Call, count: int, into: list[float]) -> None:
    """Await ``call`` ``count`` times one after another; append each duration in microseconds."""
    clock = time.perf_counter_ns
    for _ in range(count):
        started = clock()
        await call()
        into.append((clock() - started) / 1000)


async def interleaved(
    approaches: dict[str, Call],
    counts: dict[str, int],
    *,
    rounds: int,
    warmup: int = 50,
) -> dict[str, list[float]]:
    """Latency samples (microseconds) of several approaches, measured in interleaved batches.

    Each approach gets ``counts[name]`` samples spread over ``rounds`` batches;
    the batches take turns, so the machine's noise hits every approach alike.
    """
    await _warm_up(approaches, counts, warmup)
    batches = {name: functools.partial(time_calls, call) for name, call in approaches.items()}
    return await _take_turns(batches, counts, rounds)


async def interleaved_timed(
    approaches: dict[str, Timed],
    counts: dict[str, int],
    *,
    rounds: int,
    warmup: int = 3,
) -> dict[str, list[float]]:
    """:func:`interleaved` for calls that time themselves (each returns its own microseconds).

    For a figure whose call has a part that must not count: a connection's
    close after the connect and authentication being timed, say.
    """

    async def batch(call: Timed, count: int, into: list[float]) -> None:
        for _ in range(count):
            into.append(await call())

    await _warm_up(approaches, counts, warmup)
    batches = {name: functools.partial(batch, call) for name, call in approaches.items()}
    return await _take_turns(batches, counts, rounds)


async def _warm_up(
    approaches: Mapping[str, Callable[[], Awaitable[object]]], counts: dict[str, int], warmup: int
) -> None:
    for name, call in approaches.items():
        for _ in range(min(warmup, counts[name])):
            await call()


async def _take_turns(
    batches: Mapping[str, Callable[[int, list[float]], Awaitable[None]]],
    counts: dict[str, int],
    rounds: int,
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in batches}
    gc.collect()
    for index in range(rounds):
        for name, batch in batches.items():
            total = counts[name]
            await batch(total * (index + 1) // rounds - total * index // rounds, samples[name])
            await asyncio.sleep(0)
    return samples


async def pipelined(call: Call, total: int, in_flight: int) -> float:
    """Seconds to complete ``total`` calls with ``in_flight`` of them outstanding at once."""
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return time.perf_counter() - started
