"""The tool registry: sets joined in order, names unique, per-toolbox state, close hooks."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import msgspec
import pytest

from harnessd.api import ExecdClient
from harnessd.models import ToolCall
from harnessd.toolbox import Args, CallContext, Toolbox, ToolSet, about
from harnessd.tools import CORE_TOOLS, TOOLS
from harnessd.tools_terminal import TERMINAL_TOOLS


def _no_client() -> ExecdClient:
    raise AssertionError("these tools never reach execd")


class EchoArgs(Args):
    """Say ``text`` back."""

    text: Annotated[str, msgspec.Meta(max_length=16), about("what to say")]


class Said(list[str]):
    """What one toolbox's echo tool was asked to say."""


def _echo_set(closed: list[str], label: str) -> ToolSet:
    tools = ToolSet()

    @tools.tool(f"echo_{label}", EchoArgs)
    async def echo(box: Toolbox, args: EchoArgs, context: CallContext) -> str:
        box.state(Said).append(args.text)
        return args.text

    @tools.closer
    async def close(box: Toolbox) -> None:
        closed.append(f"{label}: {','.join(box.state(Said))}")

    return tools


def _call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(id="c1", name=name, arguments=json.dumps(arguments))


def test_the_standard_set_is_the_core_tools_then_the_terminal_tools() -> None:
    assert list(TOOLS) == [*CORE_TOOLS, *TERMINAL_TOOLS]
    assert TOOLS.closers == [*CORE_TOOLS.closers, *TERMINAL_TOOLS.closers]
    assert len(CORE_TOOLS.closers) == len(TERMINAL_TOOLS.closers) == 1
    assert [spec.name for spec in TOOLS.specs] == list(TOOLS)


def test_a_name_declared_twice_is_refused() -> None:
    first = _echo_set([], "a")
    with pytest.raises(RuntimeError, match="'echo_a' is declared twice"):
        ToolSet(first, _echo_set([], "a"))

    async def again(box: Toolbox, args: EchoArgs, context: CallContext) -> str:
        return ""

    with pytest.raises(RuntimeError, match="declared twice"):
        first.tool("echo_a", EchoArgs)(again)


def test_toolboxes_keep_their_own_state_and_close_last_registered_first() -> None:
    closed: list[str] = []
    tools = ToolSet(_echo_set(closed, "a"), _echo_set(closed, "b"))
    one, two = Toolbox(_no_client, toolset=tools), Toolbox(_no_client, toolset=tools)

    async def main() -> None:
        assert (await one.call(_call("echo_a", text="x"))).text == "x"
        assert (await one.call(_call("echo_b", text="y"))).text == "y"
        assert (await two.call(_call("echo_a", text="z"))).text == "z"
        await one.close()
        await two.close()

    asyncio.run(main())
    assert one.state(Said) == ["x", "y"] and two.state(Said) == ["z"]
    assert closed == ["b: x,y", "a: x,y", "b: z", "a: z"]


def test_every_close_hook_runs_when_one_fails() -> None:
    closed: list[str] = []
    tools = ToolSet()

    @tools.closer
    async def first(box: Toolbox) -> None:
        closed.append("first")

    @tools.closer
    async def failing(box: Toolbox) -> None:
        raise OSError("cannot close")

    box = Toolbox(_no_client, toolset=tools)
    with pytest.raises(OSError, match="cannot close"):
        asyncio.run(box.close())
    assert closed == ["first"]


def test_a_toolbox_offers_and_answers_only_its_set() -> None:
    box = Toolbox(_no_client, toolset=_echo_set([], "a"))
    assert [spec.name for spec in box.specs] == ["echo_a"]
    unknown = asyncio.run(box.call(_call("shell", command="true")))
    assert not unknown.ok and unknown.error == "UnknownTool"
    assert "the tools are: echo_a" in unknown.text
    invalid = asyncio.run(box.call(_call("echo_a", text="x" * 17)))
    assert not invalid.ok and invalid.error == "InvalidArguments"
