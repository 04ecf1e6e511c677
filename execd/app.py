"""Assembles execd: capabilities, the dispatch table, the server, and shutdown.

The dispatch table is built here and only here: every capability module
contributes its :class:`~execd.context.Method` entries, and the core methods
(``server.info``, ``server.noop``, ``server.echo``, ``session.close``) are
added beside them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable
from typing import Any, Protocol

from execd import limits as command_limits
from execd import marker
from execd.config import LEDGER_PATH_VAR, Config
from execd.context import CallContext, Method, bind
from execd.fit import fit_list, result_budget
from execd.reaper import Reaper
from execd.server import Server
from protocol import limits
from protocol.rpc import core
from protocol.rpc.core import CloseParams, CloseReport, EchoParams, NoParams, ServerInfo

log = logging.getLogger("execd")

VERSION = "0.1.0"


class StartupError(Exception):
    """execd cannot start; ``status`` is the exit status to use.

    The message names what failed and where (the file, directory, host and
    port); the command line prints it as one line.
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Capability(Protocol):
    """What every capability module exports."""

    def methods(self) -> list[Method]: ...

    def close(self) -> Awaitable[None]: ...


def announce(event: dict[str, Any]) -> None:
    """Print one JSON line on stdout and flush it (the launcher reads these)."""
    sys.stdout.write(json.dumps(event, separators=(", ", ": ")) + "\n")
    sys.stdout.flush()


def build_capabilities(config: Config, base_env: dict[str, str]) -> list[Capability]:
    """One instance of every capability, in the order they are closed."""
    from execd.files import FilesCapability
    from execd.ledger import LedgerCapability
    from execd.services import ServicesCapability
    from execd.sessions import SessionsCapability
    from execd.shell import ShellCapability
    from execd.terminal import TerminalCapability
    from execd.watch import WatchCapability

    return [
        ShellCapability(config, base_env),
        TerminalCapability(config, base_env),
        ServicesCapability(config, base_env),
        SessionsCapability(config, base_env),
        FilesCapability(config),
        WatchCapability(config),
        LedgerCapability(config),
    ]


class Execd:
    """One running execd: its server, capabilities and shutdown path."""

    def __init__(self, config: Config, token: bytes) -> None:
        self.config = config
        base_env = marker.child_environment(
            os.environ,
            config.marker_var,
            config.marker,
            extra={LEDGER_PATH_VAR: config.ledger_dir},
        )
        self.capabilities = build_capabilities(config, base_env)
        self.methods: dict[str, Method] = {}
        for capability in self.capabilities:
            for method in capability.methods():
                self._register(method)
        for method in self._core_methods():
            self._register(method)
        self.server = Server(config, token, self.methods)
        self._closed = False

    def _register(self, method: Method) -> None:
        if method.name in self.methods:
            raise RuntimeError(f"method {method.name} registered twice")
        self.methods[method.name] = method

    def _core_methods(self) -> list[Method]:
        return bind(self, core.RPCS)

    async def server_noop(self, params: NoParams, ctx: CallContext) -> None:
        return None

    async def server_echo(self, params: EchoParams, ctx: CallContext) -> bytes:
        return params.data

    async def server_info(self, params: NoParams, ctx: CallContext) -> ServerInfo:
        return ServerInfo(
            pid=os.getpid(),
            uid=os.getuid(),
            marker=self.config.marker,
            marker_var=self.config.marker_var,
            protocol=limits.PROTOCOL_VERSION,
            version=VERSION,
            cwd=os.getcwd(),
            ledger_dir=self.config.ledger_dir,
            methods=sorted(self.methods),
            limits=command_limits.ResourceControl(self.config.limits.command_limits).info(),
        )

    async def session_close(self, params: CloseParams, ctx: CallContext) -> CloseReport:
        report = await self.cleanup(params.timeout)
        # Survivors are listed as far as the reply has room for them.
        report.remaining, _ = fit_list(report.remaining, result_budget(ctx) - 64)
        if params.shutdown:
            asyncio.get_running_loop().call_soon(self.server.stopping.set)
        return report

    async def cleanup(self, timeout: float = 10.0) -> CloseReport:
        """Close every capability, then kill whatever still carries the marker."""
        for capability in self.capabilities:
            try:
                await capability.close()
            except Exception:
                log.exception("closing %s failed", type(capability).__name__)
        result = await marker.cleanup_async(
            self.config.marker_var, self.config.marker, timeout=timeout
        )
        command_limits.sweep()
        return CloseReport(
            killed=result.killed,
            remaining=list(result.remaining),
            rounds=result.rounds,
            elapsed=result.elapsed,
        )

    async def run(self) -> int:
        """Serve until asked to stop; return the exit status."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(signum, self.server.stopping.set)
        reaper = Reaper()
        reaper.start()
        try:
            await self.server.start()
        except OSError as exc:
            reaper.stop()
            where = f"{self.config.host}:{self.config.port}"
            raise StartupError(f"cannot listen on {where}: {exc.strerror or exc}", 1) from None
        listening: dict[str, Any] = {
            "event": "listening",
            "host": self.server.host,
            "port": self.server.port,
            "pid": os.getpid(),
            "marker": self.config.marker,
            "protocol": limits.PROTOCOL_VERSION,
            "state_dir": self.config.state_dir,
        }
        if self.config.state_dir_fallback is not None:
            listening["state_dir_fallback"] = self.config.state_dir_fallback
        announce(listening)
        await self.server.stopping.wait()
        await self.server.close()
        report = await self.cleanup()
        command_limits.sweep(final=True)
        reaper.reap()
        reaper.stop()
        log.info("shut down: %d processes killed, %d left", report.killed, len(report.remaining))
        return 0 if not report.remaining else 1
