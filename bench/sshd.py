"""OpenSSH's sshd for the bench: on loopback, its config and keys in a directory of its own.

Theory of operation
-------------------

:func:`start_sshd` runs the sshd of the machine (Debian: ``openssh-server``)
as the user the bench runs as, until its block exits:

1. **The user.** sshd runs every command as ``$SHELL -c COMMAND`` through the
   user's login shell; a user whose shell cannot run one (``nologin``,
   ``false``) makes :class:`SshdUnavailable`, and the section says why.
2. **The directory** (``bench-sshd-*`` under the scratch directory, 0700):
   a fresh ed25519 host key (0600), ``authorized_keys`` with the public half
   of a fresh client key (the private half stays in this process),
   ``sshd_config``, sshd's log, and ``home/``, an empty directory that
   ``SetEnv`` makes the ``HOME`` of every session. bash run by sshd reads
   ``~/.bashrc`` even when it is not interactive, so with the user's own
   ``HOME`` one ``.bashrc`` would be timed with every command;
   :func:`bench.ssh_peer` checks the empty ``HOME`` before it measures.
   ``PermitUserRC no`` keeps ``~/.ssh/rc`` out too.
3. **The port.** sshd cannot listen on a port the kernel picks and say which,
   so the bench asks the kernel for a free one (bind port 0, close) and hands
   it over; if something took it meanwhile sshd exits with "Address already
   in use" and the bench tries another, a few times.
4. **Ready** when sshd's log says ``Server listening on``; failed when sshd
   exits first (its last log lines are the reason) or takes too long.
5. **Stop**, also when a signal cancels the run: the processes sshd started
   for connections are noted (by pidfd, so a reused pid is never signalled),
   sshd gets SIGTERM (SIGKILL after a grace period), then so does each of
   those still running; then the directory is removed.

As root, sshd separates privileges: each connection's pre-authentication
child chroots into ``/run/sshd``, which Debian's ssh service creates when it
starts; the bench creates it (root's, 0755) when it is missing, as the
service would, and leaves it. As another user sshd can only log in that
user, runs without PAM (``UsePAM no``) and does not judge the modes of its
files (``StrictModes no``: the scratch directory's parents are not root's).
sshd is started with its parent-death signal set (``setpriv --pdeathsig``,
when util-linux has it), so a bench killed outright leaves no listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Final

from bench.execd_proc import stop_process
from bench.settings import HOST
from execd.procfs import read_stat

if TYPE_CHECKING:
    import asyncssh

#: Where Debian and most others install sshd when it is not on PATH (a user's PATH may lack sbin).
SSHD_PLACES: Final = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
#: The chroot of sshd's pre-authentication child when it runs as root (Debian's build).
PRIVSEP_DIR: Final = "/run/sshd"
PORT_ATTEMPTS: Final = 5
READY_TIMEOUT: Final = 20.0
STOP_GRACE: Final = 5.0
_LISTENING: Final = re.compile(rb"Server listening on \S+ port (\d+)")
#: Characters sshd_config (quoting, ``%`` tokens) cannot carry in a path.
_UNSAFE_PATH: Final = re.compile(r'["%\s\\]')


class SshdUnavailable(Exception):
    """sshd cannot be run here; the message says why."""


@dataclass(frozen=True, slots=True)
class Sshd:
    """A running sshd: where it listens, who it logs in, the keys to reach it."""

    host: str
    port: int
    user: str
    directory: str
    home: str
    pid: int
    client_key: asyncssh.SSHKey
    host_key: asyncssh.SSHKey

    async def connect(self) -> asyncssh.SSHClientConnection:
        """A new connection, authenticated with the client key; no config file, agent or GSSAPI."""
        import asyncssh

        return await asyncssh.connect(
            self.host,
            self.port,
            username=self.user,
            client_keys=[self.client_key],
            known_hosts=([self.host_key], [], []),
            config=None,
            agent_path=None,
            gss_auth=False,
            gss_kex=False,
            password_auth=False,
            kbdint_auth=False,
            connect_timeout=30,
        )

    async def time_connect(self) -> float:
        """Microseconds to connect and authenticate; then close, and wait for sshd's side to end.

        Each connection has processes of its own in sshd (forked, re-executed,
        privilege-separated); the next call timed must not share the CPU with
        their ending, so this returns once they are gone (by pidfd).
        """
        before = {pid for pid, _ in descendants(self.pid)}
        started = time.perf_counter_ns()
        conn = await self.connect()
        elapsed = time.perf_counter_ns() - started
        handles = _pidfds([child for child in descendants(self.pid) if child[0] not in before])
        try:
            conn.close()
            await conn.wait_closed()
            await _exited(handles, STOP_GRACE)
        finally:
            for fd in handles:
                os.close(fd)
        return elapsed / 1000


def find_sshd(explicit: str | None = None) -> str:
    """The sshd to run: ``explicit``, else sshd on PATH, else the usual places."""
    if explicit is not None:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return os.path.abspath(explicit)
        raise SshdUnavailable(f"{explicit} is not an executable file")
    for candidate in (shutil.which("sshd"), *SSHD_PLACES):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            # sshd re-executes itself for each connection, by an absolute path.
            return os.path.abspath(candidate)
    raise SshdUnavailable("sshd is not installed (Debian: apt-get install openssh-server)")


def sshd_version(path: str) -> str:
    """``OpenSSH_9.2`` or so, from ``sshd -V`` (older ones print it with their usage)."""
    try:
        done = subprocess.run(
            [path, "-V"], capture_output=True, timeout=10, check=False, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return "OpenSSH (version unknown)"
    found = re.search(rb"OpenSSH_[\w.]+", done.stderr + done.stdout)
    return found.group().decode() if found else "OpenSSH (version unknown)"


def login_user() -> str:
    """The name of the user this process runs as; unavailable without a login shell for commands."""
    entry = pwd.getpwuid(os.geteuid())
    shell = entry.pw_shell or "/bin/sh"
    if os.path.basename(shell) in ("nologin", "false") or not os.access(shell, os.X_OK):
        raise SshdUnavailable(
            f"the login shell of {entry.pw_name} is {shell}, which cannot run sshd's commands"
        )
    return entry.pw_name


@contextlib.asynccontextmanager
async def start_sshd(sshd: str, scratch: str) -> AsyncIterator[Sshd]:
    """Run ``sshd`` on loopback with a directory of its own under ``scratch`` until the block exits."""
    user = login_user()
    directory, host_key, client_key = _prepare(scratch)
    try:
        proc, port = await _listen(sshd, directory, user)
        try:
            yield Sshd(
                host=HOST,
                port=port,
                user=user,
                directory=directory,
                home=os.path.join(directory, "home"),
                pid=proc.pid,
                client_key=client_key,
                host_key=host_key.convert_to_public(),
            )
        finally:
            await _stop(proc)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _prepare(scratch: str) -> tuple[str, asyncssh.SSHKey, asyncssh.SSHKey]:
    """The directory with the keys and the empty home in it; the host and client keys."""
    import asyncssh

    if _UNSAFE_PATH.search(scratch):
        raise SshdUnavailable(f"sshd_config cannot name paths under {scratch!r}; use --tmp")
    if os.geteuid() == 0 and not os.path.isdir(PRIVSEP_DIR):
        os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="bench-sshd-", dir=scratch)
    try:
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        client_key = asyncssh.generate_private_key("ssh-ed25519")
        _write(os.path.join(directory, "host_key"), host_key.export_private_key())
        _write(os.path.join(directory, "authorized_keys"), client_key.export_public_key())
        os.mkdir(os.path.join(directory, "home"), 0o700)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, host_key, client_key


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _open_log(path: str) -> BinaryIO:
    return open(path, "wb")


def config_text(directory: str, user: str, port: int) -> str:
    """The sshd_config of a bench sshd: key authentication only, the empty HOME, internal SFTP."""
    return "\n".join(
        (
            f"ListenAddress {HOST}:{port}",
            f'HostKey "{directory}/host_key"',
            "PidFile none",
            f'AuthorizedKeysFile "{directory}/authorized_keys"',
            f"AllowUsers {user}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",
            f'SetEnv "HOME={directory}/home"',
            "PermitUserRC no",
            "PermitUserEnvironment no",
            "PrintMotd no",
            "PrintLastLog no",
            "UseDNS no",
            "X11Forwarding no",
            "Subsystem sftp internal-sftp",
            # "Server listening on" is logged at VERBOSE.
            "LogLevel VERBOSE",
            "",
        )
    )


async def _listen(sshd: str, directory: str, user: str) -> tuple[asyncio.subprocess.Process, int]:
    config = os.path.join(directory, "sshd_config")
    log_path = os.path.join(directory, "sshd.log")
    reason = ""
    for _ in range(PORT_ATTEMPTS):
        port = _free_port()
        _write(config, config_text(directory, user, port).encode())
        with _open_log(log_path) as log:
            proc = await asyncio.create_subprocess_exec(
                *_pdeathsig(),
                sshd,
                "-D",
                "-e",
                "-f",
                config,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=directory,
            )
        try:
            if await _ready(proc, log_path, port):
                return proc, port
        except BaseException:
            await stop_process(proc, STOP_GRACE)
            raise
        reason = _tail(log_path)
        if "Address already in use" not in reason:
            break
    raise SshdUnavailable(f"sshd did not start: {reason or 'no log'}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _pdeathsig() -> tuple[str, ...]:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    return (setpriv, "--pdeathsig", "TERM", "--")


async def _ready(proc: asyncio.subprocess.Process, log_path: str, port: int) -> bool:
    """True once sshd listens on ``port``; False when it exits first; unavailable on a timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT
    exited = asyncio.ensure_future(proc.wait())
    try:
        while True:
            if _listening_port(log_path) == port:
                return True
            if exited.done():
                return False
            if loop.time() > deadline:
                await stop_process(proc, STOP_GRACE)
                raise SshdUnavailable(
                    f"sshd did not listen within {READY_TIMEOUT:g} s: {_tail(log_path)}"
                )
            # Its log is a file (a pipe would need draining for the whole run): look again soon.
            await asyncio.wait({exited}, timeout=0.01)
    finally:
        if not exited.done():
            exited.cancel()


def _listening_port(log_path: str) -> int | None:
    with open(log_path, "rb") as log:
        found = _LISTENING.search(log.read())
    return int(found.group(1)) if found else None


def _tail(log_path: str) -> str:
    try:
        with open(log_path, "rb") as log:
            lines = log.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return ""
    return " / ".join(lines[-3:])


async def _stop(proc: asyncio.subprocess.Process) -> None:
    handles = _pidfds(descendants(proc.pid))
    try:
        await stop_process(proc, STOP_GRACE)
        await _end(handles)
    finally:
        for fd in handles:
            os.close(fd)


def descendants(root: int) -> list[tuple[int, int]]:
    """The processes below ``root`` in the process tree, as (pid, start time) pairs."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = read_stat(entry)
        if stat is not None and stat.alive:
            children.setdefault(stat.ppid, []).append((int(entry), stat.start))
    found: list[tuple[int, int]] = []
    frontier = [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child[0])
    return found


def _pidfds(processes: list[tuple[int, int]]) -> list[int]:
    """A pidfd for each process still the one that was seen (same start time)."""
    handles = []
    for pid, start in processes:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        stat = read_stat(pid)
        if stat is None or stat.start != start:
            os.close(fd)
            continue
        handles.append(fd)
    return handles


async def _end(handles: list[int]) -> None:
    """SIGTERM each process of ``handles``, SIGKILL those still running after the grace period."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        running = [fd for fd in handles if _running(fd)]
        if not running:
            return
        for fd in running:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signum)
        await _exited(running, STOP_GRACE)


def _running(pidfd: int) -> bool:
    """Whether the process has not exited yet (its pidfd reads ready once it has)."""
    return not select.select([pidfd], [], [], 0)[0]


async def _exited(handles: list[int], timeout: float) -> None:
    """Wait until every process of ``handles`` has exited, ``timeout`` seconds at most."""
    loop = asyncio.get_running_loop()
    waits: list[asyncio.Future[None]] = []
    for fd in handles:
        done: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _settle, done)
        waits.append(done)
    try:
        await asyncio.wait(waits, timeout=timeout)
    finally:
        for fd in handles:
            loop.remove_reader(fd)


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)
