"""Section 8: one agent turn of 8 independent tool calls over a simulated LAN.

A delay proxy (:mod:`bench.delay_proxy`, its own process) sits between the
client and execd and holds every byte 12.5 ms in each direction, so one
round trip costs 25 ms. A turn is 8 independent tool calls of the kinds an
agent makes (two ``true`` commands, two 4 KiB reads, two 4 KiB writes, a stat
and a directory listing), issued concurrently with ``asyncio.gather`` or one
after another. The baseline row is a single ``server.noop`` through the proxy:
one round trip as the link really delivers it (the proxy's timers add up to a
millisecond each way to the nominal 25 ms). The target for the concurrent
turn: within 1.5 of those round trips.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

from bench.env import Env
from bench.report import Row, SectionRows, Step, Target
from bench.servers import start_server
from bench.settings import HOST, LAN_DELAY, TURN_CALLS
from bench.stats import summarize
from harnessd.api import ExecdClient, connect

SECTION = f"8. A turn of {TURN_CALLS} independent tool calls, {LAN_DELAY * 1000:g} ms each way"
TURN_TARGET = 1.5


def _tool_calls(client: ExecdClient, directory: str) -> list[Callable[[], Awaitable[object]]]:
    read_path = os.path.join(directory, "input.txt")
    return [
        lambda: client.run(["true"]),
        lambda: client.run(["true"]),
        lambda: client.read_file(read_path),
        lambda: client.read_file(read_path),
        lambda: client.write_file(os.path.join(directory, "out-1.txt"), b"y" * 4096),
        lambda: client.write_file(os.path.join(directory, "out-2.txt"), b"z" * 4096),
        lambda: client.stat(read_path),
        lambda: client.list_dir(directory),
    ]


async def run(env: Env) -> list[Row]:
    """Concurrent and sequential turns through the delay proxy, and one bare round trip."""
    settings = env.settings
    directory = env.path("turn")
    os.makedirs(directory, exist_ok=True)
    _write_local(os.path.join(directory, "input.txt"), os.urandom(4096))
    target = f"{env.execd.host}:{env.execd.port}"
    async with start_server("proxy", "--target", target, "--delay", repr(LAN_DELAY)) as proxy:
        client = await connect(HOST, proxy.ports["proxy"], env.execd.token, keepalive=None)
        try:
            calls = _tool_calls(client, directory)
            assert len(calls) == TURN_CALLS

            async def concurrent() -> None:
                await asyncio.gather(*(call() for call in calls))

            async def sequential() -> None:
                for call in calls:
                    await call()

            await concurrent()
            round_trips: list[float] = []
            together: list[float] = []
            apart: list[float] = []
            for index in range(max(settings.turns, settings.sequential_turns)):
                round_trips.append(await _ms(client.noop))
                if index < settings.turns:
                    together.append(await _ms(concurrent))
                if index < settings.sequential_turns:
                    apart.append(await _ms(sequential))
        finally:
            await client.close()
    one = summarize(round_trips)
    gathered = summarize(together)
    serial = summarize(apart)
    nominal = 2 * LAN_DELAY * 1000
    ms = SectionRows(SECTION, "ms")
    base, sequential_row, concurrent_row = ms.ladder(
        Step(
            "turn.round_trip",
            "one server.noop through the proxy (one round trip)",
            one,
            "one round trip",
        ),
        Step("turn.sequential", f"{TURN_CALLS} tool calls one after another", serial, "sequential"),
        Step("turn.concurrent", f"{TURN_CALLS} tool calls concurrently (asyncio.gather)", gathered),
    )
    concurrent_row.extra["round_trips_of_delay"] = gathered.p50 / nominal
    concurrent_row.extra["round_trips"] = gathered.p50 / one.p50
    concurrent_row.target = Target(
        f"p50 <= {TURN_TARGET:g} round trips ({TURN_TARGET * one.p50:.1f} ms)",
        gathered.p50 / one.p50,
        TURN_TARGET,
    )
    return [base, sequential_row, concurrent_row]


def _write_local(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


async def _ms(action: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await action()
    return (time.perf_counter() - started) * 1000
