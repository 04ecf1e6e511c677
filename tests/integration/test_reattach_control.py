"""A call taken on by another connection obeys that connection: its cancels, its signals.

Frame-level peers (:class:`~tests.integration.test_adversarial.RawPeer`)
against a real execd, so that the test decides what arrives together: a
tracked ``shell.run`` is started on one connection, which then closes (the
command runs on unbound, for its grace); a second connection takes it on.
A Cancel in the same read as the attach (or as a copy of the call, or as
an attach that supersedes a connection still open) kills the command,
however early it comes; so does one that comes while the attach is still
replaying kept output, and an attach lost while replaying leaves the
command its grace again. ``shell.signal`` names the command by its request
id from any connection. Each command would outlive the test's patience
(sleep 60) and the grace (20 s) unless what the test sent reaches it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import msgspec
import pytest

from protocol import limits
from protocol.codec import to_raw
from protocol.errors import ErrorCode
from protocol.messages import Call, Cancel, Chunk, Error, Reply
from protocol.rpc import request as request_rpc
from protocol.rpc import shell as shell_rpc
from tests.conftest import eventually
from tests.integration.test_adversarial import RawPeer, authenticated
from tests.support.daemon import RunningExecd
from tests.support.procs import alive

pytestmark = [pytest.mark.anyio, pytest.mark.one_loop, pytest.mark.timeout(120)]

#: Bytes the command writes before it sleeps: more than one window of the attaching peer.
OUTPUT = 6_000_000


def _script(pidfile: Path, output: int = 0) -> str:
    """Write ``output`` bytes, then the shell's pid to ``pidfile`` (atomically), then sleep 60."""
    write = f"head -c {output} /dev/zero; " if output else ""
    return f"{write}echo $$ > {pidfile}.new && mv {pidfile}.new {pidfile}; exec sleep 60"


def _send(peer: RawPeer, method: str, params: Any, rid: bytes | None = None) -> tuple[int, bytes]:
    """The frame of a call (not sent yet), and its call id."""
    call_id = peer.conn.next_call_id()
    frame = bytes(peer.conn.send(Call(id=call_id, method=method, params=to_raw(params), rid=rid)))
    return call_id, frame


def _start(execd: RunningExecd, command: str, *, stream: bool = False) -> tuple[RawPeer, bytes]:
    """Run ``command`` under a fresh request id; the connection it runs on, and the id."""
    rid = os.urandom(limits.REQUEST_ID_SIZE)
    peer = authenticated(execd)
    try:
        params = {"command": command, "stream": stream}
        _, frame = _send(peer, shell_rpc.RUN.name, params, rid)
        peer.send(frame)
        if stream:
            # Its output fills this connection's window (never granted back).
            _receive_output(peer, limits.DEFAULT_STREAM_WINDOW)
    except BaseException:
        peer.close()
        raise
    return peer, rid


def _start_and_leave(execd: RunningExecd, command: str, *, stream: bool = False) -> bytes:
    """Run ``command`` under a fresh request id on a connection that then closes; the id."""
    peer, rid = _start(execd, command, stream=stream)
    peer.close()
    return rid


def _receive_output(peer: RawPeer, at_least: int) -> int:
    """Read until ``at_least`` bytes of output came, granting no credit; how many came."""
    got = 0
    while got < at_least and not peer.eof:
        got += sum(len(e.data) for e in peer.receive() if isinstance(e, Chunk))
    return got


async def _started(pidfile: Path) -> int:
    return int(await eventually(lambda: pidfile.exists() and pidfile.read_text(), what="started"))


async def _killed(pid: int) -> None:
    # Within 10 s: long before its 60 s, and before a grace of 20 s would have ended it.
    await eventually(lambda: not alive(pid), timeout=10, what="the command killed")


def _cancelled(answer: Reply | Error) -> bool:
    return isinstance(answer, Error) and answer.code == ErrorCode.CANCELLED


@pytest.mark.execd_args("--request-grace", "20")
@pytest.mark.parametrize("how", ["attach", "copy-of-the-call", "attach-superseding"])
async def test_a_cancel_in_the_same_read_as_the_attach_kills_the_command(
    execd: RunningExecd, tmp_path: Path, how: str
) -> None:
    pidfile = tmp_path / "pid"
    command = _script(pidfile)
    # Superseding: the first connection stays open, and the attach closes it.
    first, rid = await asyncio.to_thread(_start, execd, command)
    if how != "attach-superseding":
        first.close()
    pid = await _started(pidfile)

    def take_on_and_cancel() -> Reply | Error:
        peer = authenticated(execd)
        try:
            if how == "attach":
                call_id, frame = _send(peer, request_rpc.ATTACH.name, {"rid": rid})
            else:
                call_id, frame = _send(peer, shell_rpc.RUN.name, {"command": command}, rid)
            # One write, so one read at execd: the Cancel comes before any task could start.
            peer.send(frame + bytes(peer.conn.send(Cancel(id=call_id))))
            return peer.wait_answer(call_id)
        finally:
            peer.close()

    try:
        answer = await asyncio.to_thread(take_on_and_cancel)
        if how == "attach-superseding":
            assert await asyncio.to_thread(first.expect_abort) == ErrorCode.GOING_AWAY
    finally:
        first.close()
    assert _cancelled(answer), answer
    await _killed(pid)


@pytest.mark.parametrize(
    "how",
    [
        # The grace (20 s) would not kill it in time: the cancel must.
        pytest.param("cancel", marks=pytest.mark.execd_args("--request-grace", "20")),
        # Nobody attaches again: the grace (1 s) starts over, runs out, and kills it.
        pytest.param("connection-lost", marks=pytest.mark.execd_args("--request-grace", "1")),
    ],
)
async def test_an_attach_that_ends_while_it_replays_kept_output_leaves_no_command_unattended(
    execd: RunningExecd, tmp_path: Path, how: str
) -> None:
    pidfile = tmp_path / "pid"
    rid = await asyncio.to_thread(_start_and_leave, execd, _script(pidfile, OUTPUT), stream=True)
    # The pid is written once all the output is: all of it is kept, unbound.
    pid = await _started(pidfile)

    def attach_and_end() -> Reply | Error | None:
        peer = authenticated(execd)
        try:
            call_id, frame = _send(peer, request_rpc.ATTACH.name, {"rid": rid})
            peer.send(frame)
            # A window's worth replayed and no credit granted back: the replay waits.
            assert _receive_output(peer, limits.DEFAULT_STREAM_WINDOW) < OUTPUT
            if how == "connection-lost":
                return None
            peer.send_message(Cancel(id=call_id))
            return peer.wait_answer(call_id)
        finally:
            peer.close()

    answer = await asyncio.to_thread(attach_and_end)
    assert how == "connection-lost" or (answer is not None and _cancelled(answer)), answer
    await _killed(pid)


@pytest.mark.execd_args("--request-grace", "20")
async def test_a_signal_names_a_command_by_its_request_id_from_any_connection(
    execd: RunningExecd, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    rid = await asyncio.to_thread(_start_and_leave, execd, _script(pidfile))
    pid = await _started(pidfile)

    def signal_by(params: dict[str, Any]) -> Reply | Error:
        peer = authenticated(execd)
        try:
            return peer.wait_answer(peer.start(shell_rpc.SIGNAL.name, params))
        finally:
            peer.close()

    unknown = await asyncio.to_thread(
        signal_by, {"signal": 0, "rid": os.urandom(limits.REQUEST_ID_SIZE)}
    )
    assert isinstance(unknown, Error) and unknown.code == ErrorCode.NO_SUCH_PROCESS, unknown
    both = await asyncio.to_thread(signal_by, {"signal": 0, "rid": rid, "call_id": 1})
    assert isinstance(both, Error) and both.code == ErrorCode.INVALID_PARAMS, both
    assert alive(pid)

    answer = await asyncio.to_thread(signal_by, {"signal": signal.SIGTERM, "rid": rid})
    assert isinstance(answer, Reply), answer
    assert msgspec.msgpack.decode(answer.result, type=shell_rpc.SignalResult).pid == pid
    await _killed(pid)
    # The call it named is over: the request id names no running command any more.
    gone = await asyncio.to_thread(signal_by, {"signal": 0, "rid": rid})
    assert isinstance(gone, Error) and gone.code == ErrorCode.NO_SUCH_PROCESS, gone
