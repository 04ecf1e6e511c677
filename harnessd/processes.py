"""Commands on this machine that inherit their standard streams and nothing else.

Theory of operation
-------------------
The runtimes run commands here -- ``mkdir``, ``cat``, ``ssh host ...``,
``docker exec -i box ...`` -- while this process holds connections to execd,
pipes and whatever descriptors it inherited itself. A command must get none of
them: a descriptor it keeps holds its other end open for the command's whole
life, and a command that starts a daemon (execd in the background through a
prefix) hands it on to that daemon. asyncio's ``create_subprocess_exec`` starts
the command through the running loop, and uvloop's spawner passes every
inheritable descriptor of this process whatever ``close_fds`` says, and also
duplicates of the command's own standard streams at their original numbers:
a daemon started through such a command keeps the write end of its starter's
output, so reading that output to its end waits as long as the daemon lives.

So :func:`start` does not use the loop's spawner, on any loop:

1. Each standard stream the caller reads or writes is a socket pair made here
   (both ends close-on-exec). The loop's end is attached as a stream first.
2. :class:`subprocess.Popen` starts the command in a session of its own with
   ``close_fds``: CPython's child duplicates the other ends onto 0, 1 and 2
   and closes every other descriptor before ``exec``. The parent then closes
   the child's ends, so end of output means the command *and everything it
   started* let go of them.
3. The exit is awaited through a pidfd the loop watches (Linux 5.3 or newer),
   else by a thread blocked in ``waitpid``; either way the loop never blocks,
   and the status is collected by ``Popen`` itself, so nothing else reaps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

STREAM_LIMIT = 64 * 1024
"""Buffer limit of each stream the loop reads from a command."""


@dataclass(eq=False)
class Child:
    """A command :func:`start` started: its process and the loop's ends of its streams.

    ``stdin`` is None when the command reads ``/dev/null``. Call
    :meth:`close` once done with the streams.
    """

    process: subprocess.Popen[bytes]
    stdin: asyncio.StreamWriter | None
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader
    _transports: list[asyncio.StreamWriter] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """The command's process id (and its process group's)."""
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once :meth:`wait` returned (negative: the signal), else None."""
        return self.process.returncode

    async def wait(self) -> int:
        """Await the command's end; its status as :attr:`subprocess.Popen.returncode` gives it."""
        return await wait_exit(self.process)

    def kill_group(self) -> None:
        """SIGKILL the command's process group, unless its status was collected already.

        Until then the (possibly exited) leader keeps the group's id from being
        reused, so this never reaches another process.
        """
        if self.process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def close(self) -> None:
        """Close the loop's ends of the streams (idempotent)."""
        for writer in self._transports:
            writer.close()


async def start(
    argv: Sequence[str], *, feed: bool, env: Mapping[str, str], cwd: str | None = None
) -> Child:
    """Start ``argv`` in a new session; its output on two streams, its input one too if ``feed``.

    Raises OSError (from :class:`subprocess.Popen`) when it cannot be started.
    """
    pairs: list[tuple[socket.socket, socket.socket]] = []
    loose: list[socket.socket] = []  # sockets no transport owns yet
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(3 if feed else 2):
            pair = socket.socketpair()
            pairs.append(pair)
            loose += pair
        for ours, _ in pairs:
            streams.append(await asyncio.open_connection(sock=ours, limit=STREAM_LIMIT))
            loose.remove(ours)
        theirs = [their.fileno() for _, their in pairs]
        # Blocks only for the fork and exec, as the loops' own spawners do.
        process = subprocess.Popen(  # noqa: ASYNC220
            list(argv),
            stdin=theirs[2] if feed else subprocess.DEVNULL,
            stdout=theirs[0],
            stderr=theirs[1],
            cwd=cwd,
            env=dict(env),
            start_new_session=True,
            close_fds=True,
        )
    except BaseException:
        for _, writer in streams:
            writer.close()
        for sock in loose:
            sock.close()
        raise
    for _, their in pairs:
        their.close()
    return Child(
        process=process,
        stdin=streams[2][1] if feed else None,
        stdout=streams[0][0],
        stderr=streams[1][0],
        _transports=[writer for _, writer in streams],
    )


async def wait_exit(process: subprocess.Popen[bytes]) -> int:
    """``process``'s exit status, awaited without blocking the loop (see the module's description)."""
    if process.returncode is not None:
        return process.returncode
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:
        return await _wait_in_thread(process)
    loop = asyncio.get_running_loop()
    exited = loop.create_future()

    def ready() -> None:
        loop.remove_reader(pidfd)
        if not exited.done():
            exited.set_result(None)

    try:
        loop.add_reader(pidfd, ready)
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return process.wait()


async def _wait_in_thread(process: subprocess.Popen[bytes]) -> int:
    """Where there is no pidfd: a thread of its own blocks in ``waitpid`` (never the shared pool)."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()

    def settle() -> None:
        if not exited.done():
            exited.set_result(None)

    def waiting() -> None:
        process.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle)

    threading.Thread(target=waiting, name=f"wait-{process.pid}", daemon=True).start()
    await exited
    return process.wait()
