"""Rollouts over Ray: two actors, each hosting many agent runs, one execd per rollout."""

import os

# Ray on loopback only: it takes 127.0.0.1 as this machine's address and listens there.
# (Read when Ray is imported; a cluster of many machines leaves it unset.)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray

from harnessd.ray import RolloutPool
from harnessd.rollouts import LocalWorkspace, RolloutRequest, ScriptedModelSpec

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

# A real run builds its model in the actor: OpenAIModelSpec(model, base_url, "API_KEY_VAR").
turns = [
    {"tool_calls": [{"name": "shell", "arguments": {"command": "echo $((6 * 7)) > answer"}}]},
    {"tool_calls": [{"name": "read_file", "arguments": {"path": "answer"}}]},
    {"content": "done"},
]
requests = [
    RolloutRequest(
        task=f"rollout {n}: compute the answer",
        model=ScriptedModelSpec(turns, think=0.1),
        runtime=LocalWorkspace(),  # execd in a fresh directory; its lease: gone 30 s after us
        deadline=120.0,  # the whole attempt: launch, run, close
    )
    for n in range(8)
]

# Actors spread evenly over the nodes; a lost rollout is reaped, then tried once more.
with RolloutPool(actors=2, sessions_per_actor=4, launches_per_actor=2, retries=1) as pool:
    for result in pool.run(requests):
        if isinstance(result, Exception):
            print(f"{result.rollout_id}: {result}")
            continue
        answer = result.transcript[-2]["content"].strip()
        print(
            f"{result.rollout_id} on {result.host}: {result.stop_reason}, answer {answer}, "
            f"{result.tool_calls} tool calls, ledger seq {result.ledger_seq}, "
            f"{result.timings.total:.2f} s"
        )
    metrics = pool.metrics()
    print(
        f"{metrics.completed} completed, {metrics.lost} lost, {metrics.retried} retried; "
        f"tool calls p50 {metrics.tool_call_ms[0]:.1f} ms over {metrics.tool_calls} calls"
    )
ray.shutdown()
