"""A Model of your own driving the agent loop: a text-in, text-out policy behind the shell tool.

Many models have no native tool calling: they read a transcript and answer
with one line, ``RUN: <command>`` or ``DONE: <answer>``. A Model is the
adapter: it turns the loop's chat history into that transcript and the reply
into a tool call or a final answer. ``policy`` stands in for such a model.
"""

import asyncio
import json
import re
from collections.abc import Sequence

import harnessd
from harnessd.agent import AgentLimits, AgentSession
from harnessd.models import AssistantTurn, ChatMessage, ModelError, ToolCall, ToolSpec
from harnessd.toolbox import ToolConfig


async def policy(transcript: str) -> str:
    """The model itself: a transcript in, one line out (here, two rules)."""
    observations = re.findall(r"^OBSERVATION: exit code 0\nstdout:\n(\d+)", transcript, re.M)
    if not observations:
        return "RUN: printf 'alpha\\nbeta\\ngamma\\n' > words.txt && wc -l < words.txt"
    return f"DONE: words.txt has {observations[-1]} lines"


class TextPolicyModel:
    """Adapts a text policy to harnessd's Model interface."""

    name = "text-policy"  # how traces and the ledger name this model

    def __init__(self) -> None:
        self.calls = 0

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if "shell" not in {tool.name for tool in tools}:
            raise ModelError("this model needs the shell tool")
        reply = await policy(transcript(messages))
        action, _, text = reply.partition(": ")
        if action == "DONE":
            return AssistantTurn(content=text)  # no tool call: the run is finished
        if action != "RUN":
            raise ModelError(f"the policy answered neither RUN nor DONE: {reply!r}")
        self.calls += 1
        call = ToolCall(
            id=f"call-{self.calls}", name="shell", arguments=json.dumps({"command": text})
        )
        return AssistantTurn(tool_calls=[call])


def transcript(messages: Sequence[ChatMessage]) -> str:
    """The chat history as the policy reads it; tool results are observations."""
    lines = []
    for message in messages:
        if message.role == "tool":
            lines.append(f"OBSERVATION: {message.content}")
        for call in message.tool_calls or []:
            lines.append(f"ACTION: {json.loads(call.arguments)['command']}")
        if message.role != "tool" and message.content:
            lines.append(f"{message.role.upper()}: {message.content}")
    return "\n".join(lines)


async def main() -> None:
    async with harnessd.serve() as handle:
        workspace = (await handle.client.run(["mktemp", "-d"])).stdout.decode().strip()
        agent = AgentSession(
            TextPolicyModel(),
            lambda: handle.client,  # the current client, also after a reconnect
            reconnect=handle.reconnect,
            tools=ToolConfig(root=workspace),  # relative paths and commands start here
            limits=AgentLimits(max_turns=5, session_timeout=60.0),
        )
        result = await agent.run("How many lines does words.txt have once you write it?")
        print(f"{result.stop_reason} after {len(result.turns)} turns: {result.final_text}")
        print(f"ledger: {result.synced_seq} of {result.ledger_seq} entries synced to execd")
        await handle.client.remove(workspace, recursive=True)


asyncio.run(main())
