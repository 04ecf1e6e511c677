"""A runtime of your own: the four coroutines through which serve() starts and stops execd.

This one runs the workspace's processes on this machine with a clean
environment whose HOME is a fresh private directory (so execd's ledger lands
there and goes with it), and keeps a journal of what the launcher asked of it.
A runtime for a container API, a VM agent or a remote sandbox has the same four
methods, each mapped onto that system's exec and file calls.
"""

import asyncio
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence

import harnessd
from harnessd.runtime import CommandResult, WorkspaceError, run_process


class ScratchHomeRuntime:
    """Processes on this machine, a clean environment, HOME in a private directory."""

    def __init__(self, home: str) -> None:
        self.env = {"PATH": os.defpath, "HOME": home, "LANG": "C.UTF-8"}
        self.journal: list[str] = []

    def note(self, entry: str) -> None:
        if not self.journal or self.journal[-1] != entry:  # the launcher polls execd's log
            self.journal.append(entry)

    async def run(
        self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None
    ) -> CommandResult:
        """To completion; a timeout kills the command's process group."""
        self.note(f"run {shlex.join(argv[:3])} ...")
        return await run_process(argv, stdin=stdin, timeout=timeout, env=self.env)

    async def start_background(self, argv: Sequence[str], *, log_path: str) -> None:
        """Detached (its own POSIX session), output appended to the log; no PID comes back."""
        self.note(f"start_background {os.path.basename(argv[0])} ... > {log_path}")
        await asyncio.to_thread(start_detached, argv, log_path, self.env)

    async def read_file(self, path: str, *, max_bytes: int = 16 << 20) -> bytes:
        """The whole file, refused past ``max_bytes``."""
        self.note(f"read_file {path}")
        return await asyncio.to_thread(read_capped, path, max_bytes)

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o600, make_parents: bool = False
    ) -> None:
        """A new file, never readable by others while it is written (it may hold the token)."""
        self.note(f"write_file {path} ({len(data)} bytes, mode {mode:o})")
        await asyncio.to_thread(create_file, path, data, mode, make_parents)


# The blocking parts, run in a worker thread so the event loop keeps serving.


def start_detached(argv: Sequence[str], log_path: str, env: dict[str, str]) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with open(os.open(log_path, flags, 0o600), "ab") as log:
            child = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # Ctrl-C or a hangup here does not reach it
                env=env,
            )
    except OSError as exc:
        raise WorkspaceError(f"cannot start {argv[0]}: {exc.strerror}") from None
    threading.Thread(target=child.wait, daemon=True).start()  # reap it whenever it exits


def read_capped(path: str, max_bytes: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise WorkspaceError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise WorkspaceError(f"{path} is larger than {max_bytes} bytes")
    return data


def create_file(path: str, data: bytes, mode: int, make_parents: bool) -> None:
    if make_parents:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with open(os.open(path, flags, 0o600), "wb") as handle:  # 0600 from the first instant
            handle.write(data)
            os.fchmod(handle.fileno(), mode)
    except OSError as exc:
        raise WorkspaceError(f"cannot create {path}: {exc.strerror}") from None


async def main(home: str) -> None:
    runtime = ScratchHomeRuntime(home)
    async with harnessd.serve(runtime) as handle:
        # What a command in this workspace sees: the clean environment and execd's marker.
        result = await handle.client.run(["sh", "-c", "echo $HOME; env | cut -d= -f1 | sort"])
        home_seen, *names = result.stdout.decode().split()
        print(f"HOME {home_seen}, variables {' '.join(names)}")
    print("\n".join(runtime.journal))


if __name__ == "__main__":
    scratch = tempfile.mkdtemp(prefix="scratch-home-")
    try:
        asyncio.run(main(scratch))
    finally:
        shutil.rmtree(scratch)
