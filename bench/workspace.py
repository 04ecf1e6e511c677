"""Sections 3 and 5: a command through the shell RPC, watch latency, execd's cold start.

3. ``true`` through ``shell.run`` (collected output) beside
   ``subprocess.run(['true'])`` in the bench process: the local spawn floor;
   and the same with ``cwd=`` a directory other than execd's own (an agent's
   shell tool always passes one). Interleaved batches; the target is an
   absolute difference at p50, for both. Beside them, the floor server's
   ``spawn`` (:mod:`bench.floor`): the same command run and its output
   collected by the least a uvloop msgpack server can do, in another process
   as execd is, so the table also shows what execd adds over a call that
   crosses the same process boundary (no target).
5. Watch latency over the wire: the bench writes a file in the workspace
   (open, write, close) and times until the ``closed_write`` event reaches
   the client, beside the same measurement at the handler level in this
   process (:func:`bench.watch_latency.measure`: inotify and the watch
   machinery without the wire). Cold start: spawning ``python -m execd``
   with a token file until its ``listening`` line, beside spawning a bare
   ``python -c`` until its first line, and one that first imports asyncio,
   uvloop and msgspec (what any such daemon needs before it can listen).
   execd's bytecode is compiled first, as an installed package has it.
"""

from __future__ import annotations

import asyncio
import compileall
import os
import subprocess
import time

from bench import watch_latency
from bench.env import Env
from bench.execd_proc import start_execd, time_interpreter_start
from bench.floor import connect_floor
from bench.report import Row, SectionRows, Step, Target
from bench.settings import HOST
from bench.stats import Call, interleaved, summarize

SPAWN = "3. A command through the shell RPC"
WATCH = "5. Watch latency and cold start"

SPAWN_TARGET_MS = 0.2
WATCH_TARGET_MS = 5.0
#: execd's spawn-to-listening over python -c 'import asyncio, uvloop, msgspec', same run.
COLD_START_TARGET = 1.3
#: What any uvloop daemon speaking msgpack imports before it can listen.
STARTUP_IMPORTS = "asyncio, uvloop, msgspec"


async def spawn_rows(env: Env) -> list[Row]:
    """``true`` via shell.run, without and with a cwd, beside subprocess.run in this process."""
    client = await env.execd.connect()
    floor_server = await connect_floor(HOST, env.raw.ports["rpc"])
    elsewhere = env.path("spawn-cwd")
    os.makedirs(elsewhere, exist_ok=True)
    try:

        async def remote(cwd: str | None = None) -> object:
            result = await client.run(["true"], cwd=cwd)
            if result.exit_code != 0:
                raise RuntimeError(f"true exited with {result.exit_code}")
            return result

        async def remote_cwd() -> object:
            return await remote(elsewhere)

        async def local() -> object:
            # Blocking on purpose: this is the plain local spawn being compared.
            return subprocess.run(  # noqa: ASYNC221
                ["true"], stdin=subprocess.DEVNULL, capture_output=True, check=False
            )

        approaches: dict[str, Call] = {
            "local": local,
            "floor": floor_server.spawn_true,
            "execd": remote,
            "execd_cwd": remote_cwd,
        }
        count = env.settings.spawn_samples
        samples = await interleaved(
            approaches, dict.fromkeys(approaches, count), rounds=max(2, count // 50), warmup=10
        )
    finally:
        floor_server.close()
        await client.close()
    local_summary = summarize([s / 1000 for s in samples["local"]])
    ms = SectionRows(SPAWN, "ms")
    floor = ms.row(
        "spawn.local",
        "subprocess.run(['true']) in the client process",
        local_summary,
        short="local spawn",
    )
    server_summary = summarize([s / 1000 for s in samples["floor"]])
    server = ms.row(
        "spawn.floor",
        "the floor server's spawn of true in its own process, output collected (bench.floor)",
        server_summary,
        baselines=("spawn.local",),
        short="floor server",
    )
    server.note = f"{server_summary.p50 - local_summary.p50:+.2f} ms"
    rows = [floor, server]
    labels = {
        "execd": "execd shell.run(['true']), collected output",
        "execd_cwd": "execd shell.run(['true'], cwd=another directory), collected output",
    }
    for key, label in labels.items():
        remote_summary = summarize([s / 1000 for s in samples[key]])
        difference = remote_summary.p50 - local_summary.p50
        over_server = remote_summary.p50 - server_summary.p50
        row = ms.row(
            f"spawn.{key}",
            label,
            remote_summary,
            baselines=("spawn.local", "spawn.floor"),
            extra={"p50_difference_ms": difference, "p50_over_floor_server_ms": over_server},
        )
        row.target = Target(f"p50 <= floor + {SPAWN_TARGET_MS} ms", difference, SPAWN_TARGET_MS)
        row.note = f"{difference:+.2f} ms; {over_server:+.2f} ms over the floor server"
        rows.append(row)
    return rows


async def watch_rows(env: Env) -> list[Row]:
    """Write-to-event latency over the wire beside the handler-level figure."""
    count = env.settings.watch_samples
    baseline = await watch_latency.measure(count, recursive=False, depth=0)
    directory = env.path("watched")
    os.makedirs(directory, exist_ok=True)
    client = await env.execd.connect()
    latencies: list[float] = []
    try:
        watch = await client.watch(directory)
        try:
            for index in range(count + 5):
                path = os.path.join(directory, f"f{index % 16}")
                before = time.perf_counter()
                watch_latency.write_byte(path)
                while True:
                    kind, event = await watch.next(timeout=10.0)
                    if kind == "closed_write" and event.path == path:
                        break
                if index >= 5:
                    latencies.append((time.perf_counter() - before) * 1000)
        finally:
            await watch.close()
    finally:
        await client.close()
    wire = summarize(latencies)
    handler = Row(
        key="watch.handler",
        section=WATCH,
        short="handler",
        label="watch latency at the handler, no wire (bench.watch_latency)",
        unit="ms",
        p50=baseline["p50_ms"],
        p99=baseline["p99_ms"],
        n=count,
    )
    row = SectionRows(WATCH, "ms").row(
        "watch.execd",
        "watch latency: write in the workspace to event at the client",
        wire,
        baselines=("watch.handler",),
    )
    row.target = Target(f"p50 < {WATCH_TARGET_MS:g} ms", wire.p50, WATCH_TARGET_MS)
    return [handler, row]


def compile_bytecode() -> None:
    """Compile execd's and the protocol's modules, as an installed package has them.

    With ``PYTHONDONTWRITEBYTECODE`` set (or a read-only tree) no ``.pyc``
    would ever be written, and every start would compile every module again.
    """
    import execd
    import protocol

    for package in (execd, protocol):
        compileall.compile_dir(os.path.dirname(package.__file__ or ""), quiet=1)


async def cold_start_rows(env: Env) -> list[Row]:
    """Spawn-to-listening of execd beside spawn-to-first-line of a bare interpreter."""
    await asyncio.to_thread(compile_bytecode)
    bare: list[float] = []
    loaded: list[float] = []
    execd: list[float] = []
    for _ in range(env.settings.cold_starts):
        bare.append(await time_interpreter_start() * 1000)
        loaded.append(await time_interpreter_start(STARTUP_IMPORTS) * 1000)
        async with start_execd(env.workdir) as proc:
            execd.append(proc.startup_seconds * 1000)
        await asyncio.sleep(0.05)
    bare_summary, execd_summary = summarize(bare), summarize(execd)
    loaded_summary = summarize(loaded)
    ms = SectionRows(WATCH, "ms")
    floor, imports, row = ms.ladder(
        Step("start.python", "python -c print: spawn to first line", bare_summary, "bare python"),
        Step(
            "start.imports",
            f"python -c 'import {STARTUP_IMPORTS}': spawn to first line",
            loaded_summary,
            "python + event loop imports",
        ),
        Step("start.execd", "execd cold start: spawn to the listening line", execd_summary),
    )
    row.target = Target(
        f"p50 <= {COLD_START_TARGET:g}x python + event loop imports",
        execd_summary.p50 / loaded_summary.p50,
        COLD_START_TARGET,
    )
    return [floor, imports, row]
