"""Calls that survive a cut connection and run exactly once (request ids, PROTOCOL.md 8.1).

Every test talks to a real execd through :class:`~tests.support.cut_proxy.CutProxy`,
which cuts the TCP connection where the test says.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

import harnessd
from harnessd.api import ExecdClient
from harnessd.calls import Tracked
from protocol.codec import to_raw
from protocol.errors import ErrorCode
from protocol.messages import Error, Reply
from tests.conftest import eventually
from tests.support.cut_proxy import CutProxy
from tests.support.daemon import RunningExecd, start_execd
from tests.support.proxied import Clients

pytestmark = pytest.mark.anyio

SLOW_APPEND = "echo x >> {f}; sleep 2; echo done"


@pytest.mark.execd_args("--request-grace", "20")
async def test_a_command_cut_mid_way_finishes_once_and_its_result_arrives(
    clients: Clients, proxy: CutProxy, tmp_path: Path
) -> None:
    target = tmp_path / "f"
    client = await clients.connect()
    run = asyncio.ensure_future(client.run(command=SLOW_APPEND.format(f=target)))
    await eventually(target.exists, what="the command started")
    assert proxy.cut() == 1
    await clients.reconnect(client)
    result = await run
    assert (result.exit_code, result.stdout, result.stderr) == (0, b"done\n", b"")
    assert target.read_text() == "x\n"


@pytest.mark.execd_args("--request-grace", "20")
async def test_streamed_output_resumes_from_the_bytes_the_client_holds(
    clients: Clients, proxy: CutProxy, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    script = f"seq 1 2000; while [ ! -e {gate} ]; do sleep 0.05; done; seq 2001 4000"
    client = await clients.connect()
    command = client.run_streaming(command=script)
    received = bytearray()

    async def collect() -> None:
        async for stream, data in command.output():
            assert stream == "stdout"
            received.extend(data)

    reader = asyncio.ensure_future(collect())
    await eventually(lambda: received.endswith(b"2000\n"), what="the first half")
    proxy.cut()
    await clients.reconnect(client)
    gate.touch()
    await reader
    assert (await command.result()).exit_code == 0
    expected = "".join(f"{i}\n" for i in range(1, 4001)).encode()
    assert bytes(received) == expected


@pytest.mark.execd_args("--request-grace", "0.3")
async def test_past_the_grace_the_command_is_killed_and_the_reattach_says_so(
    execd: RunningExecd, clients: Clients, proxy: CutProxy, tmp_path: Path
) -> None:
    target = tmp_path / "f"
    client = await clients.connect()
    handle = client.start(
        "shell.run", {"command": f"echo x >> {target}; sleep 2; echo done >> {target}"}
    )
    rid = handle.request_id
    assert rid is not None
    await eventually(target.exists, what="the command started")
    proxy.cut()
    await eventually(lambda: "no reattach within" in execd.log(), what="the grace expired")
    fresh = await clients.connect()
    with pytest.raises(harnessd.Cancelled, match="cancelled: connection lost"):
        await fresh.reattach(rid).result()
    # Killed: the rest of the command never ran (2 s after the start, it would have).
    with pytest.raises(harnessd.Cancelled):
        await fresh.reattach(rid).result()
    assert target.read_text() == "x\n"


async def test_a_restarted_execd_says_not_known_and_nothing_runs_twice(tmp_path: Path) -> None:
    target = tmp_path / "f"
    first_dir, second_dir = tmp_path / "one", tmp_path / "two"
    first_dir.mkdir()
    second_dir.mkdir()
    with start_execd(first_dir) as first:
        client = await harnessd.connect(first.host, first.port, first.token, reattach_within=20)
        run = asyncio.ensure_future(client.run(command=SLOW_APPEND.format(f=target)))
        await eventually(target.exists, what="the command started")
        first.proc.terminate()  # its cleanup kills the command
        await eventually(lambda: client.closed, what="the loss noticed")
        orphans = client.take_orphans()
    with start_execd(second_dir) as second:
        fresh = await harnessd.connect(second.host, second.port, second.token)
        try:
            fresh.adopt(orphans)
            with pytest.raises(harnessd.RequestNotKnown) as caught:
                await run
            # Not one of this execd's connections: the call is not sent again.
            assert caught.value.data["reason"] == "unknown"
            assert caught.value.data.get("seen", False) is False
        finally:
            await fresh.close()
            await client.close()
    assert target.read_text() == "x\n"


async def test_a_call_cut_before_it_arrived_is_sent_again_and_runs_once(
    clients: Clients, proxy: CutProxy, tmp_path: Path
) -> None:
    target = tmp_path / "f"
    client = await clients.connect()
    proxy.cut_after("up", 12)  # inside the call's frame: execd never gets it
    run = asyncio.ensure_future(client.run(command=f"echo x >> {target}; echo ran"))
    await clients.reconnect(client)
    result = await run
    assert (result.exit_code, result.stdout) == (0, b"ran\n")
    assert target.read_text() == "x\n"
    assert proxy.cuts == 1


@pytest.mark.execd_args("--request-retention", "3")
async def test_the_oldest_outcomes_are_evicted_and_a_late_attach_is_told(
    execd: RunningExecd, client: ExecdClient
) -> None:
    rids: list[bytes] = []
    for i in range(5):
        handle = client.start("server.echo", {"data": bytes([i])})
        assert handle.request_id is not None
        rids.append(handle.request_id)
        assert await handle.result(bytes) == bytes([i])
    for rid in rids[:2]:
        with pytest.raises(harnessd.RequestNotKnown) as caught:
            await client.reattach(rid).result()
        assert caught.value.data == {"reason": "evicted", "rid": rid.hex()}
    for i, rid in enumerate(rids[2:], start=2):
        assert await client.reattach(rid).result(bytes) == bytes([i])
    with pytest.raises(harnessd.RequestNotKnown) as caught:
        await client.reattach(os.urandom(16)).result()
    assert caught.value.data["reason"] == "unknown"


async def test_large_kept_results_come_back_whole_from_an_attach_and_a_resent_call(
    execd: RunningExecd, client: ExecdClient, tmp_path: Path
) -> None:
    # Results from 64 KiB on are kept in a mapping of their own (execd.requests._mapped).
    payload = os.urandom(300 * 1024)
    handle = client.start("server.echo", {"data": payload})
    echo_rid = handle.request_id
    assert echo_rid is not None
    assert await handle.result(bytes) == payload
    assert await client.reattach(echo_rid).result(bytes) == payload
    params = {"command": "head -c 200000 /dev/urandom | od -An -tx1 | head -c 150000"}
    rid = os.urandom(16)
    first, again = (
        await _shell_run_as(client, rid, params),
        await _shell_run_as(client, rid, params),
    )
    assert isinstance(first, Reply) and isinstance(again, Reply)
    assert len(bytes(first.result)) > 150_000
    assert bytes(again.result) == bytes(first.result)  # the kept result, not a second run


def _shell_run_as(
    client: ExecdClient, rid: bytes, params: dict[str, str]
) -> asyncio.Future[Reply | Error]:
    """Send ``shell.run`` with ``params`` under request id ``rid``; the future of its answer."""
    tracked = Tracked(rid, "shell.run", to_raw(params), b"")
    return client._send_call("shell.run", params, tracked=tracked).future


async def test_a_call_resent_with_a_known_id_does_not_run_again(
    execd: RunningExecd, client: ExecdClient, tmp_path: Path
) -> None:
    target = tmp_path / "f"
    params = {"command": f"echo x >> {target}; echo ran"}
    rid = os.urandom(16)
    answers = []
    for _ in range(2):
        answer = await _shell_run_as(client, rid, params)
        assert isinstance(answer, Reply)
        answers.append(bytes(answer.result))
    assert answers[0] == answers[1]  # the same kept result, pid included
    assert target.read_text() == "x\n"


async def test_a_copy_right_behind_a_call_that_runs_on_finds_it_in_flight(
    execd: RunningExecd, client: ExecdClient, tmp_path: Path
) -> None:
    # The call's record is opened only once its dispatch returns with the call not over:
    # still before execd reads the copy sent right behind it on the same connection.
    target = tmp_path / "f"
    params = {"command": f"echo x >> {target}; sleep 0.5; echo ran"}
    rid = os.urandom(16)
    first, second = _shell_run_as(client, rid, params), _shell_run_as(client, rid, params)
    copy = await second
    assert isinstance(copy, Error) and copy.code == ErrorCode.INVALID_PARAMS
    assert "in flight on this connection" in copy.message
    original = await first
    assert isinstance(original, Reply)
    assert target.read_text() == "x\n"


@pytest.mark.execd_args("--request-grace", "20")
async def test_a_streamed_write_cut_at_half_completes_once_or_leaves_nothing_torn(
    clients: Clients, proxy: CutProxy, tmp_path: Path
) -> None:
    size = 64 * 1024 * 1024
    payload = os.urandom(1024 * 1024) * 64
    target = tmp_path / "big.bin"
    target.write_bytes(b"before")
    client = await clients.connect()
    proxy.cut_after("up", size // 2)
    try:
        await client.write_file(str(target), payload)
        completed = True
    except harnessd.ConnectionLost:
        completed = False
    assert proxy.cuts == 1
    print("completed on reattach" if completed else "failed cleanly; written again")
    fresh = await clients.reconnect(client)
    if not completed:
        # The upload broke: the atomic write left the target as it was, and no
        # temporary file beside it.
        assert target.read_bytes() == b"before"
        await eventually(
            lambda: (
                sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("big"))
                == ["big.bin"]
            ),
            what="the temporary file removed",
        )
        # Now written whole, once, on the new connection.
        await fresh.write_file(str(target), payload)
        assert target.stat().st_size == size
    assert hashlib.sha256(target.read_bytes()).digest() == hashlib.sha256(payload).digest()


@pytest.mark.execd_args("--request-grace", "20")
@pytest.mark.parametrize(
    ("size", "cut"),
    [
        # Cut mid-read: the read resumes from the client's offset.
        pytest.param(24 * 1024 * 1024, 9 * 1024 * 1024, id="resumes-from-the-clients-offset"),
        # The whole read (and its answer) leaves execd before the cut drops part of it:
        # without a pong nothing proves receipt, so the bytes are still kept and replayed.
        pytest.param(2 * 1024 * 1024, 1024 * 1024, id="cut-after-it-finished-replays-the-rest"),
    ],
)
async def test_a_streamed_read_cut_partway_reaches_the_client_whole(
    clients: Clients, proxy: CutProxy, tmp_path: Path, size: int, cut: int
) -> None:
    source, payload = _source_file(tmp_path, size)
    client = await clients.connect()
    proxy.cut_after("down", cut)
    read = asyncio.ensure_future(client.read_file(str(source)))
    await clients.reconnect(client)
    assert await read == payload
    assert proxy.cuts == 1


def _source_file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    """A file of ``size`` random bytes in ``tmp_path``, and its content."""
    payload = os.urandom(size)
    source = tmp_path / "src.bin"
    source.write_bytes(payload)
    return source, payload


async def _read_streamed(client: ExecdClient, path: Path) -> tuple[bytes, bytes, object]:
    """A streamed ``files.read`` of ``path``: its request id, the bytes and the result."""
    handle = client.start("files.read", {"path": str(path), "stream": True})
    rid = handle.request_id
    assert rid is not None
    data = b"".join([chunk async for chunk in handle.stream("data")])
    return rid, data, await handle.result()


async def test_a_finished_reads_output_is_let_go_once_received_and_its_outcome_stays(
    client: ExecdClient, tmp_path: Path
) -> None:
    source, payload = _source_file(tmp_path, 1024 * 1024)
    rid, data, result = await _read_streamed(client, source)
    assert data == payload
    gone = {"stream": "data", "offset": 0, "kept_from": len(payload)}

    async def let_go() -> bool:
        # The client's pong proved receipt: the bytes are no longer kept.
        try:
            await client.reattach(rid).result()
        except harnessd.StreamError as exc:
            return bool(exc.data == gone)
        return False

    await eventually(let_go, what="the read's output let go")
    # The outcome stays: an attach from the end of the stream gets it again.
    again = client.reattach(rid, {"data": len(payload)})
    assert [chunk async for chunk in again.stream("data")] == []
    assert await again.result() == result


@pytest.mark.execd_args("--request-retention-bytes", str(4 * 1024 * 1024))
async def test_many_large_reads_keep_their_outcomes_within_a_small_byte_bound(
    client: ExecdClient, tmp_path: Path
) -> None:
    # Twelve 1 MiB reads under a 4 MiB bound: their output, once received, does not count
    # against the bound, so the first outcome is still kept (it would be evicted if every
    # read's bytes stayed pinned).
    source, payload = _source_file(tmp_path, 1024 * 1024)
    reads = [await _read_streamed(client, source) for _ in range(12)]
    assert all(data == payload for _, data, _ in reads)
    rid, _, result = reads[0]
    assert await client.reattach(rid, {"data": len(payload)}).result() == result
