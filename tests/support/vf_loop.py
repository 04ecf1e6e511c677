"""A verifiers harness plugin for tests: a tool-calling agent loop that runs in the workspace.

verifiers' own harnesses install their program with uv and PEP 723
dependencies fetched from a package index at setup; this one is a
standard-library Python program written into the workspace, so a rollout
needs nothing but the runtime. Like every harness it talks to the model only
through the rollout's interception endpoint, with the rollout's secret.
"""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf

__all__ = ["WorkspaceLoopConfig", "WorkspaceLoopHarness"]

PROGRAM_PATH = ".harness/loop.py"

PROGRAM = r"""
import json, os, subprocess, sys, urllib.request

endpoint, model, prompt = sys.argv[1:4]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
tools = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the workspace.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]
messages = [{"role": "user", "content": prompt}]
for _ in range(int(os.environ.get("LOOP_MAX_TURNS", "8"))):
    body = json.dumps({"model": model, "messages": messages, "tools": tools}).encode()
    request = urllib.request.Request(
        endpoint + "/chat/completions", data=body,
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    with opener.open(request, timeout=60) as reply:
        message = json.load(reply)["choices"][0]["message"]
    messages.append(message)
    calls = message.get("tool_calls") or []
    if not calls:
        print(message.get("content") or "")
        break
    for call in calls:
        command = json.loads(call["function"]["arguments"])["command"]
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": done.stdout + done.stderr})
"""


class WorkspaceLoopConfig(vf.HarnessConfig):  # type: ignore[misc]
    python: str = "python3"
    """The interpreter that runs the loop in the workspace."""


class WorkspaceLoopHarness(vf.Harness[WorkspaceLoopConfig]):  # type: ignore[misc]
    NEEDS_CONTAINER = False
    EXECUTES_CODE = True

    async def setup(self, runtime: Any) -> None:
        await runtime.write(PROGRAM_PATH, PROGRAM.encode())

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: str | None = None,
    ) -> Any:
        _, prompt = self.resolve_text_prompt(data)
        argv = [self.config.python, PROGRAM_PATH, endpoint, ctx.model, prompt or ""]
        return await runtime.run_program(argv, {"OPENAI_API_KEY": secret})
