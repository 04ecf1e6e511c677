"""The execd an MCP server's tools run in: launched for the server, or one already running.

:class:`Workspace` is opened from a :class:`LaunchTarget` (start execd on this
machine or through a command prefix such as ``ssh host`` or ``docker exec -i
box``, with a lease, as :func:`~harnessd.launcher.serve` does) or a
:class:`ConnectTarget` (an execd at an address, with its token). It hands out
the current client, reconnects when the connection was lost, and at the end
(:meth:`Workspace.close`) kills every process carrying execd's marker; a
launched execd is stopped as well, one connected to stays up.

Nothing here imports the MCP SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from harnessd.api import ExecdClient, connect
from harnessd.errors import ConnectionLost, HarnessError
from harnessd.launcher import DEFAULT_LEASE, Session, serve
from harnessd.runtime import CommandPrefixRuntime, LocalRuntime, Runtime

log = logging.getLogger("harnessd.mcp")

CLEANUP_TIMEOUT = 10.0
"""Seconds the marker cleanup at the end may take."""


@dataclass(frozen=True, slots=True)
class LaunchTarget:
    """Start execd for the server: on this machine (no ``prefix``) or through ``prefix``.

    ``prefix``: the argv that runs a command in the workspace (``["ssh",
    "host"]``, ``["docker", "exec", "-i", "box"]``); ``remote_shell`` when it
    goes through a remote shell (ssh), so arguments are quoted.
    ``execd_command``: what starts execd there (default: this interpreter's
    ``-m execd``). ``bind_host``/``connect_host``/``encrypt``/``lease``: as
    :func:`~harnessd.launcher.serve` takes them. ``scrub``: more environment variable
    names to keep from execd's environment.
    """

    prefix: tuple[str, ...] = ()
    remote_shell: bool = False
    execd_command: tuple[str, ...] | None = None
    bind_host: str = "127.0.0.1"
    connect_host: str | None = None
    encrypt: bool = False
    lease: float | None = DEFAULT_LEASE
    scrub: tuple[str, ...] = ()

    @property
    def local(self) -> bool:
        """True when execd runs on this machine."""
        return not self.prefix

    def runtime(self) -> Runtime:
        """The runtime that starts execd."""
        if not self.prefix:
            return LocalRuntime(scrub=self.scrub)
        return CommandPrefixRuntime(
            self.prefix, quote_for_remote_shell=self.remote_shell, scrub=self.scrub
        )


@dataclass(frozen=True, slots=True)
class ConnectTarget:
    """An execd already running at ``host:port``; ``token`` is never shown by ``repr()``."""

    host: str
    port: int
    token: bytes = field(repr=False)
    encrypt: bool = False


@dataclass(frozen=True, slots=True)
class Cleanup:
    """What :meth:`Workspace.close` did: processes killed, marked ones left, execd stopped."""

    killed: int
    left: int
    stopped: bool
    error: str | None = None


class Workspace:
    """The execd the tools use, and its teardown. Open with :meth:`open`."""

    def __init__(
        self, client: ExecdClient, *, session: Session | None, target: ConnectTarget | None
    ) -> None:
        self._client = client
        self._session = session
        self._target = target
        self._lock = asyncio.Lock()
        self._closed: Cleanup | None = None

    @classmethod
    async def open(cls, target: LaunchTarget | ConnectTarget) -> Workspace:
        """Launch or connect; raises LaunchFailed, ConnectFailed, AuthenticationFailed, ..."""
        if isinstance(target, ConnectTarget):
            client = await connect(target.host, target.port, target.token, encrypt=target.encrypt)
            return cls(client, session=None, target=target)
        session = await serve(
            target.runtime(),
            execd_command=target.execd_command,
            bind_host=target.bind_host,
            connect_host=target.connect_host,
            encrypt=target.encrypt,
            lease=target.lease,
        )
        return cls(session.client, session=session, target=None)

    @property
    def launched(self) -> bool:
        """True when execd was started for this workspace (and :meth:`close` stops it)."""
        return self._session is not None

    @property
    def session(self) -> Session | None:
        """The launcher's session of a launched execd (None when connected to one)."""
        return self._session

    def client(self) -> ExecdClient:
        """The current client (it changes after a reconnect)."""
        if self._session is not None:
            return self._session.client
        return self._client

    async def ensure_connected(self) -> ExecdClient:
        """The current client, after reconnecting when the connection is known to be gone."""
        async with self._lock:
            if self._closed is not None:
                raise ConnectionLost("the workspace is closed")
            if not self.client().closed:
                return self.client()
            log.info("the connection to execd was lost; reconnecting")
            if self._session is not None:
                return await self._session.reconnect()
            target = self._target
            assert target is not None
            old = self._client
            self._client = await connect(
                target.host, target.port, target.token, encrypt=target.encrypt
            )
            await old.close()
            return self._client

    async def close(self) -> Cleanup:
        """Kill every marked process; stop execd when it was launched here. Idempotent."""
        if self._closed is not None:
            return self._closed
        if self._session is not None:
            result = await self._session.close()
            self._closed = Cleanup(
                killed=result.killed,
                left=result.leftover,
                stopped=result.worker_exited,
                error=result.rpc_error or result.fallback_error,
            )
            return self._closed
        self._closed = await asyncio.shield(self._cleanup_connected())
        return self._closed

    async def _cleanup_connected(self) -> Cleanup:
        try:
            client = self._client
            if client.closed:
                target = self._target
                assert target is not None
                client = await connect(
                    target.host, target.port, target.token, encrypt=target.encrypt
                )
                self._client = client
            async with asyncio.timeout(CLEANUP_TIMEOUT + 10.0):
                report = await client.cleanup(timeout=CLEANUP_TIMEOUT)
        except (HarnessError, OSError, TimeoutError) as exc:
            return Cleanup(killed=0, left=0, stopped=False, error=f"{type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(Exception):
                await self._client.close()
        return Cleanup(killed=report.killed, left=len(report.remaining), stopped=False)
