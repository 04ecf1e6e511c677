"""Clients and sessions of a real execd whose connections go through a :class:`CutProxy`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import harnessd
from harnessd.api import ExecdClient
from harnessd.launcher import Session, serve
from harnessd.runtime import LocalRuntime
from tests.conftest import eventually
from tests.support.cut_proxy import CutProxy
from tests.support.daemon import RunningExecd


class Clients:
    """Clients of execd through the cut proxy; the owner closes them all at the end."""

    def __init__(self, execd: RunningExecd, proxy: CutProxy) -> None:
        self.execd = execd
        self.proxy = proxy
        self.opened: list[ExecdClient] = []

    async def connect(self) -> ExecdClient:
        client = await harnessd.connect(
            "127.0.0.1", self.proxy.port, self.execd.token, reattach_within=20.0
        )
        self.opened.append(client)
        return client

    async def reconnect(self, lost: ExecdClient) -> ExecdClient:
        """A new client that adopts what ``lost`` had in flight."""
        await eventually(lambda: lost.closed, what="the cut noticed")
        fresh = await self.connect()
        fresh.adopt(lost.take_orphans())
        return fresh

    async def close(self) -> None:
        for client in self.opened:
            await client.close()


@contextlib.asynccontextmanager
async def proxied_session(
    tmp_path: Path, **options: Any
) -> AsyncIterator[tuple[Session, CutProxy]]:
    """A launched execd whose session client connects through a cut proxy."""
    async with serve(
        LocalRuntime(),
        workdir=str(tmp_path / "execd-w"),
        extra_args=("--state-dir", str(tmp_path / "state")),
        **options,
    ) as session:
        direct = session.host, session.port
        proxy = await CutProxy(*direct).start()
        try:
            session.host, session.port = "127.0.0.1", proxy.port
            await session.reconnect()
            yield session, proxy
        finally:
            session.host, session.port = direct
            await proxy.close()
