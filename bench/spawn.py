"""Per-spawn cost of the ways execd could start a command and wait for it.

Run: ``python -m bench.spawn [-n COUNT] [--batch SIZE] [PROGRAM [ARG ...]]``.

Each sample spawns the program (``true`` by default) with stdin on
``/dev/null`` and stdout/stderr piped, waits for its exit and reads its
output to EOF. The approaches are measured in interleaved batches in the
same process so machine noise hits them alike:

* ``uvloop create_subprocess_exec`` / ``asyncio create_subprocess_exec``:
  the event loops' own subprocess support, ``communicate()``;
* ``subprocess.run``: blocking, ``capture_output=True``;
* ``execd.spawn``: :func:`execd.spawn.spawn` (``posix_spawnp``, pidfd exit
  watch, ``add_reader`` pipes), on both loops; ``cwd=/`` is the same with a
  working directory, which takes the ``subprocess.Popen`` path;
* ``shell.run``: the whole ``shell.run`` handler of
  :class:`execd.shell.ShellCapability` (collected output), on both loops.

Prints p50 and p99 in microseconds per spawn, then the ratio of
``execd.spawn`` and ``shell.run`` to ``subprocess.run`` at the median, then
the amortized cost per spawn of the event-loop approaches when
``--in-flight`` spawns overlap (a blocking ``subprocess.run`` cannot).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import uvloop

from execd.config import Config
from execd.pipes import PipeReader
from execd.shell import ShellCapability
from execd.spawn import spawn
from protocol.rpc.shell import RunParams

Sample = Callable[[], Awaitable[None]]


class _BenchContext:
    """The least CallContext ``shell.run`` needs in collected mode."""

    connection_id = 1
    max_chunk = 64 * 1024

    def __init__(self, call_id: int) -> None:
        self.call_id = call_id

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        return None

    async def receive(self, stream: str) -> AsyncIterator[bytes]:
        nothing: list[bytes] = []
        for chunk in nothing:
            yield chunk

    async def push_event(self, topic: int, name: str, data: Any) -> None:
        return None

    def on_close(self, callback: Callable[[], Any]) -> None:
        return None


def _loop_sample(argv: Sequence[str]) -> Sample:
    async def sample() -> None:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        await proc.communicate()

    return sample


def _execd_sample(argv: Sequence[str], cwd: str | None = None) -> Sample:
    env = dict(os.environ)

    async def sample() -> None:
        child = spawn(argv, env=env, cwd=cwd)
        sink: list[bytes] = []
        out = PipeReader(child.stdout, sink=sink.append)
        err = PipeReader(child.stderr, sink=sink.append)
        waits: list[asyncio.Future[Any]] = [child.exited, out.eof, err.eof]
        await asyncio.wait(waits)

    return sample


def _shell_sample(argv: Sequence[str], capability: ShellCapability) -> Sample:
    params = RunParams(argv=list(argv))
    call_ids = itertools.count(1)

    async def sample() -> None:
        await capability.shell_run(params, _BenchContext(next(call_ids)))

    return sample


async def _timed(sample: Sample, count: int, into: list[float]) -> None:
    for _ in range(count):
        start = time.perf_counter()
        await sample()
        into.append(time.perf_counter() - start)


def _timed_run(argv: Sequence[str], count: int, into: list[float]) -> None:
    for _ in range(count):
        start = time.perf_counter()
        subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=False)
        into.append(time.perf_counter() - start)


async def _overlapped(sample: Sample, count: int, in_flight: int) -> float:
    """Seconds taken by ``count`` spawns with ``in_flight`` running at once."""
    semaphore = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with semaphore:
            await sample()

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    return time.perf_counter() - start


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(args: Sequence[str] | None = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--count", type=int, default=2000, help="spawns per approach")
    parser.add_argument("--batch", type=int, default=50, help="spawns per interleaved batch")
    parser.add_argument(
        "--in-flight", type=int, default=16, help="concurrent spawns in the throughput pass"
    )
    parser.add_argument("argv", nargs="*", default=["true"], help="program to spawn")
    opts = parser.parse_args(args)
    argv: list[str] = opts.argv

    loops = {"asyncio": asyncio.new_event_loop(), "uvloop": uvloop.new_event_loop()}
    capabilities: dict[str, ShellCapability] = {}
    async_samples: dict[str, tuple[asyncio.AbstractEventLoop, Sample]] = {}
    for name, loop in loops.items():
        asyncio.set_event_loop(loop)
        capabilities[name] = ShellCapability(Config(), dict(os.environ))
        async_samples[f"{name} create_subprocess_exec"] = (loop, _loop_sample(argv))
        async_samples[f"{name} execd.spawn"] = (loop, _execd_sample(argv))
        async_samples[f"{name} execd.spawn cwd=/"] = (loop, _execd_sample(argv, "/"))
        async_samples[f"{name} shell.run"] = (loop, _shell_sample(argv, capabilities[name]))
    results: dict[str, list[float]] = {name: [] for name in async_samples}
    results["subprocess.run"] = []

    done = 0
    while done < opts.count:
        batch = min(opts.batch, opts.count - done)
        for name, (loop, sample) in async_samples.items():
            asyncio.set_event_loop(loop)
            loop.run_until_complete(_timed(sample, batch, results[name]))
        _timed_run(argv, batch, results["subprocess.run"])
        done += batch

    throughput = dict.fromkeys(async_samples, 0.0)
    done = 0
    while done < opts.count:
        batch = min(opts.batch * 2, opts.count - done)
        for name, (loop, sample) in async_samples.items():
            asyncio.set_event_loop(loop)
            throughput[name] += loop.run_until_complete(_overlapped(sample, batch, opts.in_flight))
        done += batch

    for name, loop in loops.items():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(capabilities[name].close())
        loop.close()
    asyncio.set_event_loop(None)

    print(f"{opts.count} spawns of {' '.join(argv)!r} per approach, {os.cpu_count()} CPUs")
    print(f"{'approach':<36} {'p50 us':>9} {'p99 us':>9} {'mean us':>9}")
    for name, values in sorted(results.items(), key=lambda kv: statistics.median(kv[1])):
        p50, p99 = _percentile(values, 0.5), _percentile(values, 0.99)
        mean = statistics.fmean(values)
        print(f"{name:<36} {p50 * 1e6:>9.0f} {p99 * 1e6:>9.0f} {mean * 1e6:>9.0f}")
    base = _percentile(results["subprocess.run"], 0.5)
    print("ratio to subprocess.run at p50:")
    for name in results:
        if "execd" in name or "shell.run" in name:
            ratio = _percentile(results[name], 0.5) / base
            print(f"  {name:<34} {ratio:.2f}")
    print(
        f"amortized us per spawn with {opts.in_flight} in flight (subprocess.run cannot overlap):"
    )
    for name, seconds in sorted(throughput.items(), key=lambda kv: kv[1]):
        print(f"  {name:<34} {seconds / opts.count * 1e6:>7.0f}")


if __name__ == "__main__":
    main()
