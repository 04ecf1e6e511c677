"""Calls that go on over a new connection deliver all of their output, and their cancels.

A real execd behind a :class:`~tests.support.cut_proxy.CutProxy`; a call is
cut where the test says and a new client adopts it. What the caller was
promised still arrives: a call cut before execd got it is sent again and its
whole output comes (several MB through ``run_streaming``, ``read_file`` and
``download``); a cancel asked after the cut, before or after the new
connection took the call on, reaches execd and kills the command; an upload
cut half-way says so with its own error, the target untouched.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import harnessd
from harnessd.api import ExecdClient, RunningCommand
from tests.conftest import eventually
from tests.support.cut_proxy import CutProxy
from tests.support.daemon import RunningExecd
from tests.support.procs import alive
from tests.support.proxied import Clients

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

MIB = 1024 * 1024
#: Bytes into the call's frame: execd never gets the call, so it is sent again.
INSIDE_THE_CALL = 12


def _source(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    payload = os.urandom(size)
    path = tmp_path / "source.bin"
    path.write_bytes(payload)
    return path, payload


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _collect(command: RunningCommand[Any]) -> tuple[bytes, bytes]:
    out, err = bytearray(), bytearray()
    async for name, data in command.output():
        (out if name == "stdout" else err).extend(data)
    return bytes(out), bytes(err)


async def _cat(command: RunningCommand[Any]) -> bytes:
    """The stdout of ``command``, which must write nothing on stderr and exit 0."""
    out, err = await _collect(command)
    assert (await command.result()).exit_code == 0
    assert err == b""
    return out


async def _download(client: ExecdClient, source: Path, copy: Path) -> bytes:
    """``download`` ``source`` to ``copy``; what it wrote there."""
    size = await client.download(str(source), str(copy))
    data = copy.read_bytes()
    assert size == len(data)
    return data


@pytest.mark.execd_args("--request-grace", "20")
@pytest.mark.parametrize(
    "how", ["run_streaming", "run_streaming-read-after-the-resend", "read_file", "download"]
)
async def test_a_call_sent_again_after_a_cut_delivers_its_whole_output(
    clients: Clients, proxy: CutProxy, tmp_path: Path, how: str
) -> None:
    source, payload = _source(tmp_path, 6 * MIB)
    client = await clients.connect()
    proxy.cut_after("up", INSIDE_THE_CALL)
    read: Callable[[], Awaitable[bytes]]
    if how.startswith("run_streaming"):
        command = client.run_streaming(["cat", str(source)])
        read = functools.partial(_cat, command)
    elif how == "read_file":
        read = functools.partial(client.read_file, str(source))
    else:
        read = functools.partial(_download, client, source, tmp_path / "copy.bin")
    late = how.endswith("after-the-resend")
    reading = None if late else asyncio.ensure_future(read())
    await clients.reconnect(client)
    data = await asyncio.wait_for(reading or read(), 60)
    assert (len(data), _digest(data)) == (len(payload), _digest(payload))
    assert proxy.cuts == 1


def _start(
    client: ExecdClient, script: str, how: str
) -> tuple[Callable[[], Any], asyncio.Future[Any]]:
    """Start ``script`` as ``how`` says; return how to cancel it and what ends with it."""
    if how == "task-cancel":
        task = asyncio.ensure_future(client.run(command=script))
        return task.cancel, task
    command = client.run_streaming(command=script)
    return command.cancel, asyncio.ensure_future(command.result())


@pytest.mark.execd_args("--request-grace", "20")
@pytest.mark.parametrize("how", ["task-cancel", "running-command-cancel"])
@pytest.mark.parametrize("when", ["after-the-reattach", "before-the-reattach"])
async def test_a_cancel_after_the_cut_reaches_execd_and_kills_the_command(
    clients: Clients, proxy: CutProxy, tmp_path: Path, how: str, when: str
) -> None:
    pidfile = tmp_path / "pid"
    script = f"echo $$ > {pidfile}.new && mv {pidfile}.new {pidfile}; exec sleep 60"
    client = await clients.connect()
    cancel, outcome = _start(client, script, how)
    pid = int(await eventually(lambda: pidfile.exists() and pidfile.read_text(), what="started"))
    assert proxy.cut() == 1
    await eventually(lambda: client.closed, what="the cut noticed")
    if when == "before-the-reattach":
        cancel()
        await clients.reconnect(client)
    else:
        await clients.reconnect(client)
        cancel()  # right behind the attach: execd has bound the call to it on receipt
    # Killed well before the grace (20 s) would have ended it, and long before its 60 s.
    await eventually(lambda: not alive(pid), timeout=10, what="the command killed")
    with pytest.raises((asyncio.CancelledError, harnessd.Cancelled)):
        await asyncio.wait_for(outcome, 10)


@pytest.mark.execd_args("--request-grace", "20")
@pytest.mark.parametrize("reattach", [True, False], ids=["reattach", "no-reattach"])
async def test_an_upload_cut_half_way_raises_upload_cut_and_leaves_the_target(
    execd: RunningExecd, clients: Clients, proxy: CutProxy, tmp_path: Path, reattach: bool
) -> None:
    local, payload = _source(tmp_path, 32 * MIB)
    target = tmp_path / "target.bin"
    target.write_bytes(b"before")
    if reattach:
        client = await clients.connect()
    else:
        client = await harnessd.connect("127.0.0.1", proxy.port, execd.token)
        clients.opened.append(client)
    proxy.cut_after("up", 8 * MIB)
    with pytest.raises(harnessd.UploadCut) as caught:
        await asyncio.wait_for(client.upload(str(local), str(target)), 60)
    assert caught.value.untouched and caught.value.path == str(target)
    assert "untouched" in str(caught.value)
    assert len(payload) > 8 * MIB
    # execd's side of the write fails with the stream: no temporary file is left either.
    await eventually(
        lambda: (
            sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("target"))
            == ["target.bin"]
        ),
        what="the temporary file removed",
    )
    assert target.read_bytes() == b"before"


@pytest.mark.execd_args("--request-grace", "20")
async def test_a_signal_after_the_cut_reaches_the_reattached_command(
    clients: Clients, proxy: CutProxy, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    client = await clients.connect()
    command = client.run_streaming(
        command=f"echo $$ > {pidfile}.new && mv {pidfile}.new {pidfile}; exec sleep 60"
    )
    pid = int(await eventually(lambda: pidfile.exists() and pidfile.read_text(), what="started"))
    proxy.cut()
    fresh = await clients.reconnect(client)
    # Its call id named a call of the lost connection: on the new one it would name another.
    with pytest.raises(harnessd.NotSent):
        await asyncio.wait_for(client.signal_command(signal.SIGTERM, call_id=command.call_id), 10)
    assert alive(pid)
    # The command itself is named by its request id: the signal reaches it through ``fresh``.
    sent = await asyncio.wait_for(command.signal(signal.SIGTERM), 10)
    assert sent.pid == pid
    result = await asyncio.wait_for(command.result(), 10)
    assert result.signal == signal.SIGTERM and result.exit_code is None
    assert not alive(pid)
    assert await fresh.echo(b"x") == b"x"
