"""Programs on a remote pseudo-terminal: :class:`Terminal` and ``ExecdClient.open_terminal``.

::

    async with await client.open_terminal(["python3", "-i"]) as term:
        await term.send(b"6 * 7\\n")
        print(await term.read(timeout=2, until=b"42"))

A :class:`Terminal` is attached (``terminal.attach``) while its output is
read: :meth:`Terminal.output` iterates the raw bytes as they come (flow
controlled: a consumer that stops reading makes the program block on its
writes), :meth:`Terminal.read` collects what appeared within a timeout and a
bound on bytes. :meth:`Terminal.detach` leaves the program running;
``client.attach_terminal(terminal_id)`` picks it up again, replaying its
recent output.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

from harnessd.client import CallHandle, Client
from protocol.rpc import terminal as rpc
from protocol.rpc.resources import Limits, as_limits

#: Bytes a reading terminal buffers for :meth:`Terminal.read` before the program is made to wait.
READ_BUFFER = 1024 * 1024


class Terminal:
    """A program on a remote terminal; see the module docstring."""

    def __init__(self, client: Client, info: rpc.TerminalInfo) -> None:
        self._client = client
        self.info = info
        self.terminal_id = info.terminal_id
        self._handle: CallHandle[rpc.AttachResult] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._buffer = bytearray()
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        #: Bytes lost off the daemon's ring before the latest attach.
        self.lost = 0

    async def __aenter__(self) -> Terminal:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send(self, data: bytes) -> None:
        """Type ``data`` on the terminal (``b"\\x03"`` interrupts as Ctrl-C does)."""
        await self._client.call(rpc.SEND, rpc.SendParams(terminal_id=self.terminal_id, data=data))

    async def resize(self, rows: int, cols: int) -> None:
        """Set the window size; the program sees SIGWINCH."""
        params = rpc.ResizeParams(terminal_id=self.terminal_id, rows=rows, cols=cols)
        await self._client.call(rpc.RESIZE, params)
        self.info.rows, self.info.cols = rows, cols

    async def output(self) -> AsyncIterator[bytes]:
        """The program's output as it arrives (the recent past first), until it exits.

        Leaving the loop early detaches: the program goes on running.
        """
        if self._pump is not None:
            raise RuntimeError("this terminal's output is already being read with read()")
        handle = self._attach()
        finished = False
        try:
            async for chunk in handle.stream(rpc.OUTPUT_STREAM):
                yield chunk
            result = await handle.result()
            self.info, self.lost = result.info, result.lost
            finished = True
        finally:
            self._handle = None
            if not finished:
                handle.cancel()

    async def read(
        self, timeout: float = 1.0, max_bytes: int = 64 * 1024, *, until: bytes | None = None
    ) -> bytes:
        """What the program wrote, waiting up to ``timeout`` seconds, at most ``max_bytes``.

        Returns early once ``until`` has appeared, or once output has started
        and stayed quiet for a tenth of a second; ``b""`` after the end of the
        output once everything was read.
        """
        if self._pump is None:
            self._pump = asyncio.ensure_future(self._fill(self._attach()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seen = 0
        while len(self._buffer) < max_bytes and not self._pump.done():
            if until is not None and until in self._buffer:
                break
            left = deadline - loop.time()
            if left <= 0:
                break
            quiet = 0.1 if self._buffer and until is None else left
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(left, quiet))
            except TimeoutError:
                if self._buffer and until is None and len(self._buffer) == seen:
                    break
            seen = len(self._buffer)
        if not self._buffer and self._pump.done():
            self._pump.result()
        data = bytes(self._buffer[:max_bytes])
        del self._buffer[:max_bytes]
        self._room.set()
        return data

    async def _fill(self, handle: CallHandle[rpc.AttachResult]) -> None:
        try:
            async for chunk in handle.stream(rpc.OUTPUT_STREAM):
                self._buffer += chunk
                self._arrived.set()
                if len(self._buffer) >= READ_BUFFER:
                    self._room.clear()
                    await self._room.wait()
            result = await handle.result()
            self.info, self.lost = result.info, result.lost
        finally:
            self._handle = None
            self._arrived.set()

    def _attach(self) -> CallHandle[rpc.AttachResult]:
        if self._handle is not None:
            raise RuntimeError("this terminal is already attached")
        self._handle = self._client.start(
            rpc.ATTACH, rpc.AttachParams(terminal_id=self.terminal_id)
        )
        return self._handle

    async def detach(self) -> None:
        """Stop reading; the program keeps running and its output goes to the daemon's ring.

        Returns once execd has ended the attach call, so another may attach at once.
        """
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()
            with contextlib.suppress(Exception):
                await handle.result()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump
            self._pump = None

    async def wait(self, timeout: float | None = None) -> rpc.TerminalInfo:
        """Wait for the program's exit (or ``timeout``); its info, with ``exit_code`` or ``signal``.

        While :meth:`read` follows the output, the exit arrives with its end.
        """
        if self._pump is not None:
            # The attach call reports the exit (and consumes the final status) itself.
            await asyncio.wait({self._pump}, timeout=timeout)
            if self._pump.done():
                self._pump.result()
                return self.info
        if self.info.state == "exited":
            return self.info
        params = rpc.WaitParams(terminal_id=self.terminal_id, timeout=timeout)
        self.info = await self._client.call(rpc.WAIT, params)
        return self.info

    async def close(self, grace: float | None = None) -> rpc.TerminalInfo:
        """Hang up the terminal (its whole session), SIGKILL after ``grace``; how it ended.

        A terminal that is already gone (exited and its status read) keeps its last info.
        """
        await self.detach()
        if self.info.state == "exited":
            return self.info
        params = rpc.CloseParams(terminal_id=self.terminal_id, grace=grace)
        self.info = await self._client.call(rpc.CLOSE, params)
        return self.info


class TerminalsClient(Client):
    """``terminal.*`` methods (a base of :class:`harnessd.api.ExecdClient`)."""

    async def open_terminal(
        self,
        argv: list[str] | None = None,
        *,
        command: str | None = None,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        unset: list[str] | None = None,
        limits: Limits | Mapping[str, float] | None = None,
    ) -> Terminal:
        """Start ``argv`` (or ``command`` through ``/bin/sh -c``) on a new terminal."""
        params = rpc.OpenParams(
            argv=argv,
            command=command,
            cwd=cwd,
            env=env,
            unset=unset,
            rows=rows,
            cols=cols,
            limits=as_limits(limits),
        )
        return Terminal(self, await self.call(rpc.OPEN, params))

    def attach_terminal(self, terminal_id: str) -> Terminal:
        """A :class:`~harnessd.terminal.Terminal` for one opened earlier (by this or another connection)."""
        info = rpc.TerminalInfo(
            terminal_id=terminal_id, pid=0, tty="", title="", state="running", rows=0, cols=0
        )
        return Terminal(self, info)
