"""An agent session that offers the model a tool of your own beside the standard ones.

A tool is an argument Struct (its docstring and fields are what the model
reads) and a handler registered on a ToolSet; ToolSet(TOOLS, mine) offers
both. A scripted model stands in for a real one here.
"""

import asyncio
import tempfile
from typing import Annotated

import msgspec

import harnessd
from harnessd.agent import AgentSession
from harnessd.scripted_model import ScriptedModel
from harnessd.toolbox import Args, CallContext, PathArg, Toolbox, ToolConfig, ToolSet, about
from harnessd.tools import TOOLS

MY_TOOLS = ToolSet()


class CountLinesArgs(Args):
    """Count the lines of a text file in the workspace that contain a word."""

    path: PathArg
    word: Annotated[str, msgspec.Meta(min_length=1, max_length=100), about("the word to find")]


@MY_TOOLS.tool("count_lines", CountLinesArgs)
async def count_lines(box: Toolbox, args: CountLinesArgs, context: CallContext) -> str:
    path = box.path(args.path)  # relative paths are under the workspace root
    text = (await box.client().read_file(path)).decode("utf-8", "replace")
    found = sum(args.word in line for line in text.splitlines())
    return f"{found} lines of {path} contain {args.word!r}"


MODEL = ScriptedModel(
    [
        {
            "tool_calls": [
                {
                    "name": "write_file",
                    "arguments": {"path": "notes.txt", "content": "red fox\nblue fox\nowl\n"},
                }
            ]
        },
        {
            "tool_calls": [
                {"name": "count_lines", "arguments": {"path": "notes.txt", "word": "fox"}}
            ]
        },
        {"content": "Two lines mention a fox."},
    ]
)


async def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        async with harnessd.serve() as session:
            agent = AgentSession(
                MODEL,
                lambda: session.client,
                tools=ToolConfig(root=root),
                toolset=ToolSet(TOOLS, MY_TOOLS),
            )
            assert "count_lines" in [spec.name for spec in agent.toolbox.specs]
            result = await agent.run("How many lines of notes.txt mention a fox?")
    for turn in result.turns:
        for call in turn.results:
            print(f"{call.name}: {call.text}")
    print(f"answer: {result.final_text}")


asyncio.run(main())
