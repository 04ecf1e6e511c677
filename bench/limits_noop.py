"""execd's answer time to a no-op while a command runs into its limits.

Run: ``python -m bench.limits_noop [--rounds N]``.

Against a real execd, a client sends ``server.noop`` back to back, 5 ms
apart, while a second connection runs, in turn: nothing (the baseline,
measured in the same run), a Python process allocating 1 GiB in 16 MiB
steps under a 256 MiB memory limit, one trying to fork 200 children under a
64-process limit (never an unbounded fork bomb), and a busy loop under a
1-second CPU limit. Prints p50, p99 and the slowest no-op of each phase in
milliseconds (the issue's target: every no-op within 50 ms), its ratio to the
baseline, and the verdict and mechanism the command's result reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

from bench.execd_proc import start_execd
from harnessd.api import ExecdClient, connect
from harnessd.errors import HarnessError

#: Allocates 1 GiB in 16 MiB steps; says how far it got.
ALLOCATE = """
import sys
chunks = []
try:
    for _ in range(64):
        chunks.append(bytearray(16 << 20))
except MemoryError:
    print("refused", len(chunks), flush=True)
    sys.exit(3)
print("allocated", len(chunks), flush=True)
"""

#: Forks up to 200 sleeping children, prints how many it got, then kills and reaps them.
FORK = """
import os, sys, time
started = 0
children = []
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    started += 1
    children.append(pid)
print(started, flush=True)
for pid in children:
    os.kill(pid, 9)
for pid in children:
    os.waitpid(pid, 0)
"""


PHASES: dict[str, tuple[list[str] | None, dict[str, float]]] = {
    "idle (baseline)": (None, {}),
    "memory 256 MiB, allocating 1 GiB": ([sys.executable, "-c", ALLOCATE], {"memory": 256 << 20}),
    "processes 64, forking 200": ([sys.executable, "-c", FORK], {"processes": 64}),
    "cpu 1 s, busy loop": (["sh", "-c", "while :; do :; done"], {"cpu": 1.0}),
}


async def _phase(
    pinger: ExecdClient, runner: ExecdClient, argv: list[str] | None, limits: dict[str, float]
) -> tuple[list[float], str]:
    if argv is None:
        work: asyncio.Future[object] = asyncio.ensure_future(asyncio.sleep(1.0))
    else:
        work = asyncio.ensure_future(runner.run(argv, limits=limits))
    times: list[float] = []
    while not work.done():
        start = time.perf_counter()
        await pinger.noop()
        times.append(time.perf_counter() - start)
        await asyncio.sleep(0.005)
    try:
        result = work.result()
    except HarnessError as exc:
        return times, f"refused: {type(exc).__name__}"
    verdict = getattr(result, "limit_exceeded", None)
    how = getattr(result, "limits", None)
    return times, "" if argv is None else f"{verdict} via {how}"


async def _main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="limits-noop-") as workdir:
        async with start_execd(workdir) as execd:
            pinger = await connect(execd.host, execd.port, execd.token)
            runner = await connect(execd.host, execd.port, execd.token)
            try:
                results: dict[str, list[float]] = {name: [] for name in PHASES}
                verdicts: dict[str, str] = {}
                for _ in range(rounds):
                    for name, (argv, limits) in PHASES.items():
                        times, verdicts[name] = await _phase(pinger, runner, argv, limits)
                        results[name] += times
            finally:
                await pinger.close()
                await runner.close()
    print(f"no-op answer times, {rounds} rounds, {os.cpu_count()} CPUs, uid {os.getuid()}")
    print(
        f"{'while':<36} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99/base':>9}  verdict"
    )
    base = statistics.quantiles(results["idle (baseline)"], n=100)[98]
    for name, times in results.items():
        p50 = statistics.median(times)
        p99 = statistics.quantiles(times, n=100)[98] if len(times) > 1 else times[0]
        print(
            f"{name:<36} {len(times):>5} {p50 * 1e3:>8.2f} {p99 * 1e3:>8.2f} "
            f"{max(times) * 1e3:>8.2f} {p99 / base:>9.2f}  {verdicts[name]}"
        )


def main(args: Sequence[str] | None = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="times each phase runs")
    opts = parser.parse_args(args)
    asyncio.run(_main(opts.rounds))


if __name__ == "__main__":
    main()
