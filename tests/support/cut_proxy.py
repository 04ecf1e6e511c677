"""A TCP proxy whose connections the test cuts: now, or after so many bytes in one direction.

Each accepted connection is paired with a fresh connection upstream; bytes are
forwarded as they come, in both directions. :meth:`CutProxy.cut` aborts every
live pair at once (both sockets, dropping whatever either still buffers, as
a vanished route does); :meth:`CutProxy.cut_after` arms a cut that happens
once ``nbytes`` more have been forwarded in one direction -- the byte count
lands inside frames, so a cut can fall anywhere in the protocol. While
:attr:`CutProxy.refusing` is set, new connections are closed on arrival (an
outage that outlasts the first reconnect attempts). :meth:`CutProxy.blackhole`
drops every byte of the live connections from then on and closes nothing (a
route that vanished without a FIN or RST): only an end that gives up on its
silent peer closes its connection, which :attr:`CutProxy.closed_by_upstream`
counts for the upstream end.
"""

from __future__ import annotations

import asyncio
from typing import Literal, cast

Direction = Literal["up", "down"]


class _Side(asyncio.Protocol):
    def __init__(self, proxy: CutProxy, pair: _Pair, direction: Direction) -> None:
        self.proxy = proxy
        self.pair = pair
        self.direction = direction  # of the bytes this side receives
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if self.pair.closed:  # refused (or cut) before the transport was handed over
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self.pair.forward(self, data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self is self.pair.server and not self.pair.closed:
            self.proxy.closed_by_upstream += 1
        self.pair.close()


class _Pair:
    def __init__(self, proxy: CutProxy) -> None:
        self.proxy = proxy
        self.client = _Side(proxy, self, "up")
        self.server = _Side(proxy, self, "down")
        self.forwarded: dict[Direction, int] = {"up": 0, "down": 0}
        self.limit: dict[Direction, int] = {}
        self.closed = False
        self.blackholed = False

    def forward(self, side: _Side, data: bytes) -> None:
        if self.closed or self.blackholed:
            return
        peer = self.server if side is self.client else self.client
        if peer.transport is None:
            side.pending.append(data)
            return
        limit = self.limit.get(side.direction)
        if limit is not None:
            room = max(limit - self.forwarded[side.direction], 0)
            if len(data) >= room:
                peer.transport.write(data[:room])
                self.forwarded[side.direction] += room
                self.proxy.cut()
                return
        self.forwarded[side.direction] += len(data)
        peer.transport.write(data)

    def flush(self) -> None:
        pending, self.client.pending = self.client.pending, []
        for data in pending:
            self.forward(self.client, data)

    def close(self) -> None:
        """Abort both ends (whatever is buffered is dropped)."""
        if self.closed:
            return
        self.closed = True
        self.proxy.pairs.discard(self)
        for side in (self.client, self.server):
            if side.transport is not None and not side.transport.is_closing():
                side.transport.abort()


class CutProxy:
    """Forward ``host:port`` to ``upstream``; cut connections when told."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.pairs: set[_Pair] = set()
        self.refusing = False
        self.accepted = 0
        #: Connections closed on arrival while :attr:`refusing` was set.
        self.refused = 0
        self.cuts = 0
        #: Connections the upstream end closed (while the proxy had not).
        self.closed_by_upstream = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> CutProxy:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def _accept(self) -> asyncio.Protocol:
        pair = _Pair(self)
        if self.refusing:
            self.refused += 1
            asyncio.get_running_loop().call_soon(pair.close)
            return pair.client
        self.accepted += 1
        self.pairs.add(pair)
        task = asyncio.get_running_loop().create_task(self._connect(pair))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return pair.client

    async def _connect(self, pair: _Pair) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: pair.server, *self.upstream)
        except OSError:
            pair.close()
            return
        if pair.closed:
            if pair.server.transport is not None:
                pair.server.transport.abort()
            return
        pair.flush()

    def cut(self) -> int:
        """Abort every live connection now; how many there were."""
        pairs = list(self.pairs)
        for pair in pairs:
            pair.close()
        self.cuts += 1
        return len(pairs)

    def blackhole(self) -> int:
        """Drop every byte of every live connection from now on, closing none; how many."""
        for pair in self.pairs:
            pair.blackholed = True
        return len(self.pairs)

    def cut_after(self, direction: Direction, nbytes: int) -> None:
        """Cut once ``nbytes`` more went ``up`` (to the server) or ``down`` on a live connection.

        Counted from now, on every connection live now (the first to get there cuts them all).
        """
        for pair in self.pairs:
            pair.limit[direction] = pair.forwarded[direction] + nbytes

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
