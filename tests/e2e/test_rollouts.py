"""harnessd.rollouts without Ray: one rollout described as data, run to a result, cleaned up."""

from __future__ import annotations

import asyncio
import os
import pickle
import secrets
from pathlib import Path
from typing import Any

import pytest

from bench.agents import processes_mentioning, wait_for_no_process
from harnessd.errors import LaunchFailed
from harnessd.rollouts import (
    LocalWorkspace,
    OpenAIModelSpec,
    Reaped,
    RolloutFailed,
    RolloutInfo,
    RolloutLost,
    RolloutRequest,
    RolloutTimedOut,
    ScriptedModelSpec,
    Workspace,
    run_rollout,
)
from harnessd.scripted_model import PacedModel, ScriptedModel

pytestmark = pytest.mark.timeout(120)

TURNS: list[dict[str, Any]] = [
    {
        "tool_calls": [
            {"name": "shell", "arguments": {"command": "pwd; sleep 600 >/dev/null 2>&1 &"}},
            {"name": "write_file", "arguments": {"path": "a.txt", "content": "alpha"}},
        ]
    },
    {"tool_calls": [{"name": "read_file", "arguments": {"path": "a.txt"}}]},
    {"content": "all done"},
]


def test_a_rollout_runs_in_a_fresh_workspace_and_leaves_nothing(tmp_path: Path) -> None:
    made: list[Workspace] = []
    local = LocalWorkspace(base_dir=str(tmp_path), lease=5.0)

    def factory(info: RolloutInfo) -> Workspace:
        workspace = local(info)
        made.append(workspace)
        return workspace

    request = RolloutRequest(task="do it", model=ScriptedModelSpec(TURNS), runtime=factory)
    info = RolloutInfo(rollout_id=request.rollout_id, attempt=1, marker="rollout-test-1")
    launched: list[bool] = []
    result = asyncio.run(
        run_rollout(request, info, host="here", on_launched=lambda: launched.append(True))
    )
    assert launched == [True]
    assert (result.rollout_id, result.attempt, result.host) == (request.rollout_id, 1, "here")
    assert (result.stop_reason, result.final_text, result.tool_errors) == (
        "finished",
        "all done",
        0,
    )
    (workspace,) = made
    assert workspace.root is not None
    pwd = result.transcript[3]["content"]
    assert workspace.root in pwd  # the tools ran in the workspace the factory made
    assert result.transcript[-2]["content"] == "alpha"
    events = [record["event"] for record in result.trace]
    assert events[0] == "session_start" and events[-1] == "session_end"
    assert events.count("tool_call") == result.tool_calls == 3
    assert result.ledger_seq > len(result.transcript) and len(result.ledger_hash) == 64
    assert result.clean and result.killed == 1
    assert result.timings.total >= result.timings.launch + result.timings.run
    assert list(tmp_path.iterdir()) == []  # the factory's cleanup removed its directory
    # execd exited before close() returned; its supervisor shell follows within moments.
    assert asyncio.run(wait_for_no_process(info.marker, 15.0)) == []
    # Results are plain data: they cross process boundaries as they are.
    assert pickle.loads(pickle.dumps(result)) == result  # noqa: S301 - our own bytes


def test_requests_and_factories_pickle() -> None:
    request = RolloutRequest(
        task="t",
        model=OpenAIModelSpec("m", "http://127.0.0.1:9/v1", None),
        runtime=LocalWorkspace(lease=1.0),
    )
    again = pickle.loads(pickle.dumps(request))  # noqa: S301 - our own bytes
    assert again == request
    assert again.model().name == "m"
    paced = ScriptedModelSpec(TURNS, think=0.5)()
    assert isinstance(paced, PacedModel) and paced.seconds == 0.5
    assert isinstance(ScriptedModelSpec(TURNS)(), ScriptedModel)


def test_a_launch_failure_raises_and_still_cleans_the_workspace(tmp_path: Path) -> None:
    request = RolloutRequest(
        task="t",
        model=ScriptedModelSpec(TURNS),
        runtime=LocalWorkspace(base_dir=str(tmp_path), execd_command=("false",)),
    )
    info = RolloutInfo(rollout_id=request.rollout_id, attempt=1, marker="rollout-test-2")
    with pytest.raises(LaunchFailed):
        asyncio.run(run_rollout(request, info))
    assert list(tmp_path.iterdir()) == []


def test_an_abandoned_attempt_is_reaped_by_its_marker_execd_included(tmp_path: Path) -> None:
    """What a pool does for an attempt whose harness died: kill all of it, remove its directory."""
    local = LocalWorkspace(base_dir=str(tmp_path), lease=60.0)
    info = RolloutInfo(rollout_id="r", attempt=1, marker=f"reap-{secrets.token_hex(6)}")

    async def abandon() -> str:
        workspace = local(info)
        session = await workspace.launch
        assert workspace.root is not None
        await session.client.run(command="sleep 600 >/dev/null 2>&1 &", cwd=workspace.root)
        # The harness goes away without closing: execd and the sleep live on (lease 60 s).
        await session.client.close()
        return workspace.root

    root = asyncio.run(abandon())
    assert local.directory(info) == str(tmp_path / f"rollout-{info.marker}") and os.path.isdir(root)
    before = processes_mentioning(info.marker)
    assert any("execd" in line for line in before), before
    reaped = local.reap(info)
    # The supervisor shell, execd and the sleep carried the marker; none is left.
    assert reaped.killed >= 3 and reaped.clean, reaped
    assert (reaped.directory, reaped.removed) == (str(tmp_path / f"rollout-{info.marker}"), True)
    assert asyncio.run(wait_for_no_process(info.marker, 15.0)) == []
    assert list(tmp_path.iterdir()) == []
    # Reaping again (a retry of the reap) finds nothing and does no harm.
    assert local.reap(info) == Reaped(0, (), str(tmp_path / f"rollout-{info.marker}"), False)


def test_a_deadline_stops_the_attempt_and_still_cleans_up(tmp_path: Path) -> None:
    slow = ScriptedModelSpec(TURNS, think=30.0)
    request = RolloutRequest(
        task="t",
        model=slow,
        runtime=LocalWorkspace(base_dir=str(tmp_path), lease=30.0),
        deadline=3.0,
    )
    info = RolloutInfo(
        rollout_id=request.rollout_id, attempt=1, marker=f"late-{secrets.token_hex(6)}"
    )
    with pytest.raises(RolloutTimedOut) as timed_out:
        asyncio.run(run_rollout(request, info))
    assert (timed_out.value.rollout_id, timed_out.value.attempt, timed_out.value.hung) == (
        request.rollout_id,
        1,
        False,
    )
    assert "deadline of 3 s" in str(timed_out.value)
    assert list(tmp_path.iterdir()) == []
    assert asyncio.run(wait_for_no_process(info.marker, 15.0)) == []


def test_outcomes_pickle_with_their_fields() -> None:
    reaped = Reaped(3, (), "/tmp/x", True)
    lost = RolloutLost(
        "lost",
        "r1",
        2,
        "a0",
        marker="m-1",
        node="n1",
        workspace="/tmp/x",
        reaped=reaped,
        retry_delay=1.5,
        noticed_at=12.0,
    )
    again = pickle.loads(pickle.dumps(lost))  # noqa: S301 - our own bytes
    assert type(again) is RolloutLost and str(again) == "lost"
    assert vars(again) == vars(lost)
    failed = RolloutFailed("failed", "r2", 1, LaunchFailed("no execd"))
    back = pickle.loads(pickle.dumps(failed))  # noqa: S301 - our own bytes
    assert (back.rollout_id, back.attempt, str(back.cause)) == ("r2", 1, "no execd")
    hung = pickle.loads(pickle.dumps(RolloutTimedOut("late", "r3", 1, hung=True)))  # noqa: S301
    assert (hung.rollout_id, hung.hung) == ("r3", True)
