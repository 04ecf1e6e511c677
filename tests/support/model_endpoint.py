"""A local OpenAI-compatible chat-completions server for tests, and a forward proxy to reach it.

:class:`ModelEndpoint` serves ``POST`` on loopback (plain HTTP, or HTTPS with
a throwaway certificate from :func:`self_signed`, shared with the bench). Each request is recorded
(:class:`Seen`) and answered from the queue :attr:`ModelEndpoint.answers`
(status, headers, body, chunked or not, after an optional delay), or, when
the queue is empty, by :meth:`ModelEndpoint.answer`, which subclasses
override to script a conversation. It counts the TCP connections it
accepted, so keep-alive can be checked.

:class:`ForwardProxy` is an HTTP proxy on loopback: absolute-form requests
(``POST http://host:port/path``) are forwarded, ``CONNECT host:port`` is
tunnelled; it records both.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import socketserver
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

from bench.tls import self_signed

__all__ = [
    "Answer",
    "ForwardProxy",
    "ModelEndpoint",
    "Seen",
    "completion",
    "self_signed",
    "tool_call",
]


def completion(
    content: str | None = None,
    calls: list[dict[str, Any]] | None = None,
    *,
    finish_reason: str | None = None,
) -> bytes:
    """A chat completion body: an assistant message with ``content`` and tool ``calls``."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    body = {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason or ("tool_calls" if calls else "stop"),
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }
    return json.dumps(body).encode()


def tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One tool call of a completion, in the wire shape."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


@dataclass
class Answer:
    """What the endpoint sends for one request."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False
    delay: float = 0.0


@dataclass
class Seen:
    """One request as the endpoint received it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float


def _serve(server: socketserver.BaseServer) -> threading.Thread:
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    )
    thread.start()
    return thread


class _Served:
    """A server answering from a daemon thread until :meth:`close` (also a context manager)."""

    server: socketserver.TCPServer
    thread: threading.Thread

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ModelEndpoint(_Served):
    """A chat-completions server on 127.0.0.1:0 (see the module docstring).

    ``tls``: (certificate file, key file) to serve HTTPS with.
    """

    def __init__(self, tls: tuple[Path, Path] | None = None) -> None:
        self.answers: list[Answer] = []
        self.seen: list[Seen] = []
        self.connections = 0
        self.closed = threading.Event()
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                with outer._lock:
                    outer.connections += 1
                super().setup()

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length)
                seen = Seen(
                    path=self.path,
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=json.loads(raw),
                    at=time.monotonic(),
                )
                with outer._lock:
                    outer.seen.append(seen)
                    queued = outer.answers.pop(0) if outer.answers else None
                answer = queued if queued is not None else outer.answer(seen)
                if answer.delay and outer.closed.wait(answer.delay):
                    return
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/json")
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                if answer.chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for start in range(0, len(answer.body), 7):
                        piece = answer.body[start : start + 7]
                        self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.send_header("Content-Length", str(len(answer.body)))
                    self.end_headers()
                    self.wfile.write(answer.body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.scheme = "http"
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        self.thread = _serve(self.server)

    @property
    def port(self) -> int:
        port: int = self.server.server_address[1]
        return port

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/v1"

    def answer(self, seen: Seen) -> Answer:
        """The answer when the queue is empty (default: a final text answer)."""
        return Answer(200, completion("done"))

    def close(self) -> None:
        self.closed.set()
        super().close()


class ForwardProxy(_Served):
    """An HTTP forward proxy on 127.0.0.1:0 (absolute-form requests and CONNECT tunnels).

    Absolute-form requests are rewritten to origin form and sent on a fresh
    upstream connection, one request per client connection (the proxy
    answers ``Connection: close``). :attr:`requests` holds each request line
    as received, :attr:`tunnels` each CONNECT target.
    """

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.tunnels: list[str] = []
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(65536).decode("latin-1").rstrip("\r\n")
                headers: list[str] = []
                while True:
                    header = self.rfile.readline(65536).decode("latin-1").rstrip("\r\n")
                    if not header:
                        break
                    headers.append(header)
                method, target, version = line.split(" ", 2)
                if method == "CONNECT":
                    outer.tunnels.append(target)
                    # The client waits for the 200 before it sends more, so nothing is buffered.
                    outer._tunnel(self.connection, target)
                    return
                outer.requests.append(line)
                outer._forward(self, method, target, version, headers)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = _serve(self.server)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _tunnel(self, client: socket.socket, target: str) -> None:
        host, _, port = target.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as upstream:
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            _pipe(client, upstream)

    def _forward(
        self,
        handler: socketserver.StreamRequestHandler,
        method: str,
        target: str,
        version: str,
        headers: list[str],
    ) -> None:
        rest = target.split("://", 1)[1]
        authority, _, path = rest.partition("/")
        host, _, port = authority.rpartition(":")
        length = 0
        kept: list[str] = []
        for header in headers:
            name, _, value = header.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
            if name.strip().lower() in ("proxy-connection", "connection"):
                continue
            kept.append(header)
        body = handler.rfile.read(length)
        head = f"{method} /{path} {version}\r\n" + "".join(f"{h}\r\n" for h in kept)
        head += "Connection: close\r\n\r\n"
        with socket.create_connection((host, int(port)), timeout=10) as upstream:
            upstream.sendall(head.encode("latin-1") + body)
            reply = upstream.makefile("rb")
            status = reply.readline(65536)
            handler.wfile.write(status)
            reply_length = 0
            while True:
                header_line = reply.readline(65536)
                name, _, value = header_line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    reply_length = int(value)
                if name.strip().lower() == "connection":
                    continue
                if header_line in (b"\r\n", b"\n", b""):
                    handler.wfile.write(b"Connection: close\r\n\r\n")
                    break
                handler.wfile.write(header_line)
            handler.wfile.write(reply.read(reply_length))
            handler.wfile.flush()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Relay bytes both ways until either side closes."""
    sockets = [a, b]
    while True:
        readable, _, _ = select.select(sockets, [], [], 30)
        if not readable:
            return
        for sock in readable:
            with contextlib.suppress(OSError):
                data = sock.recv(65536)
                if data:
                    (b if sock is a else a).sendall(data)
                    continue
            return
