"""What resource limits cost a spawn, and that a spawn without limits pays nothing for them.

Run: ``python -m bench.limits_spawn [-n COUNT] [--batch SIZE] [--baseline-ref REF]``.

Each sample spawns ``true`` through :func:`execd.spawn.spawn` (stdin on
``/dev/null``, stdout/stderr piped), waits for its exit and reads its pipes
to EOF, in interleaved batches on one uvloop so noise hits every approach
alike:

* ``no limits``: the path every call without ``limits`` takes;
* ``baseline no limits`` (with ``--baseline-ref``, default ``main``): the
  same, with ``execd/spawn.py`` as it is at that git revision, loaded beside
  this one; the ratio of ``no limits`` to it is the cost limits add to calls
  that have none;
* ``rlimits``: ``file_size`` and ``open_files`` (the ``/bin/sh`` prelude
  that sets them, then execs);
* ``cgroup``: ``memory`` and ``processes``, when execd may create cgroups
  here (the prelude also joins the command's cgroups; their directories are
  made before and removed after each spawn);
* ``cgroup v2 cpu``: ``cpu`` where execd watches a v2 cgroup's CPU time (a
  v2 directory per spawn, joined by the prelude, and the watch's first read).

Prints p50 and p99 in microseconds and each ratio to ``no limits`` at p50.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType
from typing import Any

import uvloop

from bench.stats import summarize, time_calls
from execd import pipes
from execd import spawn as spawning
from execd.limits import ResourceControl, sweep
from protocol.rpc.resources import Limits

Sample = Callable[[], Awaitable[None]]


def _baseline(ref: str) -> ModuleType | None:
    """``execd/spawn.py`` as of ``ref``, imported under another name (None if git cannot tell)."""
    try:
        source = subprocess.run(
            ["git", "show", f"{ref}:execd/spawn.py"], capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    with tempfile.NamedTemporaryFile("wb", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("execd._spawn_baseline", f.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first, as importlib's recipe has it: a dataclass in the module
    # looks its own module up in sys.modules while the class is made.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return module


def _sample(spawn: Callable[..., Any], limits: Limits | None = None) -> Sample:
    env = dict(os.environ)
    control = ResourceControl(None)

    async def sample() -> None:
        plan = control.plan(limits) if limits is not None else None
        child = spawn(["true"], env=env, limits=plan) if plan else spawn(["true"], env=env)
        sink: list[bytes] = []
        out = pipes.PipeReader(child.stdout, sink=sink.append)
        err = pipes.PipeReader(child.stderr, sink=sink.append)
        await asyncio.wait([child.exited, out.eof, err.eof])

    return sample


def main(args: Sequence[str] | None = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("-n", "--count", type=int, default=1000, help="spawns per approach")
    parser.add_argument("--batch", type=int, default=50, help="spawns per interleaved batch")
    parser.add_argument("--baseline-ref", default="main", help="git revision of the baseline")
    opts = parser.parse_args(args)

    samples: dict[str, Sample] = {"no limits": _sample(spawning.spawn)}
    baseline = _baseline(opts.baseline_ref)
    if baseline is not None:
        samples[f"baseline no limits ({opts.baseline_ref})"] = _sample(baseline.spawn)
    samples["rlimits (file_size, open_files)"] = _sample(
        spawning.spawn, Limits(file_size=1 << 30, open_files=1024)
    )
    mechanisms = ResourceControl(None).mechanisms()
    if mechanisms["memory"].startswith("cgroup") and mechanisms["processes"].startswith("cgroup"):
        samples["cgroup (memory, processes)"] = _sample(
            spawning.spawn, Limits(memory=1 << 30, processes=256)
        )
    if mechanisms["cpu"] == "cgroup-v2":
        samples["cgroup v2 cpu"] = _sample(spawning.spawn, Limits(cpu=60.0))
    results: dict[str, list[float]] = {name: [] for name in samples}
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    done = 0
    while done < opts.count:
        batch = min(opts.batch, opts.count - done)
        for name, sample in samples.items():
            loop.run_until_complete(time_calls(sample, batch, results[name]))
        done += batch
    loop.close()
    asyncio.set_event_loop(None)
    sweep(final=True)

    print(f"{opts.count} spawns of 'true' per approach, {os.cpu_count()} CPUs, uid {os.getuid()}")
    print(f"{'approach':<36} {'p50 us':>9} {'p99 us':>9} {'mean us':>9} {'ratio':>7}")
    base = summarize(results["no limits"]).p50
    for name, values in results.items():
        row = summarize(values)
        print(f"{name:<36} {row.p50:>9.0f} {row.p99:>9.0f} {row.mean:>9.0f} {row.p50 / base:>7.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
