"""One shape for what ``serve()`` and ``connect()`` return: await it, or ``async with`` it.

``x = await opening`` hands the resource to the caller, who closes it;
``async with opening as x:`` closes it when the block ends, also on an
exception or a cancellation. The resource is opened once, however the object is
used.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Opening(Generic[T]):
    """An awaitable that opens a resource, and an async context manager that also closes it."""

    def __init__(
        self, open: Callable[[], Awaitable[T]], close: Callable[[T], Awaitable[object]]
    ) -> None:
        self._open_fn = open
        self._close_fn = close
        self._resource: T | None = None

    async def _open(self) -> T:
        if self._resource is None:
            self._resource = await self._open_fn()
        return self._resource

    def __await__(self) -> Generator[Any, None, T]:
        return self._open().__await__()

    async def __aenter__(self) -> T:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        if self._resource is not None:
            await self._close_fn(self._resource)
