import asyncio
from collections.abc import Sequence

import harnessd
from harnessd.agent import AgentSession
from harnessd.models import AssistantTurn, ChatMessage, ToolCall, ToolSpec


class MyModel:
    """Your model goes here: the history and the tools on offer in, the next turn out."""

    name = "my-model"

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        if messages[-1].role == "user":  # the task: ask for a tool call
            call = ToolCall(id="call-1", name="shell", arguments='{"command": "uname -s"}')
            return AssistantTurn(tool_calls=[call])
        # The tool's result came back ("exit code 0\nstdout:\nLinux"): answer, calling nothing.
        kernel = (messages[-1].content or "").split()[-1]
        return AssistantTurn(content=f"The workspace runs {kernel}.")


async def main() -> None:
    async with harnessd.serve() as handle:  # execd on this machine; any Runtime for elsewhere
        agent = AgentSession(MyModel(), lambda: handle.client, reconnect=handle.reconnect)
        result = await agent.run("Which kernel does the workspace run?")
        print(f"{result.stop_reason}: {result.final_text} ({result.tool_calls} tool call)")


asyncio.run(main())
