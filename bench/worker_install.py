"""First-time install and start of the self-contained worker through ``docker exec -i``, vs cached.

Run: ``python -m bench.worker_install --worker dist/execd-worker --image IMAGE [-n COUNT]
[--docker 'docker -H unix:///run/docker.sock'] [--hold sleep infinity]``.

Each sample starts a fresh container of ``IMAGE`` (``docker run -d --init
--network host IMAGE HOLD...``; ``--hold`` is its long-running command) and
times, through :class:`harnessd.docker.DockerWorkspace` joining it:

* *first time*: opening the workspace (probe, upload of the worker through
  ``docker exec -i``'s stdin -- or ``docker cp`` where the image has no shell
  -- and verification) and starting a session on it (execd launched and
  connected, one ``noop`` answered);
* *cached*: the same again in the same container, the worker kept from the
  first: the probe finds it, nothing is uploaded.

Prints the median and the spread of each step in milliseconds. Needs a
Docker daemon and a worker built by ``tools/build_worker.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import time
from collections.abc import Sequence

from harnessd.docker import DockerWorkspace


async def _sample(docker: Sequence[str], container: str, worker: str) -> tuple[float, float]:
    """Open the workspace and start a session; seconds for each step."""
    started = time.perf_counter()
    workspace = DockerWorkspace(container=container, docker=docker, worker=worker, keep_worker=True)
    await workspace.open()
    opened = time.perf_counter()
    try:
        async with workspace.serve() as session:
            await session.client.noop()
            served = time.perf_counter()
    finally:
        await workspace.close()
    return opened - started, served - opened


async def measure(
    docker: Sequence[str], image: str, hold: Sequence[str], worker: str, count: int
) -> dict[str, list[tuple[float, float]]]:
    """``count`` containers, each sampled first-time then cached."""
    results: dict[str, list[tuple[float, float]]] = {"first time": [], "cached": []}
    for _ in range(count):
        run = [*docker, "run", "-d", "--init", "--network", "host", image, *hold]
        made = await asyncio.to_thread(subprocess.run, run, capture_output=True, check=True)
        container = made.stdout.decode().strip()
        try:
            results["first time"].append(await _sample(docker, container, worker))
            results["cached"].append(await _sample(docker, container, worker))
        finally:
            removal = [*docker, "rm", "-f", container]
            await asyncio.to_thread(subprocess.run, removal, capture_output=True, check=False)
    return results


def main(args: Sequence[str] | None = None) -> None:
    """The command line: print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", default=os.environ.get("EXECD_WORKER"), required=False)
    parser.add_argument("--image", required=True)
    parser.add_argument("--docker", default="docker", help="the docker client's command line")
    parser.add_argument("--hold", default="sleep infinity", help="the container's command")
    parser.add_argument("-n", "--count", type=int, default=3)
    opts = parser.parse_args(args)
    if not opts.worker:
        parser.error("--worker (or $EXECD_WORKER) names the worker file")
    size = os.path.getsize(opts.worker)
    results = asyncio.run(
        measure(
            shlex.split(opts.docker), opts.image, shlex.split(opts.hold), opts.worker, opts.count
        )
    )
    print(
        f"{opts.count} containers of {opts.image}, worker {size / 1e6:.1f} MB, {os.cpu_count()} CPUs"
    )
    print(f"{'':<12} {'open ms':>9} {'start ms':>9} {'total ms':>9} {'total min..max':>16}")
    for name, samples in results.items():
        totals = [a + b for a, b in samples]
        opened = statistics.median(a for a, _ in samples)
        served = statistics.median(b for _, b in samples)
        spread = f"{min(totals) * 1e3:.0f}..{max(totals) * 1e3:.0f}"
        print(
            f"{name:<12} {opened * 1e3:>9.0f} {served * 1e3:>9.0f} "
            f"{statistics.median(totals) * 1e3:>9.0f} {spread:>16}"
        )


if __name__ == "__main__":
    main()
