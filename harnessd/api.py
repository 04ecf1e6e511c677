"""The typed user API of the client: one method per execd RPC.

:class:`ExecdClient` is what :func:`harnessd.client.connect` returns. Methods
that move bytes (command output, file content, ledger entries) stream them in
flow-controlled chunks, so neither side holds more than a window at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from harnessd.client import CallHandle, Client, open_connection
from protocol import limits
from protocol.api import shell
from protocol.api.core import CloseParams, CloseReport, EchoParams, ServerInfo


class ExecdClient(Client):
    """An authenticated connection to execd with one typed method per RPC."""

    # -- core ------------------------------------------------------------------

    async def noop(self) -> None:
        """A call that does nothing: the round-trip floor."""
        await self.call("server.noop")

    async def echo(self, data: bytes) -> bytes:
        """Send ``data`` and get it back."""
        return await self.call("server.echo", EchoParams(data=data), bytes)

    async def server_info(self) -> ServerInfo:
        """execd's pid, uid, marker, protocol version and methods."""
        return await self.call("server.info", None, ServerInfo)

    async def close_session(self, *, shutdown: bool = True, timeout: float = 10.0) -> CloseReport:
        """Clean up every process carrying the marker; with ``shutdown`` execd then exits."""
        return await self.call(
            "session.close", CloseParams(shutdown=shutdown, timeout=timeout), CloseReport
        )

    # -- shell -----------------------------------------------------------------

    async def run(
        self,
        argv: list[str] | None = None,
        *,
        command: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        unset: list[str] | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        output_cap: int | None = None,
        drain_grace: float | None = None,
        kill_grace: float | None = None,
    ) -> shell.RunResult:
        """Run a command (``argv``, or ``command`` through ``/bin/sh -c``) and collect its output."""
        params = shell.RunParams(
            argv=argv,
            command=command,
            cwd=cwd,
            env=env,
            unset=unset,
            stdin=stdin,
            timeout=timeout,
            idle_timeout=idle_timeout,
            output_cap=output_cap,
            drain_grace=drain_grace,
            kill_grace=kill_grace,
        )
        return await self.call(shell.RUN, params, shell.RunResult)

    def run_streaming(
        self,
        argv: list[str] | None = None,
        *,
        command: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        unset: list[str] | None = None,
        stdin_stream: bool = False,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        drain_grace: float | None = None,
        kill_grace: float | None = None,
    ) -> RunningCommand:
        """Start a command whose output streams live; see :class:`RunningCommand`."""
        params = shell.RunParams(
            argv=argv,
            command=command,
            cwd=cwd,
            env=env,
            unset=unset,
            stdin_stream=stdin_stream,
            timeout=timeout,
            idle_timeout=idle_timeout,
            drain_grace=drain_grace,
            kill_grace=kill_grace,
            stream=True,
        )
        return RunningCommand(self, self.start(shell.RUN, params))

    async def run_detached(
        self,
        argv: list[str] | None = None,
        *,
        command: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> shell.RunResult:
        """Start a command that outlives this connection; the result carries its command_id."""
        params = shell.RunParams(
            argv=argv, command=command, cwd=cwd, env=env, timeout=timeout, detached=True
        )
        return await self.call(shell.RUN, params, shell.RunResult)

    async def signal_command(
        self, signal: int, *, call_id: int | None = None, command_id: str | None = None
    ) -> shell.SignalResult:
        """Send ``signal`` to a running call on this connection or to a detached command."""
        params = shell.SignalParams(signal=signal, call_id=call_id, command_id=command_id)
        return await self.call(shell.SIGNAL, params, shell.SignalResult)

    async def list_commands(self) -> shell.ListResult:
        """Every detached command execd remembers."""
        return await self.call(shell.LIST, shell.ListParams(), shell.ListResult)

    async def command_status(self, command_id: str) -> shell.CommandInfo:
        """A detached command's state, without waiting."""
        params = shell.StatusParams(command_id=command_id)
        return await self.call(shell.STATUS, params, shell.CommandInfo)

    async def wait_command(
        self, command_id: str, timeout: float | None = None
    ) -> shell.CommandInfo:
        """Wait for a detached command to exit (or ``timeout``)."""
        params = shell.WaitParams(command_id=command_id, timeout=timeout)
        return await self.call(shell.WAIT, params, shell.CommandInfo)

    def attach(self, command_id: str, *, follow: bool = True) -> RunningCommand:
        """Replay a detached command's retained output, then follow it live."""
        params = shell.AttachParams(command_id=command_id, follow=follow)
        return RunningCommand(self, self.start(shell.ATTACH, params))


class RunningCommand:
    """A streaming command: iterate its output, feed its stdin, signal it, await its result."""

    def __init__(self, client: ExecdClient, handle: CallHandle) -> None:
        self._client = client
        self.handle = handle

    @property
    def call_id(self) -> int:
        return self.handle.id

    async def output(self) -> AsyncIterator[tuple[str, bytes]]:
        """``(stream name, bytes)`` pairs from stdout and stderr, as they arrive."""
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue(maxsize=64)

        async def pump(name: str) -> None:
            try:
                async for data in self.handle.stream(name):
                    await queue.put((name, data))
            finally:
                await queue.put(None)

        tasks = [
            asyncio.create_task(pump(shell.STDOUT_STREAM)),
            asyncio.create_task(pump(shell.STDERR_STREAM)),
        ]
        try:
            open_streams = len(tasks)
            while open_streams:
                item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to the command's stdin (needs ``stdin_stream=True``)."""
        await self.handle.send(shell.STDIN_STREAM, data)

    async def close_stdin(self) -> None:
        """Signal end of input on the command's stdin."""
        await self.handle.send(shell.STDIN_STREAM, b"", end=True)

    async def signal(self, signum: int) -> shell.SignalResult:
        """Send a signal to the command's process group."""
        return await self._client.signal_command(signum, call_id=self.handle.id)

    async def result(self) -> shell.RunResult:
        """Wait for the command to finish; its output has all been delivered by then."""
        return await self.handle.result(shell.RunResult)

    def cancel(self) -> None:
        """Cancel the call: execd kills the command's group."""
        self.handle.cancel()


async def connect(
    host: str,
    port: int,
    token: bytes | str,
    *,
    encrypt: bool | str = False,
    timeout: float = 10.0,
    keepalive: float | None = 2.0,
    max_frame: int = limits.DEFAULT_MAX_FRAME,
    window: int = limits.DEFAULT_STREAM_WINDOW,
) -> ExecdClient:
    """Connect to execd at ``host:port``, authenticate with ``token``, return the client.

    ``encrypt``: False for plaintext frames (loopback), True to require
    authenticated encryption, or a cipher name. ``keepalive``: seconds between
    pings; a connection silent for three intervals fails with ConnectionLost.
    Raises ConnectFailed, AuthenticationFailed or HandshakeFailed.
    """
    proto, info = await open_connection(
        host,
        port,
        token,
        encrypt=encrypt,
        timeout=timeout,
        max_frame=max_frame,
        window=window,
    )
    return ExecdClient(proto, info, keepalive)
