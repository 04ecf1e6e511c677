"""Section 4: file reads and writes through execd beside a raw socket moving the same bytes.

For each size, the bench times ``read_file`` (``files.read``, streamed) of a
file that is in the page cache, and ``write_file`` (``files.write``; inline up
to half a frame, streamed above) with ``atomic=False``, so both sides of the
comparison move bytes and neither waits for the disk. The raw baseline is
:class:`bench.floor.BulkClient` on uvloop: the same byte count over one TCP
connection, received straight into one buffer on reads and discarded on
writes. For the largest size two more rows give context: the raw socket
writing what it receives into a file (the file system's share of an upload)
and the default atomic ``files.write`` (temporary file, fsync, rename: the
disk's share).

Small sizes are reported as time per transfer (ratio: times slower than the
raw socket); the largest as a rate in MB/s (ratio: share of the raw rate).
At the smallest size more rows: execd's own ``server.noop`` on the same
connection (small reads and writes should cost about a no-op), the default
atomic ``files.write`` and its local floor, a write + fsync + rename of the
same bytes in the bench process, the same write done by the floor server's
``write`` (:mod:`bench.floor`: in another process, as execd is; no target),
and the atomic write with ``durable=True`` beside the same floor plus a
fsync of the directory.

Placement (see :mod:`bench.placement`): the rows that compare processes over
loopback -- execd's reads, writes and no-op, the raw socket, every row of
the largest size -- run with the bench process on one core and execd and the
raw server on another, as sections 1 and 2 do; left to the scheduler their
ratios changed with where each process happened to be woken (a 256 MiB read:
0.27-0.76 of the raw socket unpinned, 0.63-0.88 pinned: woken on one core,
the two ends took turns). The small atomic writes and their local floors run
unpinned (the floor is the bench process's own write + fsync + rename, which
a pinned process did more slowly). The smallest read, write and no-op are
then timed once more with everything on one core (``files1`` rows, no
target): CPU per call with no wake-up latency to hide it.

Every measurement of the largest size starts from the same memory state in
the bench process: its heap trimmed (``malloc_trim(0)``, through
:func:`execd.memory.trim`) right before the timer starts. Both sides fill a
fresh buffer of that size (the raw read one ``bytearray``, ``read_file`` its
``BytesIO``), and glibc serves it from free heap memory when it has enough.
Memory a previous measurement touched and freed makes the next one skip its
page faults: the raw read measured 2,137 MB/s right after an execd
measurement and 530-650 MB/s without, so the ratio depended on the order of
the rows. Trimming gives every measurement the untouched memory a process
that does nothing else would get, whatever ran before; the alternative,
touching the buffer first, would time a case (a reused buffer) that
``read_file``'s callers do not have. The trim runs outside the timed region;
without glibc it does nothing, and the order may matter again. execd's
heap is its own business (its trimmer gives memory back after a quiet
second), as is the raw server's (it sends from one buffer).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Awaitable, Callable

import msgspec

from bench.env import Env
from bench.floor import connect_bulk, connect_floor, write_fsync_rename, write_params
from bench.placement import one_core_rows, pinned
from bench.report import Row, Target
from bench.settings import HOST, MIB, size_label
from bench.stats import interleaved, rate_summary, summarize
from execd.memory import trim

SECTION = "4. File read and write (files.read / files.write) beside a raw socket"
LARGE_TARGET = 0.6
#: files.read / files.write (atomic=false) of the smallest size, times execd's own no-op.
SMALL_READ_TARGET = 2.0
SMALL_WRITE_TARGET = 2.5
#: The atomic files.write of the smallest size over a local write + fsync + rename, in ms.
ATOMIC_TARGET_MS = 0.15
#: files.read of the medium size, times the raw socket.
MEDIUM_READ_TARGET = 1.5

Timed = Callable[[], Awaitable[object]]

#: Rows of the small and medium sizes that compare processes over loopback: timed
#: with the bench process (the clients) on one core and the servers on another, as
#: sections 1 and 2 are (every row of the largest size is). The rest (the atomic
#: writes and their floors in the bench process) run
#: unpinned: pinned to one core, the bench process's own write + fsync +
#: rename took 0.43-0.48 ms instead of 0.29-0.34 ms, which flattered execd.
_BETWEEN_PROCESSES = frozenset({"raw_read", "execd_read", "raw_write", "execd_write", "noop"})
#: Rows of the smallest size timed once more with everything on one core (no target).
_ONE_CORE = ("noop", "execd_read", "execd_write")


def _write_local(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


def _payload(rng: random.Random, size: int) -> bytes:
    """``size`` pseudo-random bytes (a random MiB repeated beyond 1 MiB)."""
    block = rng.randbytes(min(size, MIB))
    return (block * (size // len(block) + 1))[:size] if size > len(block) else block


async def _time(action: Timed) -> float:
    started = time.perf_counter()
    await action()
    return time.perf_counter() - started


async def run(env: Env) -> list[Row]:
    """Rows for every size, both directions, execd and raw."""
    settings = env.settings
    client = await env.execd.connect()
    bulk = await connect_bulk(HOST, env.raw.ports["bulk"])
    floor_server = await connect_floor(HOST, env.raw.ports["rpc"])
    rows: list[Row] = []
    servers = (env.execd.pid, env.raw.pid)
    try:
        rng = random.Random(1234)
        for index, (size, count) in enumerate(
            zip(settings.file_sizes, settings.file_samples, strict=True)
        ):
            name = ("small", "medium", "large")[index]
            data = _payload(rng, size)
            path = env.path(f"transfer-{name}.bin")
            _write_local(path, data)
            await client.read_file(path)

            async def execd_read(path: str = path, size: int = size) -> object:
                got = await client.read_file(path)
                if len(got) != size:
                    raise RuntimeError(f"read {len(got)} bytes of {size}")
                return got

            async def raw_read(size: int = size) -> object:
                got = await bulk.read(size)
                if len(got) != size:
                    raise RuntimeError(f"raw read {len(got)} bytes of {size}")
                return got

            async def execd_write(path: str = path, data: bytes = data) -> object:
                return await client.write_file(path, data, atomic=False)

            async def raw_write(data: bytes = data) -> object:
                return await bulk.write(data)

            async def raw_write_file(data: bytes = data) -> object:
                return await bulk.write(data, to_file=True)

            async def execd_atomic(path: str = path, data: bytes = data) -> object:
                return await client.write_file(path, data)

            async def execd_durable(path: str = path, data: bytes = data) -> object:
                return await client.write_file(path, data, durable=True)

            actions: dict[str, Timed] = {
                "raw_read": raw_read,
                "execd_read": execd_read,
                "raw_write": raw_write,
                "execd_write": execd_write,
            }
            if name == "large":
                actions["raw_write_file"] = raw_write_file
                actions["execd_write_atomic"] = execd_atomic
            if name == "small":
                local_path = env.path("transfer-local.bin")

                async def local_atomic(data: bytes = data, local: str = local_path) -> object:
                    # Blocking on purpose: the local floor of the atomic write.
                    write_fsync_rename(local, data)
                    return None

                async def local_atomic_dir(data: bytes = data, local: str = local_path) -> object:
                    write_fsync_rename(local, data, sync_directory=True)
                    return None

                floor_params = write_params(env.path("transfer-floor-server.bin"), data)

                async def floor_atomic(params: msgspec.Raw = floor_params) -> object:
                    return await floor_server.call("write", params)

                actions["noop"] = client.noop
                actions["execd_write_atomic"] = execd_atomic
                actions["local_atomic"] = local_atomic
                actions["local_atomic_dir"] = local_atomic_dir
                actions["floor_atomic"] = floor_atomic
                actions["execd_write_durable"] = execd_durable
            times: dict[str, list[float]] = {key: [] for key in actions}
            if name != "large":
                # Batches that take turns (as in section 1): one call of each in turn
                # would time every call after a fsync's sleep on cold, idle cores.
                rounds = max(2, count // 30)
                between = {k: a for k, a in actions.items() if k in _BETWEEN_PROCESSES}
                with pinned(servers, "cross") as where:
                    batches = await interleaved(
                        between, dict.fromkeys(between, count), rounds=rounds, warmup=3
                    )
                floors = {k: a for k, a in actions.items() if k not in between}
                if floors:
                    # Unpinned: a pinned bench process makes the local floor slower.
                    batches |= await interleaved(
                        floors, dict.fromkeys(floors, count), rounds=rounds, warmup=3
                    )
                times = {key: [us / 1e6 for us in batch] for key, batch in batches.items()}
                if name == "small":
                    one = {k: between[k] for k in _ONE_CORE}
                    with pinned(servers, "same") as where_one:
                        on_one = await interleaved(
                            one, dict.fromkeys(one, count), rounds=rounds, warmup=3
                        )
                    rows += _one_core_rows(on_one, size, where_one)
            else:
                with pinned(servers, "cross") as where:
                    for _ in range(count):
                        for key, action in actions.items():
                            trim()  # the same memory state for every row (module docstring)
                            times[key].append(await _time(action))
            rows += _rows(name, size, times, where)
            del data
            os.unlink(path)
            for leftover in ("transfer-local.bin", "transfer-floor-server.bin"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(env.path(leftover))
    finally:
        floor_server.close()
        bulk.close()
        await client.close()
    return rows


def _one_core_rows(samples: dict[str, list[float]], size: int, where: str) -> list[Row]:
    """The smallest read and write and the no-op again on one core: CPU per call, no wake-ups."""
    label = size_label(size)
    labels = {
        "noop": f"execd server.noop ({where})",
        "execd_read": f"execd files.read, {label}, on that core",
        "execd_write": f"execd files.write, {label}, atomic=false, on that core",
    }
    return one_core_rows(
        samples, labels, prefix="files1.small.", section=SECTION, short="no-op on one core"
    )


def _rows(name: str, size: int, times: dict[str, list[float]], where: str) -> list[Row]:
    label = size_label(size)
    large = name == "large"
    rows: list[Row] = []
    titles = {
        "raw_read": f"raw socket, {label} to the client ({where})",
        "execd_read": f"execd files.read, {label}",
        "raw_write": f"raw socket, {label} from the client",
        "raw_write_file": f"raw socket, {label} from the client into a file (no fsync)",
        "execd_write": f"execd files.write, {label}, atomic=false",
        "execd_write_atomic": f"execd files.write, {label}, atomic (default: fsync, rename)",
        "noop": "execd server.noop on the same connection",
        "local_atomic": f"local write + fsync + rename of {label} in the client process",
        "local_atomic_dir": "the same + fsync of the directory (as a durable write does)",
        "floor_atomic": f"the floor server's write + fsync + rename of {label} in its own process",
        "execd_write_durable": f"execd files.write, {label}, atomic, durable=true",
    }
    for key, seconds in times.items():
        direction = "read" if key.endswith("read") else "write"
        baselines: tuple[str, ...] = (f"files.{name}.raw_{direction}",)
        if key.startswith("raw"):
            baselines = (f"files.{name}.raw_write",) if key == "raw_write_file" else ()
        elif key in ("noop", "local_atomic", "local_atomic_dir"):
            baselines = ()
        elif key == "floor_atomic":
            baselines = (f"files.{name}.local_atomic",)
        elif direction == "write" and large:
            baselines += (f"files.{name}.raw_write_file",)
        elif key == "execd_write_atomic":
            baselines = (f"files.{name}.local_atomic", f"files.{name}.floor_atomic")
        elif key == "execd_write_durable":
            baselines = (f"files.{name}.local_atomic_dir",)
        if name == "small" and key in ("execd_read", "execd_write"):
            baselines += (f"files.{name}.noop",)
        if large:
            summary = rate_summary(size / 1e6, seconds)
            unit = "MB/s"
        else:
            summary = summarize([s * 1000 for s in seconds])
            unit = "ms"
        row = Row(
            key=f"files.{name}.{key}",
            section=SECTION,
            label=titles[key],
            unit=unit,
            **summary.figures(),
            baselines=baselines,
            short={
                "raw_read": "raw",
                "raw_write": "raw",
                "raw_write_file": "raw into a file",
                "noop": "no-op",
                "local_atomic": "local floor",
                "local_atomic_dir": "local floor with directory fsync",
                "floor_atomic": "floor server",
            }.get(key, ""),
            extra={"bytes": float(size), "mean": summary.mean},
        )
        rows.append(row)
    by_key = {row.key: row for row in rows}
    if name == "small":
        noop = by_key["files.small.noop"].p50
        for key, limit in (("execd_read", SMALL_READ_TARGET), ("execd_write", SMALL_WRITE_TARGET)):
            row = by_key[f"files.small.{key}"]
            row.target = Target(f"p50 <= {limit:g}x the no-op", row.p50 / noop, limit)
        atomic, floor = by_key["files.small.execd_write_atomic"], by_key["files.small.local_atomic"]
        atomic.target = Target(
            f"p50 <= local floor + {ATOMIC_TARGET_MS:g} ms",
            atomic.p50 - floor.p50,
            ATOMIC_TARGET_MS,
        )
        server = by_key["files.small.floor_atomic"]
        atomic.note = f"{atomic.p50 - floor.p50:+.2f} ms; {atomic.p50 - server.p50:+.2f} ms over the floor server"
        atomic.extra["p50_over_floor_server_ms"] = atomic.p50 - server.p50
        server.note = f"{server.p50 - floor.p50:+.2f} ms"
        durable = by_key["files.small.execd_write_durable"]
        durable.note = f"{durable.p50 - by_key['files.small.local_atomic_dir'].p50:+.2f} ms"
    if name == "medium":
        row, base = by_key["files.medium.execd_read"], by_key["files.medium.raw_read"]
        row.target = Target(
            f"p50 <= {MEDIUM_READ_TARGET:g}x raw socket", row.p50 / base.p50, MEDIUM_READ_TARGET
        )
    if large:
        for direction in ("read", "write"):
            row = by_key[f"files.large.execd_{direction}"]
            base = by_key[f"files.large.raw_{direction}"]
            row.target = Target(
                f"rate >= {LARGE_TARGET:g} of raw socket", row.p50 / base.p50, LARGE_TARGET, True
            )
    return rows
