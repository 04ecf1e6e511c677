"""What the cores a call lands on cost: two local-floor targets, measured on every placement.

Run: ``python -m bench.cores [-n COUNT] [--dir DIR]``.

Two targets of ``harnessd bench`` compare a call through execd with the same
work done in the client process itself: ``true`` through ``shell.run``
with ``subprocess.run`` (section 3), the atomic 4 KiB write with a local
write + fsync + rename (section 4). The floor runs in one process; the call
crosses two, and what that costs beyond the round trip depends on where
each runs: on some machines a core woken from idle runs the code that
follows more slowly than a busy one, and an fsync sleeps until the block
device's interrupt, which one core takes, wakes it.

One execd and one floor server (:mod:`bench.floor`: the least a uvloop
msgpack server does for the same work) serve every placement of this
process (the client, and the local floors) and of the two servers on the
usable cores: both on the first core, both on the second, then each on its
own, both ways. Each placement times, in interleaved batches, execd's
no-op, the atomic write and ``true`` through execd, the same three through
the floor server, and the two local floors in this process. It prints the
p50 of each, what execd adds over the local floor and over the floor
server, then which cores take the interrupts of the block device that
holds ``--dir``. With both on one core and ``--dir`` on a tmpfs, no
wake-up crosses cores and no disk is waited for: what is left of execd's
difference from the floor server is CPU per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import runner
from bench.execd_proc import start_execd
from bench.floor import connect_floor, write_fsync_rename, write_params
from bench.placement import placed
from bench.servers import start_server
from bench.settings import HOST
from bench.stats import Call, interleaved

SIZE = 4096
"""Bytes of each atomic write (the size of section 4's target row)."""


def placements(cores: Sequence[int]) -> list[tuple[int, int]]:
    """``(client core, execd core)`` pairs: both on one core, then each on its own."""
    if len(cores) < 2:
        return [(cores[0], cores[0])]
    first, second = cores[0], cores[1]
    return [(first, first), (second, second), (first, second), (second, first)]


def block_interrupts(path: str) -> list[tuple[int, str, str]]:
    """``(irq, name, cores)`` of the interrupts of the block device holding ``path``.

    Empty when the filesystem has no block device (tmpfs, overlay) or sysfs
    does not tell. ``cores`` is the kernel's effective affinity.
    """
    st = os.stat(path)
    node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    try:
        disk = node.resolve(strict=True)
    except OSError:
        return []
    if (disk / "partition").exists():
        disk = disk.parent
    device = (disk / "device").resolve()
    names = _interrupt_names()
    for directory in (device, *list(device.parents)[:3]):
        irqs = directory / "msi_irqs"
        if irqs.is_dir():
            found = []
            for entry in sorted(irqs.iterdir(), key=lambda p: int(p.name)):
                irq = int(entry.name)
                found.append((irq, names.get(irq, "?"), _effective_cores(irq)))
            return found
    return []


def _interrupt_names() -> dict[int, str]:
    names: dict[int, str] = {}
    try:
        lines = Path("/proc/interrupts").read_text(encoding="ascii", errors="replace")
    except OSError:
        return names
    for line in lines.splitlines()[1:]:
        head, _, rest = line.partition(":")
        if head.strip().isdigit():
            fields = rest.split()
            names[int(head)] = fields[-1] if fields else "?"
    return names


def _effective_cores(irq: int) -> str:
    for name in ("effective_affinity_list", "smp_affinity_list"):
        try:
            return Path(f"/proc/irq/{irq}/{name}").read_text(encoding="ascii").strip()
        except OSError:
            continue
    return "?"


async def measure(directory: str, count: int) -> dict[tuple[int, int], dict[str, float]]:
    """p50 (us) of every approach on every placement."""
    data = os.urandom(SIZE)
    remote_path = os.path.join(directory, "cores-execd.bin")
    local_path = os.path.join(directory, "cores-local.bin")
    server_params = write_params(os.path.join(directory, "cores-server.bin"), data)
    results: dict[tuple[int, int], dict[str, float]] = {}
    async with start_execd(directory) as execd, start_server("raw") as raw:
        client = await execd.connect()
        server = await connect_floor(HOST, raw.ports["rpc"])
        try:

            async def server_noop() -> object:
                return await server.call("noop")

            async def server_atomic() -> object:
                return await server.call("write", server_params)

            async def atomic() -> object:
                return await client.write_file(remote_path, data)

            async def local_atomic() -> object:
                # Blocking on purpose: the floor runs in the client process.
                write_fsync_rename(local_path, data)
                return None

            async def true() -> object:
                result = await client.run(["true"])
                if result.exit_code != 0:
                    raise RuntimeError(f"true exited with {result.exit_code}")
                return result

            async def local_true() -> object:
                return subprocess.run(  # noqa: ASYNC221
                    ["true"], stdin=subprocess.DEVNULL, capture_output=True, check=False
                )

            approaches: dict[str, Call] = {
                "noop": client.noop,
                "server_noop": server_noop,
                "atomic": atomic,
                "local_atomic": local_atomic,
                "server_atomic": server_atomic,
                "true": true,
                "local_true": local_true,
                "server_true": server.spawn_true,
            }
            cores = sorted(os.sched_getaffinity(0))
            for client_core, server_core in placements(cores):
                with placed([execd.pid, raw.pid], client_core, server_core):
                    samples = await interleaved(
                        approaches,
                        dict.fromkeys(approaches, count),
                        rounds=max(2, count // 20),
                        warmup=10,
                    )
                results[(client_core, server_core)] = {
                    name: statistics.median(values) for name, values in samples.items()
                }
        finally:
            server.close()
            await client.close()
    return results


def report(results: dict[tuple[int, int], dict[str, float]], directory: str) -> str:
    """The table, then the block device's interrupt cores."""
    lines = [
        f"p50 in us per call; the servers and this process pinned; {SIZE} B atomic writes in"
        f" {directory}",
        "each of no-op, atomic and true: execd, then the floor server; atomic and true then the"
        " local floor in this process, execd over the local floor, execd over the floor server",
        f"{'client/servers':>14} {'no-op':>6} {'srv':>6}"
        f" {'atomic':>6} {'srv':>6} {'local':>6} {'+':>5} {'+srv':>5}"
        f" {'true':>6} {'srv':>6} {'local':>6} {'+':>5} {'+srv':>5}",
    ]
    for (client_core, server_core), p50 in results.items():
        cells = [f"{f'{client_core} / {server_core}':>14}", f"{p50['noop']:6.0f}"]
        cells.append(f"{p50['server_noop']:6.0f}")
        for name in ("atomic", "true"):
            execd, server, local = p50[name], p50[f"server_{name}"], p50[f"local_{name}"]
            cells += [f"{execd:6.0f}", f"{server:6.0f}", f"{local:6.0f}"]
            cells += [f"{execd - local:+5.0f}", f"{execd - server:+5.0f}"]
        lines.append(" ".join(cells))
    interrupts = block_interrupts(directory)
    if interrupts:
        listed = ", ".join(f"{name} (irq {irq}) on core {where}" for irq, name, where in interrupts)
        lines.append(f"block device interrupts: {listed}")
    else:
        lines.append("block device interrupts: not found (no block device, or sysfs does not say)")
    return "\n".join(lines)


def main(args: Sequence[str] | None = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--count", type=int, default=400, help="samples per approach")
    parser.add_argument(
        "--dir", default=None, help="directory for the writes (default: a new one under /tmp)"
    )
    options = parser.parse_args(args)
    if options.count < 2:
        parser.error("--count must be at least 2")
    with tempfile.TemporaryDirectory(prefix="bench-cores-", dir=options.dir) as directory:
        results = runner.run(measure(directory, options.count), "python -m bench.cores")
        print(report(results, directory))


if __name__ == "__main__":
    main(sys.argv[1:])
