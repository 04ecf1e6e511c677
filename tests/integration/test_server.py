"""execd's process contract and core RPC behaviour, against a real execd subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

import harnessd
from harnessd import ExecdClient, errors
from protocol.codec import ENCODER
from protocol.messages import Hello
from tests.conftest import eventually, one_loop
from tests.support.daemon import RunningExecd, start_execd
from tests.support.procs import alive

pytestmark = [pytest.mark.anyio, one_loop, pytest.mark.execd_args("--handshake-timeout", "1.5")]


async def test_announces_listening_line_and_serves(
    execd: RunningExecd, client: ExecdClient
) -> None:
    assert execd.host == "127.0.0.1"
    assert execd.port > 0
    await client.noop()
    assert await client.echo(b"\x00abc") == b"\x00abc"
    info = await client.server_info()
    assert info.pid == execd.pid
    assert info.marker == execd.marker
    assert "shell.run" in info.methods


def test_refuses_to_start_without_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "EXECD_TOKEN"}
    proc = subprocess.run(
        [sys.executable, "-m", "execd"], capture_output=True, env=env, timeout=30, check=False
    )
    assert proc.returncode == 2
    last = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert last["event"] == "exited"
    assert last["code"] == 2
    assert "token" in last["error"]
    assert b"token" in proc.stderr


async def test_token_from_environment_is_scrubbed_and_file_removed(tmp_path: Path) -> None:
    env = dict(os.environ, EXECD_TOKEN="s3cret-token-value-0123456789")
    proc = subprocess.Popen(
        [sys.executable, "-m", "execd", "--state-dir", str(tmp_path / "st")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline())
        assert line["event"] == "listening"
        client = await harnessd.connect("127.0.0.1", line["port"], env["EXECD_TOKEN"])
        result = await client.run(["env"])
        assert b"EXECD_TOKEN" not in result.stdout
        assert b"s3cret" not in result.stdout
        assert f"EXECD_MARKER={line['marker']}".encode() in result.stdout
        await client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        assert proc.stderr is not None
        assert b"s3cret" not in proc.stderr.read()
        proc.stdout.close() if proc.stdout else None
        proc.stderr.close()


def test_token_file_is_removed_after_reading(execd: RunningExecd, tmp_path: Path) -> None:
    assert not list(tmp_path.glob("token-*"))


async def test_wrong_token_is_rejected_and_daemon_keeps_serving(execd: RunningExecd) -> None:
    with pytest.raises(errors.AuthenticationFailed):
        await harnessd.connect(execd.host, execd.port, "not-the-token")
    async with await harnessd.connect(execd.host, execd.port, execd.token) as client:
        await client.noop()


async def test_encrypted_session_works(execd: RunningExecd) -> None:
    for cipher in (True, "chacha20-poly1305", "aes-256-gcm"):
        async with await harnessd.connect(
            execd.host, execd.port, execd.token, encrypt=cipher
        ) as client:
            assert client.cipher != "none"
            assert await client.echo(b"x" * 100_000) == b"x" * 100_000


async def test_unknown_method_and_bad_params_are_typed_errors(client: ExecdClient) -> None:
    with pytest.raises(errors.UnknownMethod):
        await client.call("no.such.method")
    with pytest.raises(errors.InvalidParams):
        await client.call("server.echo", {"data": 12})
    with pytest.raises(errors.InvalidParams):
        await client.call("shell.run", {"argv": "not-a-list"})
    await client.noop()


async def test_cancelling_a_call_cancels_it_in_execd(client: ExecdClient, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    handle = client.start("shell.run", {"command": f"echo $$ > {pidfile}; exec sleep 30"})
    pid = int(await eventually(lambda: pidfile.exists() and pidfile.read_text().strip()))
    handle.cancel()
    with pytest.raises(errors.Cancelled):
        await handle.result()
    await eventually(lambda: not alive(pid), what="the cancelled command's end")
    await client.noop()


def test_handshake_deadline_closes_silent_connections(execd: RunningExecd) -> None:
    with socket.create_connection((execd.host, execd.port), timeout=10) as sock:
        start = time.monotonic()
        data = sock.recv(4096)
        while data:
            data = sock.recv(4096)
        assert time.monotonic() - start < 8


def abort_code_for(execd: RunningExecd, sent: bytes) -> int:
    """The code of the abort execd answers ``sent`` with, on a fresh connection it then closes."""
    with socket.create_connection((execd.host, execd.port), timeout=10) as sock:
        sock.sendall(sent)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    (length,) = struct.unpack(">I", reply[:4])
    abort = msgspec.msgpack.decode(reply[4 : 4 + length])
    assert abort["t"] == "abort"
    code: int = abort["code"]
    return code


async def test_oversized_preauth_frame_closes_only_that_connection(
    execd: RunningExecd, client: ExecdClient
) -> None:
    assert abort_code_for(execd, struct.pack(">I", 0xFFFFFFFF)) == 2
    await client.noop()


def test_malformed_hello_gets_typed_abort(execd: RunningExecd) -> None:
    bodies = [
        b"\xc1",
        msgspec.msgpack.encode({"t": "nope"}),
        msgspec.msgpack.encode({"t": "hello", "versions": "x"}),
        ENCODER.encode(
            Hello(versions=[99], nonce=b"n" * 32, ciphers=["none"], max_frame=65536, window=65536)
        ),
    ]
    expected = [3, 4, 5, 8]
    for body, code in zip(bodies, expected, strict=True):
        assert abort_code_for(execd, struct.pack(">I", len(body)) + body) == code


async def test_many_calls_in_flight_on_one_connection(client: ExecdClient) -> None:
    payloads = [os.urandom(n % 300) for n in range(500)]
    results = await asyncio.gather(*(client.echo(p) for p in payloads))
    assert results == payloads


async def test_session_close_shuts_execd_down(execd: RunningExecd) -> None:
    client = await harnessd.connect(execd.host, execd.port, execd.token)
    await client.run(["sh", "-c", "sleep 300 & echo started"])
    report = await client.shutdown()
    assert report.remaining == []
    await client.close()
    assert await asyncio.to_thread(execd.proc.wait, 15) == 0


def test_lease_expires_without_connections(tmp_path: Path) -> None:
    with start_execd(tmp_path, "--lease", "1") as daemon:
        assert daemon.proc.wait(timeout=20) == 0


def test_crash_at_startup_prints_exit_line(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        env = dict(os.environ, EXECD_TOKEN="t" * 32)
        proc = subprocess.run(
            [sys.executable, "-m", "execd", "--port", str(port), "--state-dir", str(tmp_path)],
            capture_output=True,
            env=env,
            timeout=30,
            check=False,
        )
    finally:
        busy.close()
    assert proc.returncode != 0
    last = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert last["event"] == "exited"
    assert last["code"] == proc.returncode
    assert last["error"]
