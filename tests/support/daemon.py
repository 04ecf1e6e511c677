"""Start a real execd subprocess for a test and always tear it down."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import terminate


@dataclass
class RunningExecd:
    """A live execd: where it listens, its token and marker, and its process."""

    host: str
    port: int
    token: str
    marker: str
    pid: int
    proc: subprocess.Popen[bytes]
    state_dir: Path
    stderr_path: Path

    def log(self) -> str:
        """What execd wrote to stderr so far."""
        return self.stderr_path.read_text(errors="replace")

    def rss_kib(self) -> int:
        """execd's resident set size in KiB, from /proc."""
        with open(f"/proc/{self.pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0


def _read_announcement(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, object]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        try:
            chunk = os.read(proc.stdout.fileno(), 4096)
        except BlockingIOError:
            chunk = None
        if chunk:
            buf += chunk
            if b"\n" in buf:
                line = buf.split(b"\n", 1)[0]
                event: dict[str, object] = json.loads(line)
                return event
        elif chunk == b"" or proc.poll() is not None:
            if buf:
                event = json.loads(buf.split(b"\n", 1)[0])
                return event
            raise RuntimeError(f"execd exited with {proc.poll()} before announcing")
        else:
            time.sleep(0.005)
    raise TimeoutError("execd did not announce within the timeout")


@contextlib.contextmanager
def start_execd(
    tmp_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 15.0,
    token_file_text: str | None = None,
    prefix: Sequence[str] = (),
) -> Iterator[RunningExecd]:
    """Run ``python -m execd`` with a fresh token file; kill it and its marker on exit.

    ``token_file_text``: what the token file holds, when not exactly the token
    (``"{token}"`` in it stands for the token). ``prefix``: a command that
    execs the rest of its argv (``unshare ...``), run in front of execd's.
    """
    token = secrets.token_hex(32)
    state_dir = tmp_path / "execd-state"
    token_file = tmp_path / f"token-{secrets.token_hex(4)}"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token if token_file_text is None else token_file_text.format(token=token))
    marker = secrets.token_hex(16)
    stderr_path = tmp_path / f"execd-{marker[:8]}.log"
    child_env = dict(os.environ)
    child_env.pop("EXECD_TOKEN", None)
    if env:
        child_env.update(env)
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "execd",
                "--token-file",
                str(token_file),
                "--marker",
                marker,
                "--state-dir",
                str(state_dir),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=child_env,
            cwd=str(tmp_path),
        )
    try:
        event = _read_announcement(proc, timeout)
        if event.get("event") != "listening":
            raise RuntimeError(f"execd did not start: {event}\n{stderr_path.read_text()}")
        port = event["port"]
        assert isinstance(port, int)
        yield RunningExecd(
            host=str(event["host"]),
            port=port,
            token=token,
            marker=marker,
            pid=proc.pid,
            proc=proc,
            state_dir=state_dir,
            stderr_path=stderr_path,
        )
    finally:
        terminate(proc)
        if proc.stdout is not None:
            proc.stdout.close()
        kill_marked(marker)


def kill_marked(marker: str) -> int:
    """Last-resort sweep after a test: kill anything of ours still carrying ``marker``."""
    from execd.marker import cleanup

    return cleanup("EXECD_MARKER", marker, timeout=5.0).killed
