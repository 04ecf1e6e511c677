"""The kit's one module that does I/O: TCP connections to a live server, and launching it.

:class:`SocketTarget` is a :class:`~protocol.fuzz.link.Target` for any server
that speaks PROTOCOL.md over TCP. :class:`Launched` starts a server from a
command line (for ``--launch``), waits until it accepts connections, and
starts it again after a crash, so one run can go on past a case that killed
the server. Everything else in :mod:`protocol.fuzz` stays free of sockets and
processes, like the rest of :mod:`protocol`.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import time
from pathlib import Path

from protocol.fuzz.link import LinkClosed


class SocketLink:
    """One TCP connection."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._closed = False

    def send(self, data: bytes) -> None:
        """Write ``data``; :class:`~protocol.fuzz.link.LinkClosed` when the server has gone."""
        if self._closed:
            raise LinkClosed("the connection is closed")
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise LinkClosed(str(exc)) from None

    def recv(self, timeout: float) -> bytes | None:
        """Bytes within ``timeout`` seconds; ``b""`` at end of stream (or reset), None if none."""
        if self._closed:
            return b""
        self._sock.settimeout(max(timeout, 0.0001))
        try:
            return self._sock.recv(1 << 20)
        except TimeoutError:
            return None
        except OSError:
            return b""

    def close(self, reset: bool = False) -> None:
        """Close; with ``reset`` the kernel sends RST instead of FIN."""
        if self._closed:
            return
        self._closed = True
        if reset:
            with contextlib.suppress(OSError):
                linger = struct.pack("ii", 1, 0)
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        self._sock.close()


class SocketTarget:
    """A server at ``host:port``."""

    def __init__(self, host: str, port: int, connect_timeout: float = 5.0) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.name = f"{host}:{port}"

    def connect(self) -> SocketLink:
        """A new TCP connection (no delay on small writes)."""
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return SocketLink(sock)

    def reachable(self, timeout: float) -> bool:
        """Whether a TCP connection opens within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=1.0):
                    return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)


class Launched:
    """A server the kit starts itself from ``command``, on the target's address.

    ``log``: where its standard output and error go (appended across
    restarts); otherwise they are discarded.
    """

    def __init__(self, command: list[str], target: SocketTarget, log: Path | None = None) -> None:
        self.command = command
        self.target = target
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 30.0) -> int:
        """Start the server and wait until it accepts connections; return its pid."""
        self.stop()
        out = open(self.log, "ab") if self.log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )
        finally:
            if self.log is not None and not isinstance(out, int):
                out.close()
        self.starts += 1
        deadline = time.monotonic() + timeout
        while not self.target.reachable(0.2):
            if not self.alive() or time.monotonic() > deadline:
                code = self.process.poll()
                self.stop()
                raise RuntimeError(f"the launched server did not come up (exit status {code})")
        assert self.process is not None
        return self.process.pid

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL); return its exit status."""
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode
