"""The agent's terminal tools and the shell and session tools' limit verdicts, through a Toolbox on a real execd."""

from __future__ import annotations

import json

import pytest

from harnessd.api import ExecdClient
from harnessd.models import ToolCall
from harnessd.toolbox import Toolbox, ToolConfig
from harnessd.tools import TOOLS
from harnessd.tools_terminal import open_terminals, screen_text
from protocol.rpc.resources import Limits
from tests.conftest import one_loop

pytestmark = [pytest.mark.anyio, one_loop]


def _call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(id=f"call_{name}", name=name, arguments=json.dumps(arguments))


async def test_a_model_drives_a_python_repl(client: ExecdClient) -> None:
    box = Toolbox(lambda: client, toolset=TOOLS)
    started = await box.call(_call("terminal_start", command="python3 -i -q", wait=5))
    assert started.ok, started.text
    name = started.text.split()[1]
    if ">>>" not in started.text:
        await box.call(_call("terminal_read", terminal=name, wait=5))
    answer = await box.call(
        _call("terminal_send", terminal=name, text="6 * 7", keys=["enter"], wait=5)
    )
    assert answer.ok and "42" in answer.text, answer.text
    text = (await box.call(_call("terminal_send", terminal=name, keys=["ctrl-d"], wait=10))).text
    for _ in range(10):
        # A read returns once output pauses; the exit may come with a later one.
        if "ended:" in text:
            break
        text += (await box.call(_call("terminal_read", terminal=name, wait=5))).text
    assert f"[terminal {name} ended: exit code 0]" in text
    missing = await box.call(_call("terminal_read", terminal=name))
    assert not missing.ok and "no open terminal" in missing.text
    await box.close()


async def test_stop_hangs_up_and_close_cleans_up(client: ExecdClient) -> None:
    box = Toolbox(lambda: client, toolset=TOOLS)
    first = await box.call(_call("terminal_start", command="sleep 300", wait=0))
    name = first.text.split()[1]
    stopped = await box.call(_call("terminal_stop", terminal=name))
    assert stopped.text == f"terminal {name} stopped: killed by signal 1"
    await box.call(_call("terminal_start", command="sleep 300", wait=0))
    assert len(open_terminals(box)) == 1
    await box.close()
    assert open_terminals(box) == {}


async def test_the_shell_tool_says_which_limit_stopped_the_command(client: ExecdClient) -> None:
    box = Toolbox(lambda: client, ToolConfig(limits=Limits(cpu=1)), toolset=TOOLS)
    result = await box.call(_call("shell", command="while :; do :; done"))
    assert "stopped by its cpu limit" in result.text


async def test_the_session_tool_says_which_limit_stopped_the_command(
    client: ExecdClient, tmp_path: object
) -> None:
    box = Toolbox(lambda: client, ToolConfig(limits=Limits(file_size=1 << 20)), toolset=TOOLS)
    big = f"{tmp_path}/big"
    result = await box.call(
        _call("session_run", session="s", command=f"dd if=/dev/zero of={big} bs=1M count=4")
    )
    assert "exit code 153; stopped by its file_size limit" in result.text, result.text
    after = await box.call(_call("session_run", session="s", command="echo fine"))
    assert "limit" not in after.text, after.text
    await box.close()


def test_screen_text_removes_escapes_and_carriage_returns() -> None:
    raw = b"\x1b[1;32mgreen\x1b[0m\r\n\x1b]0;title\x07>>> \x1b[K"
    assert screen_text(raw) == "green\n>>> "
