"""Typed client methods for execd's services and persistent shell sessions.

:class:`ServicesClient` is a base of :class:`harnessd.api.ExecdClient`, so
these methods are available on every client ``harnessd.connect`` returns::

    info = await client.start_service(
        "web", [sys.executable, "-m", "http.server", "8000"], probe=TcpProbe(port=8000)
    )
    async with contextlib.aclosing(client.follow_service_logs("web")) as chunks:
        async for chunk in chunks:
            ...

    await client.open_session("dev", cwd="/work")
    result = await client.session_run("dev", "cd src && make")
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping

from harnessd.client import Client
from protocol.rpc import services, sessions
from protocol.rpc.resources import Limits, as_limits


class ServicesClient(Client):
    """``services.*`` and ``sessions.*`` methods."""

    # -- services ----------------------------------------------------------------

    async def start_service(
        self,
        name: str,
        argv: list[str] | None = None,
        *,
        command: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        unset: list[str] | None = None,
        log: str | None = None,
        probe: services.Probe | None = None,
        restart: services.RestartPolicy | None = None,
        limits: Limits | Mapping[str, float] | None = None,
    ) -> services.ServiceInfo:
        """Start a service (``argv``, or ``command`` through ``/bin/sh -c``); return once ready.

        Raises ``ServiceError`` (SERVICE_FAILED, its ``data`` holding the log
        tail and exit status) when it dies first, and ``NotReady`` when the
        probe times out (the service is then stopped).
        """
        params = services.StartParams(
            name=name,
            argv=argv,
            command=command,
            cwd=cwd,
            env=env,
            unset=unset,
            log=log,
            probe=probe,
            restart=restart,
            limits=as_limits(limits),
        )
        return await self.call(services.START, params)

    async def service_status(self, name: str) -> services.ServiceInfo:
        """A service's state, pid, uptime, restarts and last exit."""
        params = services.StatusParams(name=name)
        return await self.call(services.STATUS, params)

    async def service_logs(
        self,
        name: str,
        *,
        lines: int | None = None,
        nbytes: int | None = None,
        offset: int | None = None,
    ) -> services.LogsResult:
        """The last ``lines`` lines or ``nbytes`` bytes of the log, or the bytes from ``offset``."""
        params = services.LogsParams(name=name, lines=lines, nbytes=nbytes, offset=offset)
        return await self.call(services.LOGS, params)

    async def follow_service_logs(
        self,
        name: str,
        *,
        offset: int | None = None,
        lines: int | None = None,
        nbytes: int | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """Yield the log's bytes as they are written, until the service has ended for good.

        Starts at ``offset``, or at the start of the requested tail, or at the
        current end of the log. Leaving the iteration early cancels the
        follow in execd (wrap the iterator in ``contextlib.aclosing`` to do
        that at once rather than when it is garbage collected).
        """
        params = services.LogsParams(
            name=name, lines=lines, nbytes=nbytes, offset=offset, follow=True
        )
        handle = self.start(services.LOGS, params)
        try:
            async for chunk in handle.stream(services.LOG_STREAM):
                yield chunk
            await handle.result()
        finally:
            if not handle.done:
                handle.cancel()

    async def stop_service(
        self, name: str, *, signal: int = 15, grace: float | None = None
    ) -> services.ServiceInfo:
        """Signal the service's group, SIGKILL it after ``grace``; return the final state."""
        params = services.StopParams(name=name, signal=signal, grace=grace)
        return await self.call(services.STOP, params)

    async def restart_service(self, name: str) -> services.ServiceInfo:
        """Stop the service and start it again with the same parameters; return once ready."""
        params = services.RestartParams(name=name)
        return await self.call(services.RESTART, params)

    async def list_services(self) -> services.ListResult:
        """Every service execd remembers."""
        return await self.call(services.LIST, services.ListParams())

    # -- persistent shell sessions -------------------------------------------------

    async def open_session(
        self,
        name: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        unset: list[str] | None = None,
        limits: Limits | Mapping[str, float] | None = None,
    ) -> sessions.SessionInfo:
        """Open a persistent shell named ``name`` (``limits`` bound it and all it runs)."""
        params = sessions.OpenParams(
            name=name, cwd=cwd, env=env, unset=unset, limits=as_limits(limits)
        )
        return await self.call(sessions.OPEN, params)

    async def session_run(
        self,
        name: str,
        command: str,
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        kill_grace: float | None = None,
        output_cap: int | None = None,
    ) -> sessions.RunResult:
        """Run ``command`` in the session; its exit status, output and the cwd after it.

        ``limit_exceeded`` in the result names the session's limit the command ran into.
        """
        params = sessions.RunParams(
            name=name,
            command=command,
            stdin=stdin,
            timeout=timeout,
            kill_grace=kill_grace,
            output_cap=output_cap,
        )
        return await self.call(sessions.RUN, params)

    async def interrupt_session(self, name: str) -> sessions.InterruptResult:
        """Send SIGINT to the session's running command (``sent`` is false when idle)."""
        params = sessions.InterruptParams(name=name)
        return await self.call(sessions.INTERRUPT, params)

    async def close_session_shell(self, name: str) -> sessions.CloseResult:
        """Kill the session's shell and everything it started, and forget the session.

        (``shutdown`` is something else: it stops execd and everything it started.)
        """
        params = sessions.CloseParams(name=name)
        return await self.call(sessions.CLOSE, params)

    async def list_sessions(self) -> sessions.ListResult:
        """Every persistent shell session."""
        return await self.call(sessions.LIST, sessions.ListParams())
