"""Does execd give memory back after a hostile phase? RSS idle, at peak, and settled.

    python -m bench.rss_settle [--rounds N] [--settle SECONDS] [--json]

Starts one execd, samples its resident set size (the baseline, in the same
run), then drives ``N`` rounds of large work through it: a 15 MiB echo, a
command printing 20 MB on each of stdout and stderr (both captured at the
default cap), a 16 MiB inline file write and read back, and 20 connections
at once each echoing 1 MiB and capturing 3 MB of output. After each round it
waits ``--settle`` seconds without traffic and samples again. The report
gives every sample and the ratio of the last to the baseline; a long-lived
worker should settle near its idle size (ratio close to 1), not keep its
peak.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field

from bench.execd_proc import ExecdProcess, read_status_kib, start_execd
from harnessd import errors

MIB = 1024 * 1024


@dataclass
class Samples:
    """RSS samples in KiB."""

    idle: int = 0
    peak: int = 0
    after_rounds: list[int] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Last settled sample over the idle baseline."""
        return self.after_rounds[-1] / self.idle if self.idle and self.after_rounds else 0.0


async def _round(execd: ExecdProcess, workdir: str) -> None:
    client = await execd.connect()
    try:
        # Either may be refused (by an execd whose results must fit a frame): memory is the point.
        with contextlib.suppress(errors.RemoteError):
            await client.call("server.echo", {"data": os.urandom(15 * MIB)})
        command = "head -c 20000000 /dev/zero; head -c 20000000 /dev/zero >&2"
        with contextlib.suppress(errors.RemoteError):
            await client.call("shell.run", {"command": command})
        path = os.path.join(workdir, "big.bin")
        await client.call("files.write", {"path": path, "data": os.urandom(16 * MIB - 4096)})
        await client.call("files.read", {"path": path})
    finally:
        await client.close()

    async def one() -> None:
        other = await execd.connect()
        try:
            await other.call("server.echo", {"data": os.urandom(MIB)})
            await other.call("shell.run", {"command": "head -c 3000000 /dev/zero"})
        finally:
            await other.close()

    await asyncio.gather(*(one() for _ in range(20)))


async def measure(rounds: int, settle: float) -> Samples:
    """Run the hostile rounds against a fresh execd and sample its RSS."""
    samples = Samples()
    with tempfile.TemporaryDirectory(prefix="rss-settle-") as workdir:
        async with start_execd(workdir) as execd:
            await asyncio.sleep(settle)
            samples.idle = read_status_kib(execd.pid, "VmRSS")
            for _ in range(rounds):
                await _round(execd, workdir)
                samples.peak = max(samples.peak, read_status_kib(execd.pid, "VmHWM"))
                await asyncio.sleep(settle)
                samples.after_rounds.append(read_status_kib(execd.pid, "VmRSS"))
    return samples


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python -m bench.rss_settle", description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    samples = asyncio.run(measure(args.rounds, args.settle))
    if args.json:
        print(json.dumps({**asdict(samples), "ratio": samples.ratio}))
        return 0
    print(f"execd RSS idle (baseline):   {samples.idle / 1024:7.1f} MiB")
    print(f"execd RSS peak (VmHWM):      {samples.peak / 1024:7.1f} MiB")
    for index, kib in enumerate(samples.after_rounds, 1):
        print(f"after round {index} + {args.settle:g} s idle: {kib / 1024:7.1f} MiB")
    print(f"settled / idle:              {samples.ratio:7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
