"""The floor server's cross-process methods do the work they stand for.

``spawn`` and ``write`` are the floors execd's shell.run and atomic
files.write are compared with in the bench: a floor that skipped work would
flatter execd's figures. Real server on loopback, real processes, real files.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from bench.floor import FloorClient, FloorServer, connect_floor

pytestmark = pytest.mark.anyio

RESULT = msgspec.msgpack.Decoder(tuple[int, bytes, bytes])


def children() -> set[str]:
    """Pids of this process's children, zombies included."""
    pids: set[str] = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children", encoding="ascii") as handle:
            pids.update(handle.read().split())
    return pids


@pytest.fixture
async def floor() -> AsyncIterator[FloorClient]:
    server = await asyncio.get_running_loop().create_server(FloorServer, "127.0.0.1", 0)
    client = await connect_floor("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        yield client
    finally:
        client.close()
        server.close()
        await server.wait_closed()


async def spawn(client: FloorClient, argv: list[str]) -> tuple[int, bytes, bytes]:
    raw = await asyncio.wait_for(
        client.call("spawn", msgspec.Raw(msgspec.msgpack.encode(argv))), 10
    )
    return RESULT.decode(raw)


async def test_spawn_answers_exit_code_and_both_outputs(floor: FloorClient) -> None:
    assert await spawn(floor, ["sh", "-c", "echo out; echo err >&2; exit 3"]) == (
        3,
        b"out\n",
        b"err\n",
    )


async def test_spawn_waits_for_output_past_one_read_and_reads_from_devnull(
    floor: FloorClient,
) -> None:
    exit_code, out, err = await spawn(
        floor, ["sh", "-c", "head -c 300000 /dev/zero; cat; echo done >&2"]
    )
    assert (exit_code, len(out), set(out), err) == (0, 300000, {0}, b"done\n")


async def test_spawns_in_flight_at_once_each_get_their_own_answer(floor: FloorClient) -> None:
    results = await asyncio.gather(
        *(spawn(floor, ["sh", "-c", f"sleep 0.0{n}; echo {n}; exit {n}"]) for n in range(1, 6))
    )
    assert results == [(n, f"{n}\n".encode(), b"") for n in range(1, 6)]


async def test_spawn_leaves_no_child_and_no_descriptor(floor: FloorClient) -> None:
    fds, kids = set(os.listdir("/proc/self/fd")), children()
    for _ in range(5):
        assert (await spawn(floor, ["true"]))[0] == 0
    assert set(os.listdir("/proc/self/fd")) <= fds
    assert children() <= kids


async def test_write_replaces_the_file_and_leaves_no_temporary(
    floor: FloorClient, tmp_path: Path
) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    params = msgspec.Raw(msgspec.msgpack.encode((str(target), b"x" * 4096)))
    assert await floor.call("write", params) == msgspec.Raw(b"\xc0")
    assert target.read_bytes() == b"x" * 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
