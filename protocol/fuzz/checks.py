"""What the kit checks after every case: the server still serves, and left nothing behind.

* :func:`health` -- a fresh, well-behaved client is served within a bound:
  with the token a full handshake, a Ping and a ``server.noop``; without it a
  Hello answered by a Challenge.
* :class:`LocalServer` -- when the server runs on this machine (a pid given,
  or found listening on the target's port), its descriptors and resident
  memory, read from ``/proc``, against a baseline; and the processes still
  carrying its session marker (``NAME=VALUE`` in their environment, as
  execd marks everything it starts).

Only ``/proc`` is read here; the connections go through the target.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from protocol.fuzz import script as s
from protocol.fuzz.interpreter import PASS, Session
from protocol.fuzz.link import Target

_LISTEN: Final = "0A"
#: Seconds a descriptor count above the baseline must hold still to be taken as it is.
STEADY: Final = 0.25
_ENVIRON_CAP: Final = 1 << 20


def health_script(with_token: bool) -> s.Script:
    """What a healthy client does: with the token a handshake, a Ping and a noop call."""
    if not with_token:
        hello = {
            "t": "hello",
            "versions": [1],
            "nonce": {"$bin": os.urandom(32).hex()},
            "ciphers": ["none", "aes-256-gcm", "chacha20-poly1305"],
            "max_frame": 1 << 20,
            "window": 1 << 20,
        }
        return s.script(s.Connect(), s.Send(body=hello), s.Expect(want=s.ChallengeWant()))
    return s.script(
        s.Connect(),
        s.Handshake(),
        s.Expect(want=s.AliveWant()),
        s.Send(body={"t": "call", "id": 1, "method": "server.noop"}),
        s.Expect(want=s.ReplyWant(id=1)),
    )


def health(target: Target, token: bytes | None, timeout: float) -> str | None:
    """None when a healthy client is served within ``timeout``; else what went wrong."""
    session = Session(target, token, timeout)
    outcome = session.run(health_script(token is not None))
    if outcome.verdict == PASS:
        return None
    first = outcome.findings[0].text if outcome.findings else "no answer"
    return f"a healthy client was not served: {first}"


def _proc(path: str) -> Path:
    return Path("/proc") / path


def listening_pid(port: int) -> int | None:
    """The pid of the local process listening on TCP ``port``, if this machine has one."""
    inodes: set[str] = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = _proc(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in _proc("").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return int(entry.name)
        except OSError:
            continue
    return None


@dataclass
class Usage:
    """A server's descriptors and resident memory at one moment."""

    descriptors: int
    rss_kib: int


class LocalServer:
    """A server process on this machine, watched through ``/proc``.

    ``marker``: ``NAME=VALUE``, the environment entry every process the server
    starts carries (execd's session marker), or None to skip that check.
    """

    def __init__(self, pid: int, marker: str | None = None) -> None:
        self.pid = pid
        self.marker = marker
        self.baseline: Usage | None = None

    def alive(self) -> bool:
        """Whether the process exists (and is not a zombie)."""
        try:
            stat = _proc(f"{self.pid}/stat").read_bytes()
        except OSError:
            return False
        return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")

    def usage(self) -> Usage:
        """Descriptors and resident memory now."""
        descriptors = len(os.listdir(_proc(f"{self.pid}/fd")))
        rss = 0
        for line in _proc(f"{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
        return Usage(descriptors, rss)

    def settle(self, seconds: float) -> Usage:
        """Usage once descriptors are back to the baseline, or steady above it, or after ``seconds``.

        Steady: the same count for :data:`STEADY` seconds (the server has had
        the time to close the connections of the case).
        """
        deadline = time.monotonic() + seconds
        since, last = time.monotonic(), -1
        while True:
            now = self.usage()
            base = self.baseline
            if base is None or now.descriptors <= base.descriptors or time.monotonic() > deadline:
                return now
            if now.descriptors != last:
                since, last = time.monotonic(), now.descriptors
            elif time.monotonic() - since >= STEADY:
                return now
            time.sleep(0.02)

    def marked(self) -> list[int]:
        """Pids of live processes carrying the marker (the server itself and this one excepted)."""
        if not self.marker:
            return []
        entry = self.marker.encode()
        found = []
        for proc in _proc("").iterdir():
            if not proc.name.isdigit() or int(proc.name) in (self.pid, os.getpid()):
                continue
            try:
                with open(proc / "environ", "rb") as handle:
                    environ = handle.read(_ENVIRON_CAP)
                stat = (proc / "stat").read_bytes()
            except OSError:
                continue
            if entry in environ.split(b"\0") and stat[stat.rfind(b")") + 2 :][:1] != b"Z":
                found.append(int(proc.name))
        return sorted(found)

    def wait_unmarked(self, seconds: float) -> list[int]:
        """Marked processes still there after up to ``seconds`` (empty when all went)."""
        deadline = time.monotonic() + seconds
        while True:
            left = self.marked()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)
