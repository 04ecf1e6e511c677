"""harnessd.connect() and the client's local-file methods against a real execd."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import harnessd
from protocol.handshake import MAX_TOKEN_BYTES, token_bytes
from tests.conftest import one_loop
from tests.support.daemon import RunningExecd, start_execd

# execd reads this file: the token between blank lines and stray spaces, as an
# editor or `echo` might leave it.
PADDED = "\n  {token}\t\r\n"

pytestmark = [pytest.mark.anyio, one_loop]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningExecd]:
    with start_execd(tmp_path_factory.mktemp("connect"), token_file_text=PADDED) as running:
        yield running


async def test_token_is_stripped_as_execd_strips_it(daemon: RunningExecd) -> None:
    as_written = PADDED.format(token=daemon.token)
    for token in (daemon.token, as_written, as_written.encode(), f" {daemon.token}\n"):
        async with harnessd.connect(daemon.host, daemon.port, token) as client:
            await client.noop()
    # Only the ends are stripped: whitespace inside is part of the token.
    inner = daemon.token[:8] + " " + daemon.token[8:]
    with pytest.raises(harnessd.AuthenticationFailed):
        await harnessd.connect(daemon.host, daemon.port, inner)


def test_token_bytes_rule() -> None:
    assert token_bytes(" \t\n\x0b\x0cabc\r\n") == b"abc"
    assert token_bytes(b"\nabc def\n") == b"abc def"
    # Only ASCII whitespace: a no-break space is part of the token.
    assert token_bytes("\u00a0abc") == "\u00a0abc".encode()
    assert token_bytes("x" * MAX_TOKEN_BYTES + "\n") == b"x" * MAX_TOKEN_BYTES
    for bad in ("", " \n", b"\r\n", "x" * (MAX_TOKEN_BYTES + 1)):
        with pytest.raises(ValueError, match="token"):
            token_bytes(bad)


def test_empty_token_is_refused_before_connecting() -> None:
    with pytest.raises(ValueError, match="empty"):
        harnessd.connect("127.0.0.1", 1, " \n")


async def test_async_with_connect_closes_on_exit(daemon: RunningExecd) -> None:
    opening = harnessd.connect(daemon.host, daemon.port, daemon.token)
    async with opening as client:
        assert not client.closed
        assert await client.echo(b"hi") == b"hi"
    assert client.closed
    with pytest.raises(harnessd.ConnectionLost):
        await client.noop()
    # Awaiting leaves closing to the caller.
    other = await harnessd.connect(daemon.host, daemon.port, daemon.token)
    try:
        await other.noop()
    finally:
        await other.close()
    # An exception in the block still closes the connection.
    with pytest.raises(KeyError):
        async with harnessd.connect(daemon.host, daemon.port, daemon.token) as failing:
            raise KeyError("boom")
    assert failing.closed


def test_upload_of_what_is_not_a_file_is_a_typed_error(
    daemon: RunningExecd, tmp_path: Path
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    source = tmp_path / "data.bin"
    source.write_bytes(b"payload" * 1000)

    async def main() -> None:
        async with harnessd.connect(daemon.host, daemon.port, daemon.token) as client:
            with pytest.raises(harnessd.LocalFileError) as caught:
                await client.upload(str(tmp_path), str(tmp_path / "copy"))
            assert caught.value.errno == "EISDIR" and caught.value.path == str(tmp_path)
            assert "is a directory" in str(caught.value)
            # A FIFO without a writer is refused at once, not waited on.
            async with asyncio.timeout(10):
                with pytest.raises(harnessd.LocalFileError, match="not a regular file"):
                    await client.upload(str(fifo), str(tmp_path / "copy"))
            with pytest.raises(harnessd.LocalFileError) as caught:
                await client.upload(str(tmp_path / "missing"), str(tmp_path / "copy"))
            assert caught.value.errno == "ENOENT"
            with pytest.raises(harnessd.LocalFileError) as caught:
                await client.download(str(source), str(tmp_path))
            assert caught.value.errno == "EISDIR"
            assert not (tmp_path / "copy").exists(), "nothing was written in the workspace"
            # The connection is unharmed and a real upload works.
            result = await client.upload(str(source), str(tmp_path / "copy"))
            assert result.size == source.stat().st_size
            assert (tmp_path / "copy").read_bytes() == source.read_bytes()

    asyncio.run(main())


def test_a_stalled_event_loop_does_not_give_up_its_connections(daemon: RunningExecd) -> None:
    """Keepalive counts unanswered pings: a harness held up for many intervals keeps its sessions."""

    async def main() -> None:
        async with harnessd.connect(
            daemon.host, daemon.port, daemon.token, keepalive=0.5
        ) as client:
            await client.noop()
            await asyncio.sleep(1.2)  # a few pings answered
            time.sleep(3.0)  # the stall under test: six intervals, no ping out, nothing read
            await asyncio.sleep(1.0)  # ticks resume, the pings are answered again
            assert not client.closed
            await client.noop()

    asyncio.run(main())


def test_a_handshake_execd_timed_out_is_tried_again_on_a_new_connection(tmp_path: Path) -> None:
    """A harness too busy to finish its handshake in time (here: its loop stalled) still connects."""
    with start_execd(tmp_path, "--handshake-timeout", "0.2", "--log-level", "INFO") as daemon:

        async def main() -> None:
            # Stalls the loop before the first handshake can finish: execd gives up on it.
            asyncio.get_running_loop().call_soon(time.sleep, 0.8)
            async with harnessd.connect(daemon.host, daemon.port, daemon.token) as client:
                await client.noop()

        asyncio.run(main())
        log = daemon.log()
    assert log.count("handshake timed out") == 1, log
