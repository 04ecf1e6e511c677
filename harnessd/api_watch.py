"""Typed client methods for execd's path watches: :class:`WatchClient` and :class:`PathWatch`.

:class:`WatchClient` is a base of :class:`harnessd.api.ExecdClient`::

    changes = await client.watch("/work", recursive=True)
    try:
        async for kind, event in changes:
            ...
    finally:
        await changes.close()

    await client.wait_for_path("/work/out.json", condition="nonempty", timeout=60)
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from harnessd.client import Client
from harnessd.errors import RemoteError
from protocol.rpc import watch as watch_rpc


class WatchClient(Client):
    """``watch.*`` methods."""

    async def watch(
        self,
        path: str,
        *,
        recursive: bool = False,
        events: list[watch_rpc.ChangeKind] | None = None,
        debounce: float = 0.0,
        follow: bool = True,
    ) -> PathWatch:
        """Subscribe to changes under ``path``; iterate the returned :class:`~harnessd.api_watch.PathWatch`."""
        params = watch_rpc.SubscribeParams(
            path=path, recursive=recursive, events=events, debounce=debounce, follow=follow
        )
        result = await self.call(watch_rpc.SUBSCRIBE, params)
        return PathWatch(self, result)

    async def wait_for_path(
        self, path: str, *, condition: watch_rpc.Condition = "exists", timeout: float = 30.0
    ) -> watch_rpc.WaitForPathResult:
        """Block until ``path`` meets ``condition`` (exists, absent, file, dir, nonempty)."""
        params = watch_rpc.WaitForPathParams(path=path, condition=condition, timeout=timeout)
        return await self.call(watch_rpc.WAIT_FOR_PATH, params)


class PathWatch:
    """A live subscription: iterate ``(kind, event)`` pairs until it ends."""

    def __init__(self, client: Client, result: watch_rpc.SubscribeResult) -> None:
        self._client = client
        self.watch_id = result.watch_id
        self.result = result
        self._queue = client.subscribe(result.watch_id)
        self.ended = False

    async def next(self, timeout: float | None = None) -> tuple[str, watch_rpc.WatchEvent]:
        """The next event; raises TimeoutError, or StopAsyncIteration once ended."""
        if self.ended:
            raise StopAsyncIteration
        async with asyncio.timeout(timeout):
            event = await self._queue.get()
        if event is None:
            self.ended = True
            raise StopAsyncIteration
        data = msgspec.msgpack.decode(event.data, type=watch_rpc.WatchEvent)
        if event.name == "ended":
            self.ended = True
            self._client.unsubscribe(self.watch_id)
        return event.name, data

    def __aiter__(self) -> PathWatch:
        return self

    async def __anext__(self) -> tuple[str, watch_rpc.WatchEvent]:
        return await self.next()

    async def close(self) -> None:
        """Unsubscribe (idempotent)."""
        if self.ended or self._client.closed:
            self._client.unsubscribe(self.watch_id)
            return
        with contextlib.suppress(RemoteError):
            await self._client.call(
                watch_rpc.UNSUBSCRIBE, watch_rpc.UnsubscribeParams(watch_id=self.watch_id)
            )
        self._client.unsubscribe(self.watch_id)
        self.ended = True
