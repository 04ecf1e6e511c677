"""harnessd.ray on a real local Ray cluster (loopback, 2 CPUs): rollouts, backpressure, faults.

100 scripted rollouts over 4 actors of 25 sessions each, one actor killed
while its sessions run: only its rollouts are lost, each is retried once on
another actor, and once the leases of its execds have run out no process
carrying any of the pool's markers is left -- not the execds, not the
background processes the agents left running.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from harnessd.errors import LaunchFailed  # noqa: E402
from harnessd.ray import RolloutPool  # noqa: E402
from harnessd.rollouts import (  # noqa: E402
    LocalWorkspace,
    NoLiveActor,
    PoolFull,
    RolloutFailed,
    RolloutLost,
    RolloutRequest,
    RolloutResult,
    ScriptedModelSpec,
)
from tests.support.procs import wait_until_none_mention  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LEASE = 20.0
"""The execds' lease here: how long a killed actor's execds outlive it.

Shorter than the 30 s default, yet longer than the moments between execd's
announcement and the harness's connection while 100 execds start at once on
two cores (execd gives up on a harness that has not connected by then)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster on loopback with 2 CPUs, in a private (short: socket paths) directory."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    directory = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=200 * 1024 * 1024,
        _temp_dir=directory,
        _node_ip_address="127.0.0.1",
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(directory, ignore_errors=True)


def turns(n: int, think: float = 0.0) -> ScriptedModelSpec:
    """Write a note, leave a process running in the background, read the note back."""
    return ScriptedModelSpec(
        [
            {
                "tool_calls": [
                    {"name": "write_file", "arguments": {"path": "note", "content": f"note {n}"}},
                    {"name": "shell", "arguments": {"command": "sleep 600 >/dev/null 2>&1 &"}},
                ]
            },
            {"tool_calls": [{"name": "read_file", "arguments": {"path": "note"}}]},
            {"content": f"rollout {n} done"},
        ],
        think=think,
        jitter=0.5,
    )


def request(base: str, n: int, think: float = 0.0) -> RolloutRequest:
    """Rollout ``n``, its directory under ``base`` (a lost one's stays, with execd's log)."""
    return RolloutRequest(
        task=f"rollout {n}",
        model=turns(n, think),
        runtime=LocalWorkspace(base_dir=base, lease=LEASE, start_timeout=180.0),
        rollout_id=f"r{n}",
    )


def check_result(result: object, n: int) -> RolloutResult:
    assert isinstance(result, RolloutResult), result
    assert result.rollout_id == f"r{n}"
    tools = [m["content"][:300] for m in result.transcript if m["role"] == "tool"]
    assert (result.stop_reason, result.final_text, result.tool_errors) == (
        "finished",
        f"rollout {n} done",
        0,
    ), (result.error, result.host, result.attempt, tools)
    assert result.transcript[-2] == {
        "role": "tool",
        "content": f"note {n}",
        "tool_call_id": "call_2_1",
    }
    assert (
        result.transcript[0]["role"] == "system"
        and result.transcript[1]["content"] == f"rollout {n}"
    )
    assert result.trace[0]["event"] == "session_start"
    assert result.trace[-1]["event"] == "session_end"
    # execd's ledger head: the session entry, every message and result, the end entry.
    assert result.ledger_seq == 1 + len(result.transcript) + 1
    assert len(result.ledger_hash) == 64
    assert result.clean and result.killed >= 1  # the background sleep, by the marker
    assert 0 < result.timings.launch < result.timings.total
    return result


def test_importing_harnessd_or_its_rollouts_does_not_import_ray() -> None:
    import subprocess

    code = (
        "import sys, harnessd, harnessd.rollouts, harnessd.agent, harnessd.launcher\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_a_hundred_rollouts_survive_an_actor_killed_mid_run(cluster: None, tmp_path: Path) -> None:
    base = str(tmp_path)
    started = time.monotonic()
    pool = RolloutPool(4, sessions_per_actor=25, retries=1)
    try:
        handles = [pool.submit(request(base, n, think=1.0)) for n in range(100)]
        assert pool.free_slots == 0
        with pytest.raises(PoolFull):
            pool.submit(request(base, 100))
        victim = pool.actors[0]
        on_victim = {h.rollout_id for h in handles if h.actor == victim}
        assert len(on_victim) == 25
        deadline = time.monotonic() + 300
        while (status := pool.status(victim)).launched < 10:
            # An actor counts a rollout as running once it has taken it up, not at submit.
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        done_before_kill = status.completed
        victim_pid = status.pid
        killed_at = time.monotonic()
        ray.kill(pool.actor(victim), no_restart=True)
        outcomes = list(pool.results(timeout=600))
        finished = time.monotonic()
    finally:
        pool.shutdown()
    assert len(outcomes) == 100
    results = {o.rollout_id: o for o in outcomes}
    for n in range(100):
        check_result(results[f"r{n}"], n)
    lost = {event.rollout_id for event in pool.lost}
    # Only the victim's rollouts were lost, each once, and each finished on another actor.
    assert all(event.actor == victim and event.attempt == 1 for event in pool.lost)
    assert lost <= on_victim and len(lost) == len(pool.lost)
    assert len(lost) == 25 - done_before_kill
    for rollout_id, result in results.items():
        assert isinstance(result, RolloutResult)
        if rollout_id in lost:
            assert (result.attempt, result.lost_on) == (2, (victim,))
            assert result.host not in ("", victim)
        else:
            assert (result.attempt, result.lost_on) == (1, ())
    assert victim not in pool.actors
    # The victim's execds end by their leases; with them every marked process.
    left = wait_until_none_mention(pool.tag, LEASE + 30.0)
    assert left == [], left
    assert not os.path.exists(f"/proc/{victim_pid}") or _is_zombie(victim_pid)
    print(
        f"\n100 rollouts, {len(lost)} lost with {victim} and retried: "
        f"{finished - started:.1f} s in all, {finished - killed_at:.1f} s after the kill; "
        f"nothing left {time.monotonic() - finished:.1f} s later"
    )


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_backpressure_then_no_live_actor_then_lost_without_retries(
    cluster: None, tmp_path: Path
) -> None:
    base = str(tmp_path)
    pool = RolloutPool(1, sessions_per_actor=2, retries=0)
    try:
        first = [pool.submit(request(base, n, think=30.0)) for n in range(2)]
        with pytest.raises(PoolFull) as full:
            pool.submit(request(base, 2))
        assert "run 2 sessions each" in str(full.value)
        (only,) = pool.actors
        deadline = time.monotonic() + 120
        while (status := pool.status(only)).launched < 2:
            assert status.running <= 2 and time.monotonic() < deadline, status
            time.sleep(0.05)
        ray.kill(pool.actor(only), no_restart=True)
        outcomes = list(pool.results(timeout=120))
        assert sorted(o.rollout_id for o in outcomes) == sorted(h.rollout_id for h in first)
        assert all(isinstance(o, RolloutLost) and o.actor == only for o in outcomes)
        with pytest.raises(NoLiveActor):
            pool.submit(request(base, 3))
        # Queued work with no actor left ends as lost too, instead of waiting forever.
        assert [type(o) for o in pool.run([request(base, 4)])] == [RolloutLost]
        left = wait_until_none_mention(pool.tag, LEASE + 30.0)
        assert left == [], left
    finally:
        pool.shutdown()


def test_a_rollout_that_cannot_launch_fails_typed_and_is_not_retried(
    cluster: None, tmp_path: Path
) -> None:
    base = str(tmp_path)
    bad = RolloutRequest(
        task="never runs",
        model=turns(0),
        runtime=LocalWorkspace(base_dir=base, lease=LEASE, execd_command=("false",)),
        rollout_id="bad",
    )
    with RolloutPool(2, sessions_per_actor=2, retries=1) as pool:
        (outcome, good) = pool.run([bad, request(base, 1)], timeout=300)
        assert isinstance(outcome, RolloutFailed) and outcome.attempt == 1
        assert isinstance(outcome.cause, LaunchFailed)
        assert "exited with status 1" in str(outcome)
        check_result(good, 1)
        assert pool.lost == []
