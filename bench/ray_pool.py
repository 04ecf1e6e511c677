"""A Ray rollout pool under a steady load, one of its actors killed: throughput and time to retry.

    python -m bench.ray_pool [--nodes 3] [--actors 3] [--sessions 6] [--think 0.5] [--window 20]

On a local cluster of ``--nodes`` Ray nodes (loopback, one CPU each), a
:class:`~harnessd.ray.RolloutPool` of ``--actors`` actors (spread over the
nodes) is kept full by the usual refill loop: a new rollout whenever
``free_slots`` says there is room. Each rollout launches its own execd,
runs three turns paced by ``--think`` seconds (a file write and a process
left in the background, a read, the answer) and closes. After a warm-up
window, completions are counted for ``--window`` seconds; then the first
actor is killed with ``ray.kill`` and completions are counted for another
window while new work keeps coming.

Printed: rollouts/s before and after the kill; for the lost rollouts, the
time from the kill to the loss being noticed, to the lost attempt being
reaped and its retry dispatched, and to the retry starting in its actor;
and whether any process of the pool or workspace directory was left.
Exit status 1 when a rollout did not finish or something was left.
"""

from __future__ import annotations

import argparse
import os

# Ray on loopback only (read once, when Ray is first imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray

from bench.agents import processes_mentioning
from bench.ray_cluster import local_cluster
from bench.settings import default_tmp
from harnessd.ray import RolloutPool
from harnessd.rollouts import (
    LocalWorkspace,
    PoolFull,
    RolloutRequest,
    RolloutResult,
    ScriptedModelSpec,
)


@dataclass(frozen=True, slots=True)
class PoolBenchConfig:
    """The cluster, the pool and the load."""

    nodes: int = 3
    actors: int = 3
    sessions: int = 6
    think: float = 0.5
    window: float = 20.0


def _request(n: int, base: str, think: float) -> RolloutRequest:
    turns = [
        {
            "tool_calls": [
                {"name": "write_file", "arguments": {"path": "note", "content": f"note {n}"}},
                {"name": "shell", "arguments": {"command": "sleep 600 >/dev/null 2>&1 &"}},
            ]
        },
        {"tool_calls": [{"name": "read_file", "arguments": {"path": "note"}}]},
        {"content": f"rollout {n} done"},
    ]
    return RolloutRequest(
        task=f"rollout {n}",
        model=ScriptedModelSpec(turns, think=think, jitter=0.3),
        runtime=LocalWorkspace(base_dir=base, lease=60.0),
        rollout_id=f"r{n}",
    )


def _left_after(tag: str, seconds: float) -> list[str]:
    """Processes still carrying ``tag`` after up to ``seconds`` (a supervisor shell exits a
    moment after its execd; a lease lasts a minute)."""
    deadline = time.monotonic() + seconds
    while (left := processes_mentioning(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "none"
    return f"p50 {statistics.median(values):.2f} s, max {max(values):.2f} s (n={len(values)})"


def run(config: PoolBenchConfig) -> bool:
    """Run the bench and print its figures; True when every rollout finished and nothing was left."""
    base = tempfile.mkdtemp(prefix="bench-ray-pool-", dir=default_tmp())
    ok = True
    with local_cluster(config.nodes, cpus=1):
        pool = RolloutPool(config.actors, sessions_per_actor=config.sessions, retries=1)
        submitted = 0

        def refill() -> None:
            nonlocal submitted
            while pool.free_slots > 0:
                try:
                    pool.submit(_request(submitted, base, config.think))
                except PoolFull:
                    return
                submitted += 1

        started = time.monotonic()
        measure_from = started + config.window
        kill_at = measure_from + config.window
        stop_at = kill_at + config.window
        killed_wall = killed_mono = 0.0
        finished: list[tuple[float, RolloutResult]] = []
        failures: list[str] = []
        try:
            refill()
            for outcome in pool.results(timeout=config.window * 10 + 300):
                now = time.monotonic()
                if isinstance(outcome, RolloutResult) and outcome.final_text is not None:
                    finished.append((now, outcome))
                else:
                    failures.append(f"{outcome.rollout_id}: {outcome}")
                if not killed_mono and now >= kill_at:
                    victim = pool.actors[0]
                    killed_wall, killed_mono = time.time(), time.monotonic()
                    ray.kill(pool.actor(victim), no_restart=True)
                if now < stop_at:
                    refill()
            left = _left_after(pool.tag, 15.0)
        finally:
            pool.shutdown()
        before = sum(1 for at, _ in finished if measure_from <= at < kill_at)
        after = sum(1 for at, _ in finished if killed_mono <= at < killed_mono + config.window)
        by_id = {result.rollout_id: result for _, result in finished}
        noticed = [event.noticed_at - killed_wall for event in pool.lost]
        retry_started = [
            by_id[event.rollout_id].started_at - killed_wall
            for event in pool.lost
            if event.rollout_id in by_id
        ]
        from_notice = [
            by_id[event.rollout_id].started_at - event.noticed_at
            for event in pool.lost
            if event.rollout_id in by_id
        ]
        metrics = pool.metrics()
        print(
            f"pool: {config.actors} actors x {config.sessions} sessions on {config.nodes} nodes, "
            f"think {config.think} s, windows of {config.window:g} s; load {os.getloadavg()[0]:.1f}"
        )
        print(f"rollouts/s before the kill: {before / config.window:.2f}")
        print(f"rollouts/s in the {config.window:g} s after it: {after / config.window:.2f}")
        print(
            f"lost with the actor: {len(pool.lost)}, reaped: "
            f"{sum(1 for e in pool.lost if e.reaped is not None and e.reaped.clean)}"
        )
        print(f"kill -> loss noticed: {_spread(noticed)}")
        print(
            f"loss noticed -> retry dispatched: p50 {metrics.retry_wait[0]:.2f} s, "
            f"max {metrics.retry_wait[1]:.2f} s"
        )
        print(f"loss noticed -> retry started in its actor: {_spread(from_notice)}")
        print(f"kill -> retry started: {_spread(retry_started)}")
        print(
            f"tool calls: p50 {metrics.tool_call_ms[0]:.1f} ms, p95 {metrics.tool_call_ms[1]:.1f} ms"
        )
        workspaces = os.listdir(base)
        print(f"left: {len(left)} processes, {len(workspaces)} workspace directories")
        for line in left[:10]:
            print(f"LEFT {line}")
        ok = not failures and not left and not workspaces and len(by_id) == submitted
        for failure in failures[:10]:
            print(f"FAILED {failure}")
    shutil.rmtree(base, ignore_errors=True)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m bench.ray_pool", description=__doc__)
    defaults = PoolBenchConfig()
    parser.add_argument("--nodes", type=int, default=defaults.nodes)
    parser.add_argument("--actors", type=int, default=defaults.actors)
    parser.add_argument("--sessions", type=int, default=defaults.sessions, help="per actor")
    parser.add_argument("--think", type=float, default=defaults.think, help="seconds per turn")
    parser.add_argument("--window", type=float, default=defaults.window, help="seconds")
    args = parser.parse_args(argv)
    config = PoolBenchConfig(args.nodes, args.actors, args.sessions, args.think, args.window)
    return 0 if run(config) else 1


if __name__ == "__main__":
    sys.exit(main())
