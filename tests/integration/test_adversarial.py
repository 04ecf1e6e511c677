"""An adversarial suite against a real execd: hostile peers, broken frames, dying parties.

Every case tries a batch of bad inputs, checks each is met with its typed
error (an Abort carrying the wire code before the connection closes, or an
Error reply on a connection that lives on), that a healthy client keeps being
served, and that no process carrying the session marker is left behind. Each
case prints ``adversarial <case>: <n> bad inputs, <outcome>`` (visible with
``-s``) and the module prints the total at the end.

Hostile peers use :class:`RawPeer`: a blocking socket driven by the sans-I/O
:class:`~protocol.connection.ClientConnection`, so a test can record the
exact bytes of a real session, replay them, tamper with sealed frames or
send anything at all. Blocking work runs in threads so the healthy client's
event loop (and its keepalive) keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import harnessd
from execd.marker import cleanup, find_marked
from harnessd import errors
from harnessd.api import ExecdClient
from protocol import limits
from protocol.codec import decode_message, to_raw
from protocol.connection import ClientConnection, ConnectionEvent, HandshakeComplete
from protocol.errors import ErrorCode, ProtocolError
from protocol.framing import frame_header
from protocol.messages import (
    Abort,
    Call,
    Challenge,
    Chunk,
    Error,
    Message,
    Reply,
)
from protocol.rpc import Rpc
from protocol.rpc import files as files_rpc
from protocol.rpc import ledger as ledger_rpc
from protocol.rpc import shell as shell_rpc
from protocol.rpc import types as rpc_types
from tests.conftest import eventually, one_loop
from tests.support.cut_proxy import CutProxy
from tests.support.daemon import RunningExecd, start_execd
from tests.support.procs import allow_open_files, cmdline, descriptors, tcp_sockets_on

pytestmark = [
    pytest.mark.anyio,
    one_loop,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc"),
]

MARKER_VAR = "EXECD_MARKER"
HANDSHAKE_TIMEOUT = 1.5
MAX_PROCESSES = 16
MIB = 1024 * 1024
RSS_BOUND_KIB = 64 * 1024
"""How much execd's RSS may grow while a client refuses to read a flood."""

SUMMARY: dict[str, tuple[int, str]] = {}


def report(name: str, tried: int, outcome: str) -> None:
    """Record and print one case's summary line."""
    SUMMARY[name] = (tried, outcome)
    print(f"adversarial {name}: {tried} bad inputs, {outcome}")


@pytest.fixture(scope="module", autouse=True)
def summary() -> Iterator[None]:
    yield
    total = sum(tried for tried, _ in SUMMARY.values())
    print(f"adversarial total: {total} bad inputs over {len(SUMMARY)} cases")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningExecd]:
    """One execd that every case attacks in turn (it must survive them all)."""
    root = tmp_path_factory.mktemp("adversarial")
    with start_execd(
        root,
        "--handshake-timeout",
        str(HANDSHAKE_TIMEOUT),
        "--max-processes",
        str(MAX_PROCESSES),
    ) as running:
        yield running


# -- helpers ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def healthy(daemon: RunningExecd) -> AsyncIterator[ExecdClient]:
    """A well-behaved client, checked before the attack and again after it."""
    client = await harnessd.connect(daemon.host, daemon.port, daemon.token)
    try:
        await check_healthy(client)
        yield client
        await check_healthy(client)
    finally:
        await client.close()


async def survives(
    daemon: RunningExecd, attack: Callable[[], int], name: str, outcome: str
) -> None:
    """Run the blocking ``attack`` while a healthy client holds on; no marked process may be left.

    The attack returns how many bad inputs it tried: they are reported under ``name``.
    """
    async with healthy(daemon):
        tried = await asyncio.to_thread(attack)
    await no_marked(daemon.marker)
    report(name, tried, outcome)


async def check_healthy(client: ExecdClient) -> None:
    async with asyncio.timeout(20):
        await client.noop()
        assert await client.echo(b"still here") == b"still here"
        result = await client.run(["echo", "ok"])
        assert result.stdout == b"ok\n"


async def no_marked(marker: str, timeout: float = 15.0) -> None:
    """Wait until no process carries ``marker`` (fail with their command lines if some do)."""
    try:
        await eventually(lambda: not find_marked(MARKER_VAR, marker), timeout, interval=0.05)
    except AssertionError:
        left = find_marked(MARKER_VAR, marker)
        raise AssertionError(f"marked processes left: {[(p, cmdline(p)) for p in left]}") from None


def marked_matching(marker: str, needle: str) -> list[int]:
    return [pid for pid in find_marked(MARKER_VAR, marker) if needle in cmdline(pid)]


async def settle_fds(daemon: RunningExecd, ceiling: int, timeout: float = 10.0) -> int:
    """Wait until execd holds at most ``ceiling`` descriptors; return the count."""
    deadline = time.monotonic() + timeout
    while True:
        count = descriptors(daemon.pid, daemon.port)
        if count <= ceiling or time.monotonic() > deadline:
            return count
        await asyncio.sleep(0.05)


async def steady_descriptors(daemon: RunningExecd) -> int:
    """execd's descriptor count once it has served a healthy client and let it go.

    The first command execd runs opens a descriptor it keeps for good (its event
    loop's epoll instance for commands' pipes, :mod:`execd.pipes`): a baseline
    taken before any command would count that as a leak.
    """
    async with healthy(daemon):
        pass
    counts = [descriptors(daemon.pid, daemon.port)]
    # The client's connection closes on execd's side a moment later: three equal counts.
    while (len(counts) < 3 or len(set(counts[-3:])) > 1) and len(counts) < 200:
        await asyncio.sleep(0.05)
        counts.append(descriptors(daemon.pid, daemon.port))
    return counts[-1]


def plain_frames(data: bytes) -> list[Message]:
    """Decode a byte string of unencrypted frames (a trailing partial frame is ignored)."""
    messages: list[Message] = []
    pos = 0
    while len(data) - pos >= 4:
        (length,) = struct.unpack_from(">I", data, pos)
        if len(data) - pos - 4 < length:
            break
        messages.append(decode_message(data[pos + 4 : pos + 4 + length]))
        pos += 4 + length
    return messages


def abort_code(messages: list[Message]) -> int | None:
    codes = [m.code for m in messages if isinstance(m, Abort)]
    return codes[-1] if codes else None


def raw_frame(obj: Any) -> bytes:
    """A plaintext frame whose body is ``obj`` as msgpack (any shape at all)."""
    body = msgspec.msgpack.encode(obj)
    return frame_header(len(body)) + body


class RawPeer:
    """A blocking connection to execd that can behave, record, replay and misbehave."""

    def __init__(
        self,
        daemon: RunningExecd,
        *,
        token: str | None = None,
        cipher: str = limits.CIPHER_NONE,
        rcvbuf: int | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((daemon.host, daemon.port))
        self.conn = ClientConnection((token or daemon.token).encode(), ciphers=(cipher,))
        self.sent = bytearray()
        self.eof = False

    def send(self, data: bytes | bytearray) -> None:
        self.sent += data
        self.sock.sendall(data)

    def send_message(self, message: Message) -> bytes:
        frame = bytes(self.conn.send(message))
        self.send(frame)
        return frame

    def receive(self) -> list[ConnectionEvent]:
        """One read fed to the state machine; its own answers (Auth, Pong) are sent."""
        data = self.sock.recv(1 << 20)
        if not data:
            self.eof = True
            return []
        events = self.conn.receive_data(data)
        out = self.conn.data_to_send()
        if out:
            self.send(out)
        return events

    def handshake(self) -> HandshakeComplete:
        self.send(self.conn.data_to_send())
        while not self.eof:
            for event in self.receive():
                if isinstance(event, HandshakeComplete):
                    return event
                if isinstance(event, Abort):
                    raise AssertionError(f"handshake refused: {event}")
        raise AssertionError("execd closed the connection during the handshake")

    def start(self, method: Rpc[Any, Any] | str, params: Any = None) -> int:
        call_id = self.conn.next_call_id()
        raw = to_raw(params) if params is not None else msgspec.Raw(b"\x80")
        self.send_message(Call(id=call_id, method=str(method), params=raw))
        return call_id

    def wait_answer(self, call_id: int) -> Reply | Error:
        while not self.eof:
            for event in self.receive():
                if isinstance(event, Reply | Error) and event.id == call_id:
                    return event
        raise AssertionError(f"connection closed before the answer to call {call_id}")

    def read_stream(self, call_id: int, stream: str, at_least: int) -> int:
        """Read (granting credit) until ``at_least`` bytes arrived on ``stream``."""
        got = 0
        while got < at_least and not self.eof:
            for event in self.receive():
                if isinstance(event, Chunk) and event.id == call_id and event.stream == stream:
                    got += len(event.data)
                    credit = self.conn.grant(call_id, stream, len(event.data))
                    if credit:
                        self.send(credit)
        return got

    def drain_to_eof(self, timeout: float) -> bytes:
        """Everything execd still sends until it closes (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        received = bytearray()
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                break
            except ConnectionResetError:
                self.eof = True
                break
            if not data:
                self.eof = True
                break
            received += data
        return bytes(received)

    def expect_abort(self, timeout: float = 10.0) -> int | None:
        """Read until execd closes; return the code of the Abort it sent first."""
        data = self.drain_to_eof(timeout)
        assert self.eof, "execd did not close the connection"
        if self.conn.cipher == limits.CIPHER_NONE or self.conn.version == 0:
            return abort_code(plain_frames(data))
        try:
            events = self.conn.receive_data(data)
        except ProtocolError as exc:
            raise AssertionError(f"cannot read execd's answer: {exc}") from None
        return abort_code([e for e in events if isinstance(e, Abort)])

    def reset(self) -> None:
        """Close abruptly: SO_LINGER 0 makes the kernel send RST instead of FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def raw_peer(daemon: RunningExecd, **kwargs: Any) -> Iterator[RawPeer]:
    peer = RawPeer(daemon, **kwargs)
    try:
        yield peer
    finally:
        peer.close()


def authenticated(daemon: RunningExecd, **kwargs: Any) -> RawPeer:
    peer = RawPeer(daemon, **kwargs)
    try:
        peer.handshake()
    except BaseException:
        peer.close()
        raise
    return peer


# -- authentication --------------------------------------------------------------------


async def test_wrong_token(daemon: RunningExecd) -> None:
    async def main() -> int:
        tried = 0
        async with healthy(daemon):
            for index in range(24):
                wrong = secrets.token_hex(32) if index % 3 else daemon.token[:-1] + "0"
                if wrong == daemon.token:
                    wrong = daemon.token[:-1] + "1"
                with pytest.raises(errors.AuthenticationFailed) as caught:
                    await harnessd.connect(
                        daemon.host, daemon.port, wrong, encrypt=bool(index % 2), keepalive=None
                    )
                assert caught.value.code == ErrorCode.AUTH_FAILED
                tried += 1
        await no_marked(daemon.marker)
        return tried

    report("wrong_token", await main(), "AuthenticationFailed (code 7) every time")


async def test_no_token_hangups_and_silence(daemon: RunningExecd) -> None:
    def hang_ups() -> int:
        tried = 0
        for index in range(60):
            sock = socket.create_connection((daemon.host, daemon.port), timeout=10)
            if index % 3 == 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif index % 3 == 2:
                hello = ClientConnection(b"x").data_to_send()
                sock.sendall(hello[: len(hello) // 2])
            sock.close()
            tried += 1
        return tried

    def silent() -> list[tuple[int | None, float]]:
        peers = [RawPeer(daemon) for _ in range(4)]
        started = time.monotonic()
        try:
            return [
                (p.expect_abort(HANDSHAKE_TIMEOUT + 8), time.monotonic() - started) for p in peers
            ]
        finally:
            for peer in peers:
                peer.close()

    async def main() -> int:
        baseline = await steady_descriptors(daemon)
        async with healthy(daemon):
            tried = await asyncio.to_thread(hang_ups)
            outcomes = await asyncio.to_thread(silent)
            for code, elapsed in outcomes:
                assert code == ErrorCode.HANDSHAKE_TIMEOUT
                assert HANDSHAKE_TIMEOUT - 0.2 <= elapsed <= HANDSHAKE_TIMEOUT + 5
            tried += len(outcomes)
        assert await settle_fds(daemon, baseline) <= baseline
        await no_marked(daemon.marker)
        return tried

    report("no_token", await main(), "hang-ups absorbed, silent peers aborted at the deadline")


async def test_replayed_handshake_transcript(daemon: RunningExecd) -> None:
    def record(cipher: str) -> bytes:
        with raw_peer(daemon, cipher=cipher) as peer:
            peer.handshake()
            call_id = peer.start("server.echo", {"data": b"recorded"})
            answer = peer.wait_answer(call_id)
            assert isinstance(answer, Reply)
            return bytes(peer.sent)

    def replay(transcript: bytes, paced: bool) -> int | None:
        with raw_peer(daemon) as peer:
            if paced:
                hello_len = 4 + struct.unpack_from(">I", transcript)[0]
                peer.send(transcript[:hello_len])
                first = plain_frames(peer.sock.recv(4096))
                assert first and isinstance(first[0], Challenge)
                peer.send(transcript[hello_len:])
            else:
                peer.send(transcript)
            data = peer.drain_to_eof(10)
            assert peer.eof
            messages = plain_frames(data)
            assert not any(isinstance(m, Reply | Error) for m in messages), messages
            return abort_code(messages)

    def attack() -> int:
        tried = 0
        for cipher in (limits.CIPHER_NONE, limits.CIPHER_AESGCM, limits.CIPHER_CHACHA20):
            transcript = record(cipher)
            for paced in (False, True):
                assert replay(transcript, paced) == ErrorCode.AUTH_FAILED
                tried += 1
        return tried

    await survives(
        daemon, attack, "replayed_handshake", "AUTH_FAILED on every replay, no call served"
    )


async def test_slow_handshake_is_cut_at_the_deadline(daemon: RunningExecd) -> None:
    def attack() -> list[tuple[int | None, float, int]]:
        hello = ClientConnection(daemon.token.encode()).data_to_send()
        peers = [RawPeer(daemon) for _ in range(4)]
        selector = selectors.DefaultSelector()
        for number, peer in enumerate(peers):
            selector.register(peer.sock, selectors.EVENT_READ, number)
        started = time.monotonic()
        next_byte = started
        sent = 0
        closed: dict[int, tuple[int | None, float, int]] = {}
        try:
            while len(closed) < len(peers) and time.monotonic() - started < 15:
                if time.monotonic() >= next_byte:
                    # One more byte of the Hello on every connection still open.
                    for number, peer in enumerate(peers):
                        if number not in closed:
                            with contextlib.suppress(OSError):
                                peer.send(hello[sent : sent + 1])
                    sent += 1
                    next_byte += 1.0
                for key, _ in selector.select(timeout=max(0.0, next_byte - time.monotonic())):
                    number = key.data
                    selector.unregister(key.fileobj)
                    code = peers[number].expect_abort(2.0)
                    closed[number] = (code, time.monotonic() - started, sent)
            return [closed.get(n, (None, time.monotonic() - started, sent)) for n in range(4)]
        finally:
            selector.close()
            for peer in peers:
                peer.close()

    async def main() -> int:
        async with healthy(daemon):
            outcomes = await asyncio.to_thread(attack)
        for code, elapsed, sent in outcomes:
            assert code == ErrorCode.HANDSHAKE_TIMEOUT, outcomes
            assert HANDSHAKE_TIMEOUT - 0.2 <= elapsed <= HANDSHAKE_TIMEOUT + 3, outcomes
            assert 0 < sent < 10, outcomes
        await no_marked(daemon.marker)
        return len(outcomes)

    report("slow_handshake", await main(), "HANDSHAKE_TIMEOUT at the deadline, a few bytes in")


async def test_thousand_unauthenticated_connections(daemon: RunningExecd) -> None:
    count = 1000
    allow_open_files(count)

    def open_batch(size: int) -> list[socket.socket]:
        batch: list[socket.socket] = []
        for _ in range(size):
            sock = socket.create_connection((daemon.host, daemon.port), timeout=10)
            sock.setblocking(False)
            batch.append(sock)
        return batch

    def outcomes(socks: list[socket.socket], timeout: float) -> dict[str, int]:
        received = {sock.fileno(): bytearray() for sock in socks}
        codes: dict[str, int] = {}
        selector = selectors.DefaultSelector()
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ, sock)
        deadline = time.monotonic() + timeout
        open_left = len(socks)
        while open_left and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.2):
                sock = key.data
                try:
                    data = sock.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except ConnectionResetError:
                    data = b""
                if data:
                    received[sock.fileno()] += data
                    continue
                selector.unregister(sock)
                open_left -= 1
                code = abort_code(plain_frames(bytes(received[sock.fileno()])))
                name = ErrorCode(code).name if code is not None else "closed without abort"
                codes[name] = codes.get(name, 0) + 1
        selector.close()
        if open_left:
            codes["still open"] = open_left
        return codes

    async def main() -> dict[str, int]:
        baseline = await steady_descriptors(daemon)
        socks: list[socket.socket] = []
        try:
            async with healthy(daemon) as client:
                for _ in range(count // 100):
                    socks += await asyncio.to_thread(open_batch, 100)
                    async with asyncio.timeout(10):
                        await client.noop()
                # execd's own descriptors stay bounded while a thousand peers knock.
                assert descriptors(daemon.pid, daemon.port) < baseline + 2 * 64 + 32
                found = await asyncio.to_thread(outcomes, socks, HANDSHAKE_TIMEOUT + 10)
                await check_healthy(client)
        finally:
            for sock in socks:
                sock.close()
        assert await settle_fds(daemon, baseline) <= baseline
        await no_marked(daemon.marker)
        # A fresh client is served once the unauthenticated slots are free again.
        async with healthy(daemon):
            pass
        return found

    found = await main()
    assert sum(found.values()) == count, found
    assert set(found) <= {"CONNECTION_LIMIT", "HANDSHAKE_TIMEOUT"}, found
    assert found.get("CONNECTION_LIMIT", 0) >= count // 2, found
    report(
        "thousand_unauthenticated",
        count,
        ", ".join(f"{n} {name}" for name, n in sorted(found.items())),
    )


# -- frames and messages ---------------------------------------------------------------


async def test_oversized_and_absurd_frame_lengths(daemon: RunningExecd) -> None:
    def attack() -> int:
        tried = 0
        for length in (limits.PREAUTH_MAX_FRAME + 1, 64 * MIB, limits.MAX_HEADER_VALUE):
            with raw_peer(daemon) as peer:
                peer.send(frame_header(length) + b"\x00" * 64)
                assert peer.expect_abort() == ErrorCode.FRAME_TOO_LARGE, length
                tried += 1
        for cipher in (limits.CIPHER_NONE, limits.CIPHER_AESGCM):
            for length in (limits.DEFAULT_MAX_FRAME + 1, limits.MAX_HEADER_VALUE):
                peer = authenticated(daemon, cipher=cipher)
                with contextlib.closing(peer):
                    peer.send(frame_header(length) + b"\x00" * 64)
                    assert peer.expect_abort() == ErrorCode.FRAME_TOO_LARGE, (cipher, length)
                    tried += 1
        return tried

    async def main() -> int:
        before = daemon.rss_kib()
        async with healthy(daemon):
            tried = await asyncio.to_thread(attack)
        # Nothing was allocated for the declared bodies.
        assert daemon.rss_kib() - before < 32 * 1024
        await no_marked(daemon.marker)
        return tried

    report("oversized_frames", await main(), "FRAME_TOO_LARGE before and after authentication")


async def test_malformed_and_mistyped_messages(daemon: RunningExecd, tmp_path: Path) -> None:
    hello = msgspec.msgpack.decode(ClientConnection(b"t").data_to_send()[4:])
    bad_hello = dict(hello, versions="one")
    preauth: list[tuple[bytes, ErrorCode]] = [
        (frame_header(1) + b"\xc1", ErrorCode.MALFORMED_MESSAGE),
        (frame_header(3) + b"\x82\xa1t", ErrorCode.MALFORMED_MESSAGE),
        (raw_frame({"t": "bogus"}), ErrorCode.UNKNOWN_MESSAGE_TYPE),
        (raw_frame(bad_hello), ErrorCode.INVALID_MESSAGE),
        (raw_frame([1, 2, 3]), ErrorCode.INVALID_MESSAGE),
        (raw_frame({"t": "call", "id": 1, "method": "server.noop"}), ErrorCode.UNEXPECTED_MESSAGE),
    ]
    sleep_call = {
        "t": "call",
        "id": 7,
        "method": "shell.run",
        "params": msgspec.Raw(msgspec.msgpack.encode({"argv": ["sleep", "30"]})),
    }
    write_call = {
        "t": "call",
        "id": 9,
        "method": "files.write",
        # A regular file: a device would be refused at once, and chunks of a finished call are dropped.
        "params": msgspec.Raw(
            msgspec.msgpack.encode({"path": str(tmp_path / "overrun"), "stream": True})
        ),
    }
    # One chunk past the whole window: execd cannot have granted more before it arrived
    # (several smaller chunks race the credit execd grants as it consumes them).
    overrun = raw_frame(
        {
            "t": "chunk",
            "id": 9,
            "stream": "data",
            "seq": 0,
            "data": b"\0" * (limits.DEFAULT_STREAM_WINDOW + 1),
        }
    )
    postauth: list[tuple[bytes, ErrorCode]] = [
        (frame_header(1) + b"\xc1", ErrorCode.MALFORMED_MESSAGE),
        (frame_header(3) + b"\x82\xa1t", ErrorCode.MALFORMED_MESSAGE),
        (raw_frame(5), ErrorCode.INVALID_MESSAGE),
        (raw_frame({"t": "bogus", "id": 1}), ErrorCode.UNKNOWN_MESSAGE_TYPE),
        (raw_frame({"t": "call", "id": "one", "method": "server.noop"}), ErrorCode.INVALID_MESSAGE),
        (raw_frame({"t": "call", "id": -1, "method": "server.noop"}), ErrorCode.INVALID_MESSAGE),
        (raw_frame({"t": "call", "id": 1, "method": "m" * 500}), ErrorCode.INVALID_MESSAGE),
        (raw_frame({"t": "call", "id": 1, "method": ""}), ErrorCode.INVALID_MESSAGE),
        (raw_frame({"t": "welcome", "mac": b"\0" * 32}), ErrorCode.UNEXPECTED_MESSAGE),
        (raw_frame({"t": "reply", "id": 1}), ErrorCode.UNEXPECTED_MESSAGE),
        (raw_frame(hello), ErrorCode.UNEXPECTED_MESSAGE),
        (raw_frame(sleep_call) + raw_frame(sleep_call), ErrorCode.DUPLICATE_CALL_ID),
        (raw_frame(write_call) + overrun, ErrorCode.FLOW_CONTROL_VIOLATION),
    ]

    def attack() -> int:
        tried = 0
        for frame, code in preauth:
            with raw_peer(daemon) as peer:
                peer.send(frame)
                assert peer.expect_abort() == code, (frame[:40], code)
                tried += 1
        for frame, code in postauth:
            peer = authenticated(daemon)
            with contextlib.closing(peer):
                with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                    peer.send(frame)
                got = abort_code(plain_frames(peer.drain_to_eof(10)))
                assert peer.eof and got == code, (frame[:40], got, code)
                tried += 1
        return tried

    # The duplicate call's sleep was started once, then killed with its connection.
    await survives(daemon, attack, "malformed_messages", "each closed with its typed abort code")


async def test_wrongly_typed_params_and_unknown_methods(daemon: RunningExecd) -> None:
    bad_params: list[tuple[str, Any]] = [
        ("shell.run", {"argv": 5}),
        ("shell.run", {"argv": []}),
        ("shell.run", {"argv": ["true"], "timeout": -1}),
        ("shell.run", {"argv": ["true"], "timeout": "soon"}),
        ("shell.run", {"argv": ["x" * (rpc_types.MAX_ARG + 1)]}),
        ("shell.run", 5),
        ("shell.run", ["argv"]),
        ("shell.signal", {"signal": 99, "call_id": 1}),
        ("files.read", {"path": 123}),
        ("files.read", {"path": "x", "offset": -5}),
        ("files.write", {"path": "x", "data": "text, not bytes"}),
        ("files.write", {"path": "x" * (rpc_types.MAX_PATH + 1), "data": b""}),
        ("files.stat", {"path": ""}),
        ("files.move", {"src": "a", "dst": ""}),
        ("ledger.append", {"session": "../etc", "first_seq": 1, "prev_hash": b"", "entries": []}),
        ("ledger.head", {"session": ""}),
        ("server.echo", {"data": 5}),
        ("shell.status", {"command_id": ""}),
    ]
    unknown = ["no.such", "shell.run2", "SHELL.RUN", "server.noop\0", "../files.read", "x" * 128]

    async def main() -> int:
        tried = 0
        async with healthy(daemon) as client:
            for method, params in bad_params:
                with pytest.raises(errors.InvalidParams) as caught:
                    await client.call(method, params)
                assert caught.value.code == ErrorCode.INVALID_PARAMS
                tried += 1
            for method in unknown:
                with pytest.raises(errors.UnknownMethod) as unknown_error:
                    await client.call(method, {})
                assert unknown_error.value.code == ErrorCode.UNKNOWN_METHOD
                tried += 1
        await no_marked(daemon.marker)
        return tried

    report(
        "typed_params_and_methods", await main(), "INVALID_PARAMS / UNKNOWN_METHOD, same connection"
    )


async def test_tampered_encrypted_frames(daemon: RunningExecd) -> None:
    def sealed_call(peer: RawPeer, data: bytes) -> tuple[int, bytes]:
        call_id = peer.conn.next_call_id()
        call = Call(id=call_id, method="server.echo", params=to_raw({"data": data}))
        return call_id, bytes(peer.conn.send(call))

    def flip(frame: bytes, index: int) -> bytes:
        mutable = bytearray(frame)
        mutable[index] ^= 0x01
        return bytes(mutable)

    def tamper(peer: RawPeer, kind: str) -> None:
        if kind == "body":
            peer.send(flip(sealed_call(peer, b"a" * 64)[1], 10))
        elif kind == "tag":
            peer.send(flip(sealed_call(peer, b"a")[1], -1))
        elif kind == "header":
            frame = sealed_call(peer, b"abc")[1]
            (length,) = struct.unpack_from(">I", frame)
            peer.send(frame_header(length - 1) + frame[4:-1])
        elif kind == "short":
            peer.send(frame_header(8) + b"\0" * 8)
        elif kind == "replay":
            call_id, frame = sealed_call(peer, b"once")
            peer.send(frame)
            assert isinstance(peer.wait_answer(call_id), Reply)
            peer.send(frame)
        elif kind == "reorder":
            first = sealed_call(peer, b"first")[1]
            second = sealed_call(peer, b"second")[1]
            peer.send(second + first)
        else:
            raise AssertionError(kind)

    def attack() -> int:
        tried = 0
        for cipher in (limits.CIPHER_AESGCM, limits.CIPHER_CHACHA20):
            for kind in ("body", "tag", "header", "short", "replay", "reorder"):
                peer = authenticated(daemon, cipher=cipher)
                with contextlib.closing(peer):
                    tamper(peer, kind)
                    assert peer.expect_abort() == ErrorCode.DECRYPT_FAILED, (cipher, kind)
                    tried += 1
        return tried

    await survives(
        daemon, attack, "tampered_frames", "DECRYPT_FAILED for flipped, cut, replayed, reordered"
    )


# -- flow control, memory and abrupt endings -------------------------------------------


async def test_client_that_stops_reading_a_flood(daemon: RunningExecd) -> None:
    def start_flood(streaming: bool) -> RawPeer:
        peer = authenticated(daemon, rcvbuf=16 * 1024)
        params = shell_rpc.RunParams(argv=["yes", "flood"], stream=streaming)
        peer.start(shell_rpc.RUN, params)
        return peer

    async def main() -> tuple[int, int]:
        before = daemon.rss_kib()
        samples: list[int] = []
        async with healthy(daemon) as client:
            peers = [await asyncio.to_thread(start_flood, streaming) for streaming in (True, False)]
            try:
                await eventually(
                    lambda: len(marked_matching(daemon.marker, "yes flood")) >= 2,
                    timeout=20,
                    what="both floods running",
                )
                for _ in range(16):
                    await asyncio.sleep(0.25)
                    samples.append(daemon.rss_kib())
                async with asyncio.timeout(10):
                    await client.noop()
            finally:
                for peer in peers:
                    peer.close()
            await no_marked(daemon.marker)
        growth = max(samples) - before
        assert growth < RSS_BOUND_KIB, (before, samples)
        return len(peers), growth

    tried, growth = await main()
    report(
        "flood_unread",
        tried,
        f"RSS grew at most {growth // 1024} MiB (bound {RSS_BOUND_KIB // 1024}), floods killed",
    )


async def test_abrupt_disconnects_mid_stream(daemon: RunningExecd, tmp_path: Path) -> None:
    target_dir = tmp_path / "uploads"
    target_dir.mkdir()
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(MIB) * 16)
    session = f"adv-{secrets.token_hex(4)}"

    def streaming_output(peer: RawPeer, index: int) -> None:
        call = peer.start(shell_rpc.RUN, shell_rpc.RunParams(argv=["yes", "rst"], stream=True))
        assert peer.read_stream(call, shell_rpc.STDOUT_STREAM, 256 * 1024) >= 256 * 1024

    def upload(peer: RawPeer, index: int) -> None:
        params = files_rpc.WriteParams(
            path=str(target_dir / f"up-{index}.bin"), stream=True, expected_size=8 * MIB
        )
        call = peer.start(files_rpc.WRITE, params)
        for seq in range(4):
            peer.send_message(
                Chunk(id=call, stream=files_rpc.DATA_STREAM, seq=seq, data=b"u" * (256 * 1024))
            )

    def download(peer: RawPeer, index: int) -> None:
        call = peer.start(files_rpc.READ, files_rpc.ReadParams(path=str(big), stream=True))
        assert peer.read_stream(call, files_rpc.DATA_STREAM, MIB) >= MIB

    def large_entry(peer: RawPeer, index: int) -> None:
        call_id = peer.start(ledger_rpc.HEAD, ledger_rpc.HeadParams(session=session))
        head = peer.wait_answer(call_id)
        assert isinstance(head, Reply)
        current = msgspec.msgpack.decode(head.result, type=ledger_rpc.LedgerHead)
        params = ledger_rpc.AppendLargeParams(
            session=session,
            seq=current.seq + 1,
            prev_hash=current.hash,
            size=4 * MIB,
            sha256=bytes(32),
        )
        call = peer.start(ledger_rpc.APPEND_LARGE, params)
        peer.send_message(Chunk(id=call, stream=ledger_rpc.DATA_STREAM, seq=0, data=b"L" * MIB))

    def stdin_feed(peer: RawPeer, index: int) -> None:
        params = shell_rpc.RunParams(argv=["cat"], stdin_stream=True)
        call = peer.start(shell_rpc.RUN, params)
        peer.send_message(Chunk(id=call, stream=shell_rpc.STDIN_STREAM, seq=0, data=b"in" * 1000))

    def attack() -> int:
        tried = 0
        for index in range(3):
            for action in (streaming_output, upload, download, large_entry, stdin_feed):
                cipher = limits.CIPHER_AESGCM if index % 2 else limits.CIPHER_NONE
                peer = authenticated(daemon, cipher=cipher)
                try:
                    action(peer, index)
                finally:
                    peer.reset()
                tried += 1
        return tried

    async def main() -> int:
        async with healthy(daemon) as client:
            before = await client.ledger_head(session)
            tried = await asyncio.to_thread(attack)
            await no_marked(daemon.marker)
            await eventually(
                lambda: not os.listdir(target_dir), what="no file left by an interrupted upload"
            )
            assert await client.ledger_head(session) == before
        return tried

    report("abrupt_disconnects", await main(), "RST mid-stream: commands killed, no torn files")


# -- dying daemon, full disk, many processes -------------------------------------------


@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """Make this process the reaper of orphans while the block runs (Linux prctl)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        pytest.skip("cannot become a child subreaper")
    try:
        yield
    finally:
        prctl(36, 0, 0, 0, 0)


def reap(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


async def test_execd_killed_mid_call(tmp_path: Path) -> None:
    async def main(running: RunningExecd) -> list[float]:
        client = await harnessd.connect(running.host, running.port, running.token)
        collected = asyncio.ensure_future(client.run(["sleep", "30"]))
        streaming = client.run_streaming(command="while :; do echo tick; sleep 0.05; done")

        async def follow() -> None:
            async for _ in streaming.output():
                pass

        following = asyncio.ensure_future(follow())
        deadline = time.monotonic() + 20
        while len(find_marked(MARKER_VAR, running.marker)) < 3:
            assert time.monotonic() < deadline, "the commands did not start"
            await asyncio.sleep(0.05)
        orphans = find_marked(MARKER_VAR, running.marker)
        killed_at = time.monotonic()
        os.kill(running.pid, signal.SIGKILL)
        elapsed: list[float] = []
        for task in (collected, following):
            with pytest.raises(errors.ConnectionLost):
                await asyncio.wait_for(task, timeout=10)
            elapsed.append(time.monotonic() - killed_at)
        with pytest.raises(errors.ConnectionLost):
            await asyncio.wait_for(client.noop(), timeout=10)
        await client.close()
        # Once the process is reaped its listening socket is gone: connecting fails fast.
        await asyncio.to_thread(running.proc.wait, 10)
        with pytest.raises(errors.ConnectFailed):
            await harnessd.connect(running.host, running.port, running.token, timeout=5)
        report_ = cleanup(MARKER_VAR, running.marker, timeout=10)
        assert report_.remaining == []
        reap(orphans)
        return elapsed

    with subreaper(), start_execd(tmp_path) as running:
        elapsed = await main(running)
    assert all(seconds < 1.0 for seconds in elapsed), elapsed
    report(
        "execd_sigkill",
        len(elapsed) + 2,
        f"ConnectionLost after {max(elapsed) * 1000:.0f} ms at most, no hang",
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
async def test_write_to_a_full_disk(daemon: RunningExecd, tmp_path: Path) -> None:
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")

    async def main() -> int:
        tried = 0
        keep = mount_point / "keep.txt"
        keep.write_bytes(b"original\n")
        payload = os.urandom(3 * MIB)

        async def blocks() -> AsyncIterator[bytes]:
            for offset in range(0, len(payload), 256 * 1024):
                yield payload[offset : offset + 256 * 1024]

        async with healthy(daemon) as client:
            attempts: list[Callable[[], Any]] = [
                lambda: client.write_file(str(mount_point / "new.bin"), payload),
                lambda: client.write_stream(str(mount_point / "streamed.bin"), blocks()),
                lambda: client.write_stream(
                    str(mount_point / "sized.bin"), blocks(), size=len(payload)
                ),
                lambda: client.write_file(str(keep), payload),
            ]
            for attempt in attempts:
                with pytest.raises(errors.NoSpace) as caught:
                    await attempt()
                assert caught.value.code == ErrorCode.NO_SPACE
                assert caught.value.data["errno"] in ("ENOSPC", "EDQUOT")
                tried += 1
            assert sorted(os.listdir(mount_point)) == ["keep.txt"]
            assert keep.read_bytes() == b"original\n"
            # The space of the failed writes was given back.
            await client.write_file(str(mount_point / "small.txt"), b"x" * (256 * 1024))
        await no_marked(daemon.marker)
        return tried

    try:
        tried = await main()
    finally:
        if subprocess.run(["umount", str(mount_point)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)
    report("full_disk", tried, "NoSpace (ENOSPC), no torn or temporary file")


async def test_fork_loop_and_the_process_limit(tmp_path: Path) -> None:
    limit = 4

    async def main(running: RunningExecd) -> int:
        tried = 0
        client = await harnessd.connect(running.host, running.port, running.token)
        try:
            await check_healthy(client)
            loop = client.run_streaming(
                command=(
                    "for i in $(seq 40); do sleep 300 & done; "
                    "for i in $(seq 10); do setsid sleep 301 </dev/null >/dev/null 2>&1 & done; "
                    "echo forked; wait"
                )
            )
            async for _, data in loop.output():
                if b"forked" in data:
                    break
            deadline = time.monotonic() + 20
            while len(marked_matching(running.marker, "sleep 30")) < 50:
                assert time.monotonic() < deadline, "the fork loop did not finish forking"
                await asyncio.sleep(0.05)
            tried += 1
            sleepers = [
                client.start(shell_rpc.RUN, shell_rpc.RunParams(argv=["sleep", "60"]))
                for _ in range(limit - 1)
            ]
            deadline = time.monotonic() + 20
            while len(marked_matching(running.marker, "sleep 60")) < limit - 1:
                assert time.monotonic() < deadline, "the sleepers did not start"
                await asyncio.sleep(0.05)
            attempts: list[Callable[[], Awaitable[Any]]] = [
                lambda: client.run(["true"]),
                lambda: client.run_detached(["true"]),
                lambda: client.run(command="echo one too many"),
            ]
            for attempt in attempts:
                with pytest.raises(errors.ProcessLimit) as caught:
                    await attempt()
                assert caught.value.code == ErrorCode.PROCESS_LIMIT
                assert caught.value.data == {"limit": limit}
                tried += 1
            loop.cancel()
            with pytest.raises(errors.Cancelled):
                await loop.result()
            # The loop's own group is gone; the setsid'd children escaped it ...
            deadline = time.monotonic() + 20
            while marked_matching(running.marker, "sleep 300"):
                assert time.monotonic() < deadline, "the fork loop's group survived cancel"
                await asyncio.sleep(0.05)
            assert len(marked_matching(running.marker, "sleep 301")) == 10
            # ... until the session's marker cleanup, which takes them all.
            closed = await client.cleanup(timeout=20)
            assert closed.remaining == [], closed
            assert closed.killed >= 10, closed
            for handle in sleepers:
                ended = await handle.result(shell_rpc.RunResult)
                assert ended.signal is not None, ended
            await no_marked(running.marker)
            await client.noop()
        finally:
            await client.close()
        return tried

    with start_execd(tmp_path, "--max-processes", str(limit)) as running:
        tried = await main(running)
    report("fork_loop_and_process_limit", tried, "PROCESS_LIMIT typed; 50 forks all killed")


# -- peers that vanish without a word --------------------------------------------------


async def test_a_blackholed_connection_is_given_up(tmp_path: Path) -> None:
    """A peer gone without FIN or RST: execd pings it, hears nothing, and closes its end.

    A TCP proxy between client and execd drops every byte from some point on
    and closes nothing, as a vanished route does; the proxy acknowledges what
    execd sends, so TCP itself never notices. A client that is alive but
    silent (it sends no keepalives of its own) answers execd's pings and keeps
    its connection, with a call running or not.
    """
    idle = 1.0

    async def main(running: RunningExecd) -> tuple[float, int]:
        proxy = await CutProxy(running.host, running.port).start()
        quiet = await harnessd.connect(running.host, running.port, running.token, keepalive=None)
        vanishing = await harnessd.connect("127.0.0.1", proxy.port, running.token, keepalive=None)
        try:
            await vanishing.noop()
            sleeper = quiet.start(shell_rpc.RUN, shell_rpc.RunParams(argv=["sleep", "60"]))
            await eventually(
                lambda: marked_matching(running.marker, "sleep 60"), what="the sleeper running"
            )
            # execd's own sockets on its port (the listener and its connections): what else it
            # opens meanwhile (a pidfd, a log) must not hide the one socket that goes.
            before = tcp_sockets_on(running.port)
            assert proxy.blackhole() == 1
            cut_at = time.monotonic()
            await eventually(
                lambda: proxy.closed_by_upstream == 1,
                timeout=10 * idle,
                interval=0.05,
                what="execd giving up the blackholed connection",
            )
            given_up = time.monotonic() - cut_at
            assert given_up >= idle * 0.75, given_up  # not before it went silent for long enough
            await eventually(
                lambda: tcp_sockets_on(running.port) < before,
                timeout=10,
                what="the connection's socket released",
            )
            # The live client, silent for many idle timeouts, is still served, and so is
            # the call it has running all along.
            await asyncio.sleep(3 * idle)
            async with asyncio.timeout(10):
                await quiet.noop()
            assert marked_matching(running.marker, "sleep 60")
            sleeper.cancel()
            with pytest.raises(errors.Cancelled):
                await sleeper.result()
            return given_up, proxy.closed_by_upstream
        finally:
            await vanishing.close()
            await quiet.close()
            await proxy.close()

    with start_execd(tmp_path, "--idle-timeout", str(idle), "--log-level", "INFO") as running:
        given_up, closed = await main(running)
        assert "giving it up" in running.log()
    report("blackholed_peer", closed, f"given up {given_up:.1f} s after it went silent")
