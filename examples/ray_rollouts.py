"""Rollouts over Ray: two actors, each hosting many agent runs, one execd per rollout."""

import os

import ray

from harnessd.ray import RolloutPool
from harnessd.rollouts import LocalWorkspace, RolloutRequest, ScriptedModelSpec

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")

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
    )
    for n in range(8)
]

with RolloutPool(actors=2, sessions_per_actor=4, retries=1) as pool:
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
ray.shutdown()
