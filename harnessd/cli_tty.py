"""``harnessd exec -t``: the remote command on a terminal, this terminal in raw mode, like ``ssh -t``.

The local terminal is switched to raw mode (every key, Ctrl-C included,
goes to the remote terminal's line discipline), window-size changes
(SIGWINCH) are forwarded as ``terminal.resize``, and the local terminal's
mode is restored on every way out: the command's exit, SIGTERM or SIGHUP
here (which close the remote terminal), a lost connection. The exit status
is the remote command's (128+N after signal N).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import Coroutine
from typing import Any

from harnessd.api import ExecdClient
from harnessd.errors import HarnessError
from harnessd.terminal import Terminal
from protocol.rpc.resources import Limits

STDIN_BLOCK = 64 * 1024
CONNECTION_FAILED = 255


def _window(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 24, 80
    return max(1, size.lines), max(1, size.columns)


async def run_terminal(
    client: ExecdClient,
    argv: list[str],
    cwd: str | None,
    limits: Limits | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``argv`` on a remote terminal wired to this process's terminal; its exit status.

    ``env``: variables for the command, on top of this terminal's ``TERM``.
    """
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    rows, cols = _window(fd_in)
    variables = {"TERM": os.environ["TERM"]} if os.environ.get("TERM") else {}
    variables.update(env or {})
    term = await client.open_terminal(
        argv, rows=rows, cols=cols, cwd=cwd, env=variables or None, limits=limits
    )
    saved = termios.tcgetattr(fd_in)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    main = asyncio.current_task()
    stopped: list[int] = []

    def later(coro: Coroutine[Any, Any, None]) -> None:
        task = loop.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def on_winch() -> None:
        later(_resize(term, *_window(fd_in)))

    def on_stop(signum: int) -> None:
        stopped.append(signum)
        if main is not None:
            main.cancel()

    try:
        tty.setraw(fd_in, termios.TCSANOW)
        loop.add_signal_handler(signal.SIGWINCH, on_winch)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(signum, on_stop, signum)
        keys = loop.create_task(_forward_keys(term, fd_in))
        try:
            async for chunk in term.output():
                _write_all(fd_out, chunk)
        finally:
            keys.cancel()
            await asyncio.gather(keys, return_exceptions=True)
        info = term.info
        if info.signal is not None:
            return 128 + info.signal
        return info.exit_code if info.exit_code is not None else CONNECTION_FAILED
    except asyncio.CancelledError:
        if not stopped:
            raise
        with contextlib.suppress(HarnessError):
            await term.close(grace=1.0)
        return 128 + stopped[0]
    except HarnessError as exc:
        termios.tcsetattr(fd_in, termios.TCSADRAIN, saved)
        sys.stderr.write(f"\r\nharnessd exec: {exc}\n")
        return CONNECTION_FAILED
    finally:
        termios.tcsetattr(fd_in, termios.TCSADRAIN, saved)
        for signum in (signal.SIGWINCH, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        for task in tasks:
            task.cancel()


async def _resize(term: Terminal, rows: int, cols: int) -> None:
    with contextlib.suppress(HarnessError):
        await term.resize(rows, cols)


async def _forward_keys(term: Terminal, fd: int) -> None:
    loop = asyncio.get_running_loop()
    while True:
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, ready.set_result, None)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        try:
            data = os.read(fd, STDIN_BLOCK)
        except OSError:
            data = b""
        if not data:
            return
        try:
            await term.send(data)
        except HarnessError:
            return


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
