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
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from execd import marker
from execd.budget import Budgets
from execd.config import LEDGER_PATH_VAR, Config
from execd.context import CallContext, Method, bind
from execd.fit import fit_list, result_budget
from execd.reaper import Reaper
from execd.requests import RequestTable
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


def build_capability(
    name: str,
    config: Config,
    base_env: dict[str, str],
    budgets: Budgets,
    requests: RequestTable | None = None,
) -> Capability:
    """The capability whose methods are named ``<name>.*`` (its module is imported here).

    Those that start processes share ``budgets.processes``; files holds
    ``budgets.open_files`` (:mod:`execd.budget`). Shell finds calls by request
    id in ``requests``.
    """
    if name == "shell":
        from execd.shell import ShellCapability

        locate = requests.locate if requests is not None else None
        return ShellCapability(config, base_env, budgets.processes, locate)
    if name == "terminal":
        from execd.terminal import TerminalCapability

        return TerminalCapability(config, base_env, budgets.processes)
    if name == "services":
        from execd.services import ServicesCapability

        return ServicesCapability(config, base_env, budgets.processes)
    if name == "sessions":
        from execd.sessions import SessionsCapability

        return SessionsCapability(config, base_env, budgets.processes)
    if name == "files":
        from execd.files import FilesCapability

        return FilesCapability(config, open_files=budgets.open_files)
    if name == "watch":
        from execd.watch import WatchCapability

        return WatchCapability(config)
    if name == "ledger":
        from execd.ledger import LedgerCapability

        return LedgerCapability(config, budgets.open_files)
    raise ValueError(f"no capability named {name!r}")


CAPABILITIES = ("shell", "terminal", "services", "sessions", "files", "watch", "ledger")
"""Every capability, by the prefix of its method names, in the order they are closed."""


class MethodTable(dict[str, Method]):
    """The dispatch table, each capability built on the first call of one of its methods.

    Importing and building every capability up front cost execd's cold start
    about a fifth of its time (``python -X importtime``), before it could
    listen; most sessions use a few of them. A lookup (``table[name]``, what
    the server does, or ``get``) of a missing ``<name>.*`` builds the
    capability it belongs to, then answers from the table like any other.
    """

    def __init__(self, build: Callable[[str], Capability]) -> None:
        super().__init__()
        self._build = build
        self.built: dict[str, Capability] = {}

    def register(self, method: Method) -> None:
        """Add one method; a name registered twice is a bug."""
        if method.name in self:
            raise RuntimeError(f"method {method.name} registered twice")
        self[method.name] = method

    def load(self, name: str) -> None:
        """Build capability ``name`` now, unless it is built already."""
        if name in self.built:
            return
        capability = self._build(name)
        self.built[name] = capability
        for method in capability.methods():
            if not method.name.startswith(name + "."):
                raise RuntimeError(f"method {method.name} outside its capability {name}")
            self.register(method)

    def load_all(self) -> None:
        """Build every capability (before listing every method)."""
        for name in CAPABILITIES:
            self.load(name)

    def __missing__(self, key: str) -> Method:
        prefix, dot, _ = key.partition(".")
        if dot and prefix in CAPABILITIES and prefix not in self.built:
            self.load(prefix)
            return self[key]
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def loaded(self) -> list[Capability]:
        """The capabilities built so far, in the order they are closed."""
        return [self.built[name] for name in CAPABILITIES if name in self.built]


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
        self.budgets = Budgets.of(config.limits)
        self.requests = RequestTable(config.limits)
        self.methods = MethodTable(
            lambda name: build_capability(name, config, base_env, self.budgets, self.requests)
        )
        for method in [*self.requests.methods(), *self._core_methods()]:
            self.methods.register(method)
        self.server = Server(config, token, self.methods, self.requests)
        self._closed = False

    @property
    def capabilities(self) -> list[Capability]:
        """The capabilities built so far (each on the first call of one of its methods)."""
        return self.methods.loaded()

    def _core_methods(self) -> list[Method]:
        return bind(self, core.RPCS, direct=(core.NOOP, core.ECHO, core.INFO))

    async def server_noop(self, params: NoParams, ctx: CallContext) -> None:
        return None

    async def server_echo(self, params: EchoParams, ctx: CallContext) -> bytes:
        return params.data

    async def server_info(self, params: NoParams, ctx: CallContext) -> ServerInfo:
        from execd.limits import ResourceControl

        self.methods.load_all()
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
            limits=ResourceControl(self.config.limits.command_limits).info(),
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
        from execd import limits as command_limits

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
        from execd import limits as command_limits  # imported once the server has stopped

        command_limits.sweep(final=True)
        reaper.reap()
        reaper.stop()
        log.info("shut down: %d processes killed, %d left", report.killed, len(report.remaining))
        return 0 if not report.remaining else 1
