"""Output is bound to its call when the call is made: however late a reader starts, every byte arrives.

A command as short as ``echo`` can be over, its reply received, before the
caller gets round to reading its output; a reader made then must still get
everything the command wrote, or an error, never a silent nothing.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import cast

import pytest

import harnessd
from harnessd.api import ExecdClient, RunningCommand
from protocol.rpc import files
from protocol.rpc.shell import RunResult
from tests.conftest import eventually
from tests.support.cut_proxy import CutProxy
from tests.support.daemon import RunningExecd

pytestmark = pytest.mark.anyio

#: About 300 KiB on stdout and a line on stderr: more than fits one chunk.
SCRIPT = "seq 1 50000; echo oops >&2"
EXPECTED_STDOUT = "".join(f"{i}\n" for i in range(1, 50001)).encode()


async def _collect(command: RunningCommand[RunResult]) -> dict[str, bytes]:
    got = {"stdout": bytearray(), "stderr": bytearray()}

    async def read() -> None:
        async for name, data in command.output():
            got[name] += data

    await asyncio.wait_for(read(), 30)
    return {name: bytes(data) for name, data in got.items()}


async def test_output_read_after_the_command_was_answered_has_every_byte(
    client: ExecdClient,
) -> None:
    command = client.run_streaming(["sh", "-c", "echo x; echo y >&2"])
    # Wait for the answer itself: the streams ended before anyone read them.
    assert (await asyncio.wait_for(command.result(), 30)).exit_code == 0
    assert await _collect(command) == {"stdout": b"x\n", "stderr": b"y\n"}


async def test_output_iterated_after_random_delays_yields_every_byte(client: ExecdClient) -> None:
    rng = random.Random(32)
    for _ in range(40):
        command = client.run_streaming(command=SCRIPT)
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        got = await _collect(command)
        assert got == {"stdout": EXPECTED_STDOUT, "stderr": b"oops\n"}
        assert (await asyncio.wait_for(command.result(), 30)).exit_code == 0


async def test_a_stream_first_read_after_the_reply_has_every_byte(
    client: ExecdClient, tmp_path: Path
) -> None:
    content = bytes(range(256)) * 256  # 64 KiB: within the window, so execd answers unread
    source = tmp_path / "f"
    source.write_bytes(content)
    handle = client.start(files.READ, files.ReadParams(path=str(source), stream=True))
    result = await asyncio.wait_for(handle.result(), 30)
    assert result.bytes_sent == len(content)
    assert b"".join([block async for block in handle.stream(files.DATA_STREAM)]) == content


async def test_output_of_a_call_lost_with_its_connection_raises_however_late(
    execd: RunningExecd,
) -> None:
    proxy = await CutProxy(execd.host, execd.port).start()
    client = await harnessd.connect("127.0.0.1", proxy.port, execd.token)
    try:
        command = client.run_streaming(command="echo started; exec sleep 30")
        proxy.cut()
        await eventually(lambda: client.closed, what="the cut noticed")
        with pytest.raises(harnessd.ConnectionLost):
            await _collect(command)
        with pytest.raises(harnessd.ConnectionLost):
            await asyncio.wait_for(command.result(), 30)
    finally:
        await client.close()
        await proxy.close()


async def test_leaving_the_output_early_does_not_hang(client: ExecdClient) -> None:
    command = client.run_streaming(command="for i in $(seq 1 300); do echo $i; sleep 0.002; done")
    output = cast(AsyncGenerator[tuple[str, bytes], None], command.output())
    async for _ in output:
        break  # with hundreds of blocks still to come
    # They all come while nobody reads: the command ends.
    assert (await asyncio.wait_for(command.result(), 30)).exit_code == 0
    await asyncio.wait_for(output.aclose(), 10)
    assert await client.echo(b"still serving") == b"still serving"
