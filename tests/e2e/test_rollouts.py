"""harnessd.rollouts without Ray: one rollout described as data, run to a result, cleaned up."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import pytest

from bench.agents import wait_for_no_process
from harnessd.errors import LaunchFailed
from harnessd.rollouts import (
    LocalWorkspace,
    OpenAIModelSpec,
    RolloutInfo,
    RolloutRequest,
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
