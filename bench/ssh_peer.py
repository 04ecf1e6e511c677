"""Section 13: OpenSSH, what most would pick to run commands and move files in a VM, beside execd.

The machine's sshd (Debian: ``openssh-server``) runs on loopback with its
own config, host key and authorized key in a temporary directory
(:mod:`bench.sshd`), as the user the bench runs as. The client is asyncssh
(in the ``bench`` extra) on the bench's uvloop, over one persistent
connection, and an execd of its own is timed beside it in interleaved
batches, operation by operation:

* ``true`` as a command: a new session channel per command (sshd runs it as
  ``$SHELL -c true``) beside ``shell.run(["true"])``;
* a 4 KiB file read over one SFTP session (open, read, close) beside
  ``files.read``;
* a 4 KiB file written in place then read back over SFTP beside
  ``files.write`` (``atomic=False``: SFTP writes in place without fsync) and
  ``files.read``;
* a 1 MiB file read over SFTP beside ``files.read``;
* connect and authenticate: a new SSH connection (TCP, key exchange, host
  key check, public-key authentication) beside a new execd connection (TCP
  and the token handshake); closing either is not timed;
* ``true`` in a persistent shell: ``bash --noprofile --norc`` on one channel,
  each command followed by a line with a marker and its status, beside
  ``sessions.run``.

The login shell's startup files must not be timed: bash run by sshd reads
``~/.bashrc`` even when not interactive. Every session's ``HOME`` is an empty
directory (``SetEnv`` in the sshd_config), which the section checks over the
connection before it measures; the persistent shell starts with
``--noprofile --norc`` too. Without sshd (or asyncssh, or a login shell that
can run commands) the section is skipped and the report says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import sys
import time
from typing import TYPE_CHECKING, Final

from bench.env import Env
from bench.execd_proc import ExecdProcess, start_execd
from bench.peers import Operation, Peer
from bench.report import Row
from bench.settings import KIB, MIB
from bench.sshd import Sshd, SshdUnavailable, find_sshd, login_user, sshd_version, start_sshd
from bench.stats import Call, Timed
from harnessd.api import ExecdClient
from harnessd.cli_bench import install_command

if TYPE_CHECKING:
    import asyncssh

PEER: Final = Peer(
    section="13. OpenSSH (sshd + asyncssh, one connection) beside execd, same operations",
    prefix="ssh",
    name="OpenSSH",
    key="ssh",
    operations=(
        Operation(
            "true", "`true` as a command (execd shell.run; SSH: a channel per command)", 200, 10
        ),
        Operation("read", "4 KiB file read (execd files.read; SFTP open, read, close)", 300, 10),
        Operation(
            "files",
            "4 KiB file written in place then read back (execd files.write atomic=false + "
            "files.read; SFTP)",
            200,
            10,
        ),
        Operation("read_1m", "1 MiB file read (execd files.read; SFTP)", 60, 5),
        Operation(
            "connect",
            "connect and authenticate (execd: TCP + token handshake; SSH: TCP, key exchange, "
            "public-key authentication)",
            40,
            4,
        ),
        Operation(
            "shell",
            "`true` in a persistent shell (execd sessions.run; SSH: bash --noprofile --norc on "
            "one channel)",
            300,
            10,
        ),
    ),
)
SECTION: Final = PEER.section
ROW_KEYS: Final = PEER.row_keys
SESSION: Final = "bench-ssh"
_ANNOUNCED: Final = re.compile(r"^bench: sshd \(pid (\d+)\) on \S+, its directory (.+)$")


def announced(line: str) -> tuple[int, str] | None:
    """The pid and directory of the sshd a line of the bench's stderr announces, if it does."""
    found = _ANNOUNCED.match(line.rstrip("\n"))
    return (int(found.group(1)), found.group(2)) if found else None


def unavailable_reason(sshd: str | None) -> str | None:
    """Why OpenSSH cannot be measured here (no asyncssh, no sshd, no usable login shell), or None."""
    try:
        import asyncssh  # noqa: F401
    except ImportError as exc:
        return f"asyncssh cannot be imported ({exc}); install the bench extra: {install_command()}"
    try:
        find_sshd(sshd)
        login_user()
    except SshdUnavailable as exc:
        return str(exc)
    return None


async def run(env: Env) -> list[Row]:
    """Both sides on each operation, interleaved; no rows (and why, in the report) without sshd."""
    reason = unavailable_reason(env.settings.sshd)
    if reason is not None:
        env.skip(SECTION, reason)
        return []
    path = find_sshd(env.settings.sshd)
    env.facts["openssh"] = await asyncio.to_thread(sshd_version, path)
    try:
        async with (
            start_sshd(path, env.settings.tmp_dir) as sshd,
            start_execd(env.workdir) as execd,
        ):
            print(
                f"bench: sshd (pid {sshd.pid}) on {sshd.host}:{sshd.port}, "
                f"its directory {sshd.directory}",
                file=sys.stderr,
                flush=True,
            )
            return await _measure(env, sshd, execd)
    except Exception as exc:
        env.skip(SECTION, f"OpenSSH failed, rows left out: {exc}")
        return []


async def check_clean_login(conn: asyncssh.SSHClientConnection, sshd: Sshd) -> None:
    """Fail unless the sessions' HOME is the empty directory: no user's startup file is read."""
    done = await conn.run('printf "%s\\n" "$HOME"; ls -A "$HOME"', check=True)
    lines = str(done.stdout).splitlines()
    if lines != [sshd.home] or os.listdir(sshd.home):
        raise SshdUnavailable(
            f"a session's HOME is not the empty {sshd.home} ({lines!r}): the login shell's "
            "startup files would be timed"
        )


class PersistentShell:
    """``bash --noprofile --norc`` on one SSH channel: a command, then a marker line with its status."""

    def __init__(self, process: asyncssh.SSHClientProcess[str]) -> None:
        self._process = process
        self._marker = f"bench-{secrets.token_hex(8)}"

    @classmethod
    async def start(cls, conn: asyncssh.SSHClientConnection) -> PersistentShell:
        """The shell on a new channel of ``conn`` (its stderr merged into its stdout)."""
        return cls(await conn.create_process("exec bash --noprofile --norc 2>&1"))

    async def run(self, command: str) -> int:
        """Run ``command``; its exit status once the marker line has come back."""
        self._process.stdin.write(f"{command}\nprintf '%s %d\\n' {self._marker} \"$?\"\n")
        while True:
            line = await self._process.stdout.readline()
            if not line:
                raise RuntimeError("the shell on the SSH channel ended")
            if line.startswith(self._marker + " "):
                return int(line.split()[1])

    async def close(self) -> None:
        """End the shell (EOF on its stdin) and wait for the channel to close."""
        self._process.stdin.write_eof()
        self._process.close()
        await self._process.wait_closed()


async def _measure(env: Env, sshd: Sshd, execd: ExecdProcess) -> list[Row]:
    small, large = os.urandom(4 * KIB), os.urandom(MIB)
    paths = {name: env.path(f"ssh-{name}") for name in ("read", "files", "read_1m")}
    for name, data in (("read", small), ("read_1m", large)):
        with open(paths[name], "wb") as handle:  # noqa: ASYNC230 (set-up, not timed)
            handle.write(data)
    client = await execd.connect()
    conn = await sshd.connect()
    try:
        await check_clean_login(conn, sshd)
        async with conn.start_sftp_client() as sftp:
            shell = await PersistentShell.start(conn)
            await client.open_session(SESSION)
            try:
                calls = _calls(client, conn, sftp, shell, paths, small, large)
                rows: list[Row] = []
                for op in PEER.operations:
                    if op.key == "connect":
                        rows += await PEER.measure_timed(env, op, *_connects(sshd, execd))
                    else:
                        rows += await PEER.measure(env, op, *calls[op.key])
                return rows
            finally:
                with contextlib.suppress(Exception):
                    await shell.close()
    finally:
        conn.close()
        await conn.wait_closed()
        await client.close()
        for path in paths.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _calls(
    client: ExecdClient,
    conn: asyncssh.SSHClientConnection,
    sftp: asyncssh.SFTPClient,
    shell: PersistentShell,
    paths: dict[str, str],
    small: bytes,
    large: bytes,
) -> dict[str, tuple[Call, Call]]:
    def same(what: str, got: bytes, expected: bytes) -> None:
        if got != expected:
            raise RuntimeError(f"{what} read back other content")

    async def execd_true() -> object:
        result = await client.run(["true"])
        if result.exit_code != 0:
            raise RuntimeError(f"true exited with {result.exit_code} through execd")
        return result

    async def ssh_true() -> object:
        return await conn.run("true", check=True)

    async def execd_read(name: str, expected: bytes) -> None:
        same("execd", await client.read_file(paths[name]), expected)

    async def sftp_read(name: str, expected: bytes) -> None:
        async with sftp.open(paths[name], "rb") as handle:
            same("SFTP", await handle.read(), expected)

    async def execd_files() -> None:
        await client.write_file(paths["files"], small, atomic=False)
        await execd_read("files", small)

    async def ssh_files() -> None:
        async with sftp.open(paths["files"], "wb") as handle:
            await handle.write(small)
        await sftp_read("files", small)

    async def execd_session() -> object:
        result = await client.session_run(SESSION, "true")
        if result.exit_code != 0:
            raise RuntimeError(f"true exited with {result.exit_code} in execd's session")
        return result

    async def ssh_shell() -> int:
        status = await shell.run("true")
        if status != 0:
            raise RuntimeError(f"true exited with {status} in the shell over SSH")
        return status

    return {
        "true": (execd_true, ssh_true),
        "read": (lambda: execd_read("read", small), lambda: sftp_read("read", small)),
        "files": (execd_files, ssh_files),
        "read_1m": (lambda: execd_read("read_1m", large), lambda: sftp_read("read_1m", large)),
        "shell": (execd_session, ssh_shell),
    }


def _connects(sshd: Sshd, execd: ExecdProcess) -> tuple[Timed, Timed]:
    clock = time.perf_counter_ns

    async def execd_connect() -> float:
        started = clock()
        client = await execd.connect()
        elapsed = clock() - started
        await client.close()
        return elapsed / 1000

    return execd_connect, sshd.time_connect
