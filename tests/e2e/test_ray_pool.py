"""harnessd.ray on a real local Ray cluster of three nodes on loopback: placement, faults, reaping.

One cluster serves the module (three nodes of one CPU each); a test that
removes a node adds its own first. Each rollout leaves a loop running in the
background that appends its attempt's marker and the time to a file outside
the workspace every 50 ms: an attempt still running beside its retry would
show as interleaved lines of two markers.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from ray.cluster_utils import Cluster  # noqa: E402

from bench.ray_cluster import cluster_nodes, local_cluster, node_args, raylet_pid  # noqa: E402
from harnessd.errors import LaunchFailed  # noqa: E402
from harnessd.ray import RolloutPool  # noqa: E402
from harnessd.ray_nodes import NodeWorkspace  # noqa: E402
from harnessd.rollouts import (  # noqa: E402
    LocalWorkspace,
    NoLiveActor,
    PoolFull,
    RolloutFailed,
    RolloutLost,
    RolloutRequest,
    RolloutResult,
    RolloutTimedOut,
    ScriptedModelSpec,
)
from tests.support.procs import wait_until_none_mention  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LEASE = 60.0
"""The execds' lease where reaping is under test: longer than any test waits, so a
process that only the lease would have ended shows as left over."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Three Ray nodes on loopback, one CPU each."""
    with local_cluster(3) as started:
        yield started


def script(n: int, log: Path, think: float) -> ScriptedModelSpec:
    """Write a note, start the side-effect loop, read the note back, finish."""
    loop = (
        f'while :; do echo "$EXECD_MARKER $(date +%s.%N)" >> {log}; sleep 0.05; done '
        ">/dev/null 2>&1 &"
    )
    return ScriptedModelSpec(
        [
            {
                "tool_calls": [
                    {"name": "write_file", "arguments": {"path": "note", "content": f"note {n}"}},
                    {"name": "shell", "arguments": {"command": loop}},
                ]
            },
            {"tool_calls": [{"name": "read_file", "arguments": {"path": "note"}}]},
            {"content": f"rollout {n} done"},
        ],
        think=think,
        jitter=0.3,
    )


def request(
    base: Path, n: int, *, think: float = 0.5, runtime: Any = None, **fields: Any
) -> RolloutRequest:
    """Rollout ``n``: its workspace under ``base/ws``, its side effects in ``base/fx/r<n>``."""
    (base / "ws").mkdir(exist_ok=True)
    (base / "fx").mkdir(exist_ok=True)
    return RolloutRequest(
        task=f"rollout {n}",
        model=script(n, base / "fx" / f"r{n}", think),
        runtime=runtime or LocalWorkspace(base_dir=str(base / "ws"), lease=LEASE),
        rollout_id=f"r{n}",
        **fields,
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
    # execd's ledger head: the session entry, every message and result, the end entry.
    assert result.ledger_seq == 1 + len(result.transcript) + 1 and len(result.ledger_hash) == 64
    assert result.clean and result.killed >= 1  # the side-effect loop, by the marker
    assert 0 < result.timings.launch < result.timings.total and result.started_at > 0
    return result


def wait_for_loops(base: Path, rollout_ids: list[str], count: int) -> None:
    """Wait until ``count`` of the rollouts run their side-effect loops."""
    deadline = time.monotonic() + 300
    while sum((base / "fx" / rid).exists() for rid in rollout_ids) < count:
        assert time.monotonic() < deadline, rollout_ids
        time.sleep(0.05)


def attempts_in(log: Path) -> dict[str, tuple[float, float]]:
    """Each marker's first and last line in a side-effect log."""
    spans: dict[str, list[float]] = collections.defaultdict(list)
    for line in log.read_text().splitlines():
        marker, _, when = line.partition(" ")
        spans[marker].append(float(when))
    return {marker: (min(times), max(times)) for marker, times in spans.items()}


def assert_no_overlap(base: Path, lost: list[RolloutLost]) -> None:
    """Every lost attempt that left side effects (one at least) stopped before the next began."""
    checked = 0
    for event in lost:
        spans = attempts_in(base / "fx" / event.rollout_id)
        if event.marker not in spans:
            continue  # lost before its loop started
        others = [span for marker, span in spans.items() if marker != event.marker]
        assert len(others) == 1, spans
        assert spans[event.marker][1] < others[0][0], (event.rollout_id, spans)
        checked += 1
    assert checked, "no lost attempt had started its side-effect loop"


def test_importing_harnessd_or_its_rollouts_does_not_import_ray() -> None:
    code = (
        "import sys, harnessd, harnessd.rollouts, harnessd.agent, harnessd.launcher\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_retries_go_first_and_a_lost_attempt_never_runs_beside_its_retry(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Two of three actors killed while new work keeps coming: their rollouts go first.

    The survivor's three slots are all the pool has left, fewer than the six
    retries owed, so no new rollout may start before every retry has.
    """
    pool = RolloutPool(3, sessions_per_actor=3, launches_per_actor=1, retries=1)
    try:
        # Even placement by default: one actor on each node, where each says it is.
        assert sorted(pool.node_of(name) for name in pool.actors) == sorted(
            node.node_id for node in cluster_nodes(cluster)
        )
        assert all(pool.status(name).node == pool.node_of(name) for name in pool.actors)
        total, submitted_at, placed = 15, {}, collections.defaultdict(list)
        for n in range(9):
            placed[pool.submit(request(tmp_path, n, think=1.0)).actor].append(f"r{n}")
            submitted_at[f"r{n}"] = time.time()
        assert pool.free_slots == 0
        with pytest.raises(PoolFull):
            pool.submit(request(tmp_path, 99))
        victims, survivor = pool.actors[:2], pool.actors[2]
        deadline = time.monotonic() + 300
        # Kill once two rollouts of each victim run their side-effect loops.
        while (
            min(sum((tmp_path / "fx" / rid).exists() for rid in placed[name]) for name in victims)
            < 2
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for name in victims:
            ray.kill(pool.actor(name), no_restart=True)
        outcomes, next_n = [], 9
        for outcome in pool.results(timeout=400):
            outcomes.append(outcome)
            # The usual refill loop: new work whenever the pool says there is room.
            while next_n < total and pool.free_slots > 0:
                pool.submit(request(tmp_path, next_n, think=1.0))
                submitted_at[f"r{next_n}"] = time.time()
                next_n += 1
        survivor_status = pool.status(survivor)
        metrics = pool.metrics()
        # Supervisor shells exit a moment after their execd; a lease (60 s) is far longer.
        left = wait_until_none_mention(pool.tag, 15.0)
    finally:
        pool.shutdown()
    results = {o.rollout_id: o for o in outcomes}
    assert sorted(results) == sorted(f"r{n}" for n in range(total))
    for n in range(total):
        check_result(results[f"r{n}"], n)
    lost = {event.rollout_id: event for event in pool.lost}
    assert lost and all(event.actor in victims and event.attempt == 1 for event in pool.lost)
    retried = [check_result(results[rid], int(rid[1:])) for rid in lost]
    assert all(r.attempt == 2 and r.host == survivor and r.lost_on for r in retried)
    # Retries first: every rollout submitted after the kill started after all retries.
    loss_seen = min(event.noticed_at for event in pool.lost)
    late = [
        check_result(results[rid], int(rid[1:]))
        for rid, at in submitted_at.items()
        if at > loss_seen
    ]
    assert late, "new work kept coming after the loss"
    starts = sorted((r.started_at, r.rollout_id, r.attempt) for r in [*retried, *late])
    assert max(r.started_at for r in retried) < min(r.started_at for r in late), starts
    # Each lost attempt was killed by its marker and its directory removed before its retry.
    for event in pool.lost:
        assert event.reaped is not None and event.reaped.clean, event.reaped
        assert event.workspace == str(tmp_path / "ws" / f"rollout-{event.marker}")
        assert event.reaped.directory == event.workspace and event.retry_delay == 0.0
        assert event.node == pool.node_of(event.actor)  # reaped on the victim's own node
    looped = [e for e in pool.lost if e.marker in attempts_in(tmp_path / "fx" / e.rollout_id)]
    assert looped and all(e.reaped and e.reaped.killed >= 2 for e in looped)  # loop, execd
    assert_no_overlap(tmp_path, pool.lost)
    # Nothing outlived the rollouts: no process of the pool's, no workspace directory.
    assert left == [], left
    assert list((tmp_path / "ws").iterdir()) == []
    assert survivor_status.peak_launching == 1  # launches_per_actor
    assert (metrics.lost, metrics.retried, metrics.completed) == (len(lost), len(lost), total)
    assert (metrics.in_flight, metrics.queued, metrics.reaping, metrics.actors) == (0, 0, 0, 1)
    assert metrics.unreaped == 0 and metrics.tool_calls == 3 * total
    print(
        f"\n{len(lost)} lost with {len(victims)} actors; retry dispatched "
        f"{metrics.retry_wait[0]:.2f} s (p50) / {metrics.retry_wait[1]:.2f} s (max) after the loss; "
        f"tool calls p50 {metrics.tool_call_ms[0]:.1f} ms"
    )


def raylet_pids(cluster: Cluster) -> dict[str, int]:
    """Node id -> the pid of its raylet (what ``RAY_RAYLET_PID`` says in the node's workers)."""
    return {node.node_id: raylet_pid(node) for node in cluster_nodes(cluster)}


def test_a_workspace_on_another_node_than_its_harness(cluster: Cluster, tmp_path: Path) -> None:
    """execd runs under the workspace node's raylet; the harness connects to it over TCP.

    One of the two harness actors (both on the head node) is killed mid-run:
    its attempts' execds, on the other node, are reaped by the agent there.
    """
    head, remote = cluster_nodes(cluster)[0].node_id, cluster_nodes(cluster)[1].node_id
    raylets = raylet_pids(cluster)
    where = NodeWorkspace(node=remote, base_dir=str(tmp_path / "ws"), lease=LEASE)
    probe = ScriptedModelSpec(
        [
            {"tool_calls": [{"name": "shell", "arguments": {"command": "echo $RAY_RAYLET_PID"}}]},
            {"content": "probed"},
        ]
    )
    (tmp_path / "ws").mkdir()
    pool = RolloutPool(2, sessions_per_actor=3, nodes=[head])
    try:
        assert {pool.node_of(name) for name in pool.actors} == {head}
        probed = pool.run(
            [RolloutRequest(task="where am I", model=probe, runtime=where, rollout_id="probe")],
            timeout=300,
        )[0]
        assert isinstance(probed, RolloutResult), probed
        assert (probed.node, probed.workspace_node) == (head, remote)
        raylet = re.search(r"stdout:\n(\d+)", probed.transcript[3]["content"])
        assert raylet is not None, probed.transcript[3]
        assert raylet[1] == str(raylets[remote]) != str(raylets[head])
        handles = [pool.submit(request(tmp_path, n, think=1.2, runtime=where)) for n in range(6)]
        victim = pool.actors[0]
        wait_for_loops(tmp_path, [h.rollout_id for h in handles if h.actor == victim], 2)
        ray.kill(pool.actor(victim), no_restart=True)
        outcomes = list(pool.results(timeout=300))
        # Supervisor shells exit a moment after their execd; a lease (60 s) is far longer.
        left = wait_until_none_mention(pool.tag, 15.0)
    finally:
        pool.shutdown()
    assert sorted(o.rollout_id for o in outcomes) == sorted(h.rollout_id for h in handles)
    for outcome in outcomes:
        result = check_result(outcome, int(outcome.rollout_id[1:]))
        assert (result.node, result.workspace_node) == (head, remote)
    assert pool.lost and all(event.node == remote for event in pool.lost)
    assert all(event.reaped is not None and event.reaped.clean for event in pool.lost)
    assert sum(event.reaped.killed for event in pool.lost if event.reaped) >= 2
    assert_no_overlap(tmp_path, pool.lost)
    assert left == [], left
    assert list((tmp_path / "ws").iterdir()) == []


def test_a_node_removed_mid_run(cluster: Cluster, tmp_path: Path) -> None:
    """The node of an actor and of its workspaces goes away with them.

    Nothing can reach that machine (its agent is gone too), so each retry
    waits until the lost attempt's execd has run out its lease and cleaned
    up by itself; the attempt's directory stays there, named by the loss.
    """
    lease = 4.0
    doomed = cluster.add_node(**node_args(1))
    cluster.wait_for_nodes()
    head = cluster_nodes(cluster)[0].node_id
    pool = RolloutPool(2, sessions_per_actor=3, nodes=[doomed.node_id, head])
    try:
        victim = next(name for name in pool.actors if pool.node_of(name) == doomed.node_id)
        workspace = LocalWorkspace(base_dir=str(tmp_path / "ws"), lease=lease)
        handles = [
            pool.submit(request(tmp_path, n, think=1.2, runtime=workspace)) for n in range(6)
        ]
        wait_for_loops(tmp_path, [h.rollout_id for h in handles if h.actor == victim], 2)
        cluster.remove_node(doomed)
        outcomes = list(pool.results(timeout=300))
        metrics = pool.metrics()
    finally:
        pool.shutdown()
    for outcome in outcomes:
        check_result(outcome, int(outcome.rollout_id[1:]))
    lost = pool.lost
    assert lost and all(event.actor == victim and event.node == doomed.node_id for event in lost)
    for event in lost:
        assert event.reaped is None and event.retry_delay == lease + 2.0
        assert event.workspace == str(tmp_path / "ws" / f"rollout-{event.marker}")
        result = next(o for o in outcomes if o.rollout_id == event.rollout_id)
        assert isinstance(result, RolloutResult) and result.started_at >= event.noticed_at + lease
    assert (metrics.unreaped, metrics.lost, metrics.retried) == (len(lost), len(lost), len(lost))
    assert_no_overlap(tmp_path, lost)
    # The lease ended every process of the lost attempts; their directories are what is left.
    assert wait_until_none_mention(pool.tag, 15.0) == []
    left = sorted(path.name for path in (tmp_path / "ws").iterdir())
    started = sorted(
        name for event in lost if (tmp_path / "ws" / (name := f"rollout-{event.marker}")).exists()
    )
    assert left == started


class StuckModelSpec:
    """A model factory that blocks the event loop it is called on (a bug in an embedding)."""

    def __call__(self) -> Any:
        time.sleep(600)
        raise AssertionError("unreachable")


def test_a_hung_actor_is_detected_by_a_deadline(cluster: Cluster, tmp_path: Path) -> None:
    """One rollout blocks its actor's loop: past its deadline the actor is killed.

    That rollout ends timed out (hung); the other one on the same actor is
    lost and retried; a rollout that is merely slow is stopped by its own
    deadline where it runs.
    """
    head = cluster_nodes(cluster)[0].node_id
    pool = RolloutPool(2, sessions_per_actor=2, retries=1, nodes=[head], hang_grace=2.0)
    try:
        stuck = request(tmp_path, 0, deadline=4.0)
        stuck = RolloutRequest(
            task=stuck.task,
            model=StuckModelSpec(),
            runtime=stuck.runtime,
            rollout_id="r0",
            deadline=4.0,
        )
        placed = [
            pool.submit(stuck).actor,
            pool.submit(request(tmp_path, 1, think=1.0)).actor,
            pool.submit(request(tmp_path, 2, think=1.0, deadline=120.0)).actor,
            pool.submit(request(tmp_path, 3, think=30.0, deadline=4.0)).actor,
        ]
        # Each actor takes one of the first two, then one more: r2 beside r0, r3 beside r1.
        assert placed[0] == placed[2] != placed[1] == placed[3]
        outcomes = {o.rollout_id: o for o in pool.results(timeout=300)}
        metrics = pool.metrics()
    finally:
        pool.shutdown()
    hung, slowed = outcomes["r0"], outcomes["r3"]
    assert isinstance(hung, RolloutTimedOut) and hung.hung, hung
    assert isinstance(slowed, RolloutTimedOut) and not slowed.hung, slowed
    check_result(outcomes["r1"], 1)
    retried = check_result(outcomes["r2"], 2)
    assert (retried.attempt, retried.lost_on) == (2, (placed[0],))
    assert metrics.hung_actors == 1 and metrics.timed_out == 2
    by_rollout = {event.rollout_id: event for event in pool.lost}
    assert sorted(by_rollout) == ["r0", "r2"]
    assert all(event.reaped is not None and event.reaped.clean for event in pool.lost)
    assert by_rollout["r0"].reaped is not None and by_rollout["r0"].reaped.killed >= 1  # execd
    assert wait_until_none_mention(pool.tag, 15.0) == []
    assert list((tmp_path / "ws").iterdir()) == []


def test_backpressure_then_no_live_actor_then_lost_without_retries(
    cluster: Cluster, tmp_path: Path
) -> None:
    pool = RolloutPool(1, sessions_per_actor=2, retries=0)
    try:
        first = [pool.submit(request(tmp_path, n, think=30.0)) for n in range(2)]
        with pytest.raises(PoolFull) as full:
            pool.submit(request(tmp_path, 2))
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
        assert all(isinstance(o, RolloutLost) and o.reaped and o.reaped.clean for o in outcomes)
        with pytest.raises(NoLiveActor):
            pool.submit(request(tmp_path, 3))
        # Queued work with no actor left ends as lost too, instead of waiting forever.
        assert [type(o) for o in pool.run([request(tmp_path, 4)])] == [RolloutLost]
        assert wait_until_none_mention(pool.tag, 15.0) == []
        assert list((tmp_path / "ws").iterdir()) == []
    finally:
        pool.shutdown()


def test_a_rollout_that_cannot_launch_fails_typed_and_is_not_retried(
    cluster: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "ws").mkdir()
    bad = RolloutRequest(
        task="never runs",
        model=script(0, tmp_path / "unused", 0.0),
        runtime=LocalWorkspace(base_dir=str(tmp_path / "ws"), execd_command=("false",)),
        rollout_id="bad",
    )
    with RolloutPool(2, sessions_per_actor=2, retries=1) as pool:
        (outcome, good) = pool.run([bad, request(tmp_path, 1)], timeout=300)
        assert isinstance(outcome, RolloutFailed) and outcome.attempt == 1
        assert isinstance(outcome.cause, LaunchFailed)
        assert "exited with status 1" in str(outcome)
        check_result(good, 1)
        assert pool.lost == [] and pool.metrics().failed == 1
    assert list((tmp_path / "ws").iterdir()) == []


def test_a_hung_actor_is_detected_by_its_unanswered_pings(cluster: Cluster, tmp_path: Path) -> None:
    """No deadline at all: the actor whose loop is stuck stops answering pings and is killed."""
    head = cluster_nodes(cluster)[0].node_id
    stuck = RolloutRequest(
        task="hang",
        model=StuckModelSpec(),
        runtime=LocalWorkspace(base_dir=str(tmp_path), lease=LEASE),
        rollout_id="stuck",
    )
    with RolloutPool(1, sessions_per_actor=2, retries=0, nodes=[head], hang_timeout=3.0) as pool:
        (outcome,) = pool.run([stuck], timeout=300)
        assert isinstance(outcome, RolloutLost) and outcome.reaped is not None, outcome
        assert outcome.reaped.clean and outcome.reaped.killed >= 1  # execd, launched before
        assert pool.metrics().hung_actors == 1 and pool.actors == []
    assert wait_until_none_mention(pool.tag, 15.0) == []
    assert list(tmp_path.iterdir()) == []


def test_actors_go_into_a_placement_group_and_reserve_per_session(
    cluster: Cluster, tmp_path: Path
) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 0.5}, {"CPU": 0.5}], strategy="STRICT_SPREAD")
    held = f"CPU_group_{group.id.hex()}"  # what is left of the group's CPU
    try:
        ray.get(group.ready(), timeout=120)
        assert free_of(held, 1.0)
        with RolloutPool(
            2,
            sessions_per_actor=2,
            placement_group=group,
            resources_per_session={"CPU": 0.25},
        ) as pool:
            nodes = [pool.node_of(name) for name in pool.actors]
            assert len(set(nodes)) == 2  # one bundle each, on two nodes
            assert [pool.status(name).node for name in pool.actors] == nodes
            # Each actor holds all of its bundle's CPU: two sessions of 0.25.
            assert free_of(held, 0.0), ray.available_resources()
            outcomes = pool.run([request(tmp_path, n) for n in range(2)], timeout=300)
            for n, outcome in enumerate(outcomes):
                assert check_result(outcome, n).node in nodes
    finally:
        remove_placement_group(group)


def free_of(resource: str, amount: float) -> bool:
    """Whether Ray comes to report ``amount`` of ``resource`` available (reports lag a little)."""
    deadline = time.monotonic() + 60
    while ray.available_resources().get(resource, 0.0) != pytest.approx(amount):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
