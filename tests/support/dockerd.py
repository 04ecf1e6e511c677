"""A Docker daemon of the test's own, that touches nothing it does not remove again.

Theory of operation
-------------------
:func:`private_dockerd` starts Debian's ``dockerd`` (package ``docker.io``)
with everything of its own under a fresh directory: ``--data-root``,
``--exec-root``, ``--pidfile`` and the API socket, and containers' cgroups
under a parent named for the run. It leaves the host's network alone:
``--iptables=false --ip6tables=false`` (no firewall rules) and
``--bridge=none`` (no ``docker0``), so containers use ``--network host`` and
the harness reaches execd on loopback. Network-namespace tests running beside
it see no change.

Teardown, in reverse: every container removed, the daemon stopped (SIGTERM,
then SIGKILL after a grace) with the ``containerd`` it started, any mount
left under its directories unmounted, its cgroups and the directories it
made outside its own (``/run/docker``, ``/run/containerd`` when they were not
there before) removed, and its directory deleted. :func:`leftovers` lists
what is still there (processes, mounts, cgroups, directories, links); the
fixture fails the run when it is not empty.

Every failure to start raises :class:`~tests.support.worker_build.Unavailable`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.worker_build import Unavailable

CGROUP_ROOT = Path("/sys/fs/cgroup")
_HOST_DIRS = (Path("/run/docker"), Path("/run/containerd"))
_START_TIMEOUT = 60.0
_STOP_GRACE = 20.0


@dataclass
class Dockerd:
    """A running private daemon: ``docker`` is the client argv that talks to it."""

    root: Path
    pid: int
    cgroup_parent: str
    docker: tuple[str, ...]
    made: list[Path] = field(default_factory=list)

    def run(self, *args: str, stdin: bytes | None = None, timeout: float = 120.0) -> str:
        """``docker ARGS...`` against this daemon; its stdout (AssertionError on failure)."""
        result = subprocess.run(
            [*self.docker, *args], input=stdin, capture_output=True, timeout=timeout, check=False
        )
        assert result.returncode == 0, (
            f"docker {' '.join(args[:3])} failed: {result.stderr.decode(errors='replace')}"
        )
        return result.stdout.decode(errors="replace")

    def import_tar(self, tarball: Path, tag: str) -> str:
        """``docker import`` of a root filesystem tarball as image ``tag``."""
        with tarball.open("rb") as handle:
            self.run("import", "-", tag, stdin=handle.read(), timeout=600)
        return tag


def _docker_client() -> str:
    # Debian's own client matches its daemon; another one on PATH negotiates down.
    for candidate in ("/usr/bin/docker", shutil.which("docker")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise Unavailable("no docker client (apt-get install docker.io)")


def _mounts_under(root: Path) -> list[str]:
    found = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            point = line.split()[4].replace("\\040", " ")
            if point == str(root) or point.startswith(f"{root}/"):
                found.append(point)
    return found


def _cgroups(parent: str) -> list[Path]:
    name = parent.strip("/")
    return sorted(CGROUP_ROOT.glob(f"*/{name}")) + sorted(CGROUP_ROOT.glob(name))


def _remove_cgroup(path: Path) -> None:
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if child.is_dir():
            with contextlib.suppress(OSError):
                child.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()


def _processes_under(root: Path) -> list[int]:
    found = []
    needle = str(root).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
    return found


def leftovers(daemon: Dockerd) -> list[str]:
    """What the daemon left on the host after teardown (empty when nothing)."""
    left = [f"process {pid}" for pid in _processes_under(daemon.root)]
    left += [f"mount {point}" for point in _mounts_under(daemon.root)]
    left += [f"cgroup {path}" for path in _cgroups(daemon.cgroup_parent)]
    left += [f"directory {path}" for path in (daemon.root, *daemon.made) if path.exists()]
    if Path("/sys/class/net/docker0").exists():
        left.append("link docker0")
    return left


def _wait_for_socket(socket: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise Unavailable(f"dockerd exited with status {proc.returncode}: {tail}")
        if socket.exists():
            return
        time.sleep(0.1)
    raise Unavailable(f"dockerd did not open its socket within {_START_TIMEOUT:g} s")


def _stop(daemon: Dockerd, proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(Exception):
        ids = subprocess.run(
            [*daemon.docker, "ps", "-aq"], capture_output=True, text=True, timeout=60, check=False
        ).stdout.split()
        if ids:
            subprocess.run([*daemon.docker, "rm", "-f", *ids], capture_output=True, timeout=120)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(_STOP_GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in _processes_under(daemon.root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for point in sorted(_mounts_under(daemon.root), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    for path in _cgroups(daemon.cgroup_parent):
        _remove_cgroup(path)
    shutil.rmtree(daemon.root, ignore_errors=True)
    for path in daemon.made:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def private_dockerd() -> Iterator[Dockerd]:
    """Start a private dockerd; stop it and remove everything it made afterwards."""
    if os.geteuid() != 0:
        raise Unavailable("dockerd needs root")
    dockerd = shutil.which("dockerd") or (
        "/usr/sbin/dockerd" if Path("/usr/sbin/dockerd").exists() else None
    )
    if dockerd is None:
        raise Unavailable("dockerd is not installed (apt-get install docker.io)")
    client = _docker_client()
    made = [path for path in _HOST_DIRS if not path.exists()]
    # Short: the socket path must fit in sun_path.
    root = Path(tempfile.mkdtemp(prefix="sxd-", dir="/tmp"))
    socket = root / "docker.sock"
    parent = f"/splitexec-test-{secrets.token_hex(4)}"
    log = root / "dockerd.log"
    argv = [
        dockerd,
        "--iptables=false",
        "--ip6tables=false",
        "--bridge=none",
        "--data-root",
        str(root / "data"),
        "--exec-root",
        str(root / "exec"),
        "--pidfile",
        str(root / "dockerd.pid"),
        "--host",
        f"unix://{socket}",
        "--cgroup-parent",
        parent,
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    daemon = Dockerd(root, proc.pid, parent, (client, "-H", f"unix://{socket}"), made)
    try:
        _wait_for_socket(socket, proc, log)
        deadline = time.monotonic() + _START_TIMEOUT
        while subprocess.run([*daemon.docker, "info"], capture_output=True, check=False).returncode:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise Unavailable(
                    f"dockerd does not answer: {log.read_text(errors='replace')[-2000:]}"
                )
            time.sleep(0.2)
        yield daemon
    finally:
        _stop(daemon, proc)
