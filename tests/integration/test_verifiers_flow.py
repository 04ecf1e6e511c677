"""A whole verifiers rollout whose live (borrowed) runtime is an ExecdRuntime.

The task's ``setup`` writes files and starts a background checker service
through the runtime; the agent (a scripted model behind a local
OpenAI-compatible server, driving a tool loop in the workspace) writes an
answer the checker grades; scoring reads the checker's result file through
the runtime. Everything runs on loopback: verifiers' interception server
relays the workspace program's model calls to the fake model.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.chat_endpoint import ChatEndpoint
from tests.support.procs import wait_gone

pytest.importorskip(
    "verifiers.v1", reason="verifiers is not installed (pip install '.[verifiers]')"
)
import verifiers.v1 as vf

from harnessd.verifiers import ExecdConfig, ExecdRuntime
from tests.support import vf_loop

pytestmark = pytest.mark.timeout(120)

MODEL_KEY_VAR = "SPLITEXEC_FAKE_MODEL_API_KEY"
MODEL_KEY = "sk-fake-model-key-only-the-harness-holds"
HARNESS_ID = "splitexec-vf-loop"

CHECKER = b"""\
echo "checker up, pid $$"
echo $$ > task/checker.pid
touch task/ready
while [ ! -f task/answer.txt ]; do sleep 0.05; done
want=$(( $(cat task/input.txt) * 2 ))
if [ "$(cat task/answer.txt)" = "$want" ]; then echo "ok $want"; else echo "wrong"; fi > task/result.tmp
mv task/result.tmp task/result.txt
echo "checker graded $(cat task/answer.txt)"
exec sleep 300
"""

# What the scripted model does at each step, keyed by how many tool results it has seen.
SCRIPT = [
    "echo $(( $(cat task/input.txt) * 2 )) > task/answer.txt; env > task/agent-env.txt",
    "while [ ! -f task/result.txt ]; do sleep 0.05; done; cat task/result.txt",
]


class FakeModel(ChatEndpoint):
    """An OpenAI-compatible chat completions endpoint that follows SCRIPT."""

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        seen = [m for m in body["messages"] if m["role"] == "tool"]
        if len(seen) < len(SCRIPT):
            call = {
                "id": f"call-{len(seen)}",
                "type": "function",
                "function": {
                    "name": "bash",
                    "arguments": json.dumps({"command": SCRIPT[len(seen)]}),
                },
            }
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish = "tool_calls"
        else:
            message = {"role": "assistant", "content": f"checker said: {seen[-1]['content']}"}
            finish = "stop"
        return {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }


@pytest.fixture
def fake_model() -> Iterator[FakeModel]:
    server = FakeModel()
    yield server
    server.close()


# verifiers ships no type information: its Task is Any to mypy, and so are its decorators.
class CheckerTask(vf.Task):  # type: ignore[misc]
    """Setup writes the input and starts the checker; scoring reads what the checker wrote."""

    async def setup(self, trace: Any, runtime: Any) -> None:
        await runtime.write("task/input.txt", b"21\n")
        await runtime.write("task/checker.sh", CHECKER)
        await runtime.run_background(["sh", "task/checker.sh"], {}, "task/checker.log")
        async with asyncio.timeout(30):
            while (await runtime.run(["test", "-f", "task/ready"], {})).exit_code:
                await asyncio.sleep(0.05)

    async def finalize(self, trace: Any, runtime: Any) -> None:
        trace.info["checker_pid"] = int(await runtime.read("task/checker.pid", max_bytes=32))
        trace.info["agent_env"] = (await runtime.read("task/agent-env.txt")).decode()

    @vf.reward  # type: ignore[untyped-decorator]
    async def correct(self, runtime: Any) -> float:
        return 1.0 if await runtime.read("task/result.txt", max_bytes=64) == b"ok 42\n" else 0.0

    @vf.metric  # type: ignore[untyped-decorator]
    async def checker_lines(self, runtime: Any) -> float:
        return float(len((await runtime.read("task/checker.log", max_bytes=4096)).splitlines()))


def test_rollout_with_execd_as_the_borrowed_runtime(
    fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The model key lives in the harness's environment only.
    monkeypatch.setenv(MODEL_KEY_VAR, MODEL_KEY)
    # verifiers loads harness plugins by module name; make the test harness importable as one.
    monkeypatch.setitem(sys.modules, HARNESS_ID.replace("-", "_"), vf_loop)
    config = vf.AgentConfig(
        model="scripted-model",
        client=vf.EvalClientConfig(base_url=fake_model.base_url, api_key_var=MODEL_KEY_VAR),
        runtime=vf.SubprocessConfig(),
        harness={"id": HARNESS_ID, "python": sys.executable},
    )
    task = CheckerTask(vf.TaskData(prompt="Double the number in task/input.txt."))

    async def main() -> tuple[Any, ExecdRuntime]:
        runtime = ExecdRuntime(ExecdConfig())
        await runtime.start()
        try:
            return await vf.Agent(config).run(task, runtime=runtime), runtime
        finally:
            await runtime.stop()

    trace, runtime = asyncio.run(main())

    assert trace.ok, trace.errors
    assert trace.rewards["correct"].score == 1.0
    assert trace.metrics["checker_lines"] == 2.0
    assert trace.num_turns == 3
    assert trace.agent.runtime.type == "execd" and trace.agent.runtime.borrowed
    assert trace.agent.runtime.id == runtime.info.id
    # Three model calls relayed from the workspace program, each with the harness's key.
    assert fake_model.paths == ["/v1/chat/completions"] * 3
    assert fake_model.auth == [f"Bearer {MODEL_KEY}"] * 3
    assert fake_model.requests[-1]["messages"][-1]["content"] == "ok 42\n"
    # The agent's tools ran under execd (its marker is in their environment); the model key
    # never reached the workspace.
    env = trace.info["agent_env"]
    assert f"EXECD_MARKER={runtime.info.id}" in env
    assert MODEL_KEY not in env
    # The checker service was live through scoring and is gone since stop().
    assert wait_gone(trace.info["checker_pid"])
