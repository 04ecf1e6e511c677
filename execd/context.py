"""The contract between the dispatcher and the capability handlers.

Every RPC method is an ``async def handler(params, ctx) -> result`` where
``params`` is a msgspec Struct decoded from the call, ``ctx`` is a
:class:`CallContext`, and ``result`` is any msgspec-encodable value (usually a
Struct). A handler reports failure by raising an ``execd.errors.ExecdError``.
A handler is the method named after its RPC with the dot as an underscore
(``shell.run`` is ``shell_run``, ``watch.wait_for_path`` is
``watch_wait_for_path``), so searching for a method's name finds its handler.
A capability's dispatch entries are its methods' declarations in
:mod:`protocol.rpc`, each bound to the handler of that name (:func:`bind`).

Cancellation: when the client cancels a call, or its connection drops, the
dispatcher cancels the handler's task (``asyncio.CancelledError``). Handlers
release what they hold in ``finally`` blocks.

Streams: a handler sends bytes to the client with :meth:`CallContext.send`,
which waits for flow-control credit, and receives the client's bytes for a
stream with :meth:`CallContext.receive`. Handlers never touch sockets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol.errors import ConnectionLost
from protocol.rpc import Rpc

__all__ = ["CallContext", "ConnectionLost", "Handler", "Method", "bind", "handler_name"]


class CallContext(Protocol):
    """What one running call can do besides returning its result."""

    @property
    def call_id(self) -> int:
        """The call's id on its connection."""
        ...

    @property
    def connection_id(self) -> int:
        """A process-unique id of the connection the call came on."""
        ...

    @property
    def max_chunk(self) -> int:
        """The largest data payload one chunk may carry to this peer."""
        ...

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        """Send ``data`` on ``stream`` to the client, waiting for credit.

        Large ``data`` is split into chunks that fit the peer's frame cap.
        ``end`` marks the stream finished. Raises
        :class:`~protocol.errors.ConnectionLost` when the connection is gone.
        """
        ...

    def receive(self, stream: str) -> AsyncIterator[bytes]:
        """Iterate the client's chunks on ``stream`` until it sends ``end``."""
        ...

    async def push_event(self, topic: int, name: str, data: Any) -> None:
        """Send a server-pushed event on this connection (watch events)."""
        ...

    def on_close(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        """Run ``callback`` when the connection that carries this call closes."""
        ...


Handler = Callable[[Any, CallContext], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Method:
    """One entry of the dispatch table: a declared RPC and the handler that serves it."""

    rpc: Rpc[Any, Any]
    handler: Handler
    #: The handler calls nothing that needs a current task (``asyncio.timeout``) before
    #: it first suspends, so its first step may run without one (:mod:`execd.calls`).
    direct: bool = False
    #: The RPC's name and params type, kept at hand for the dispatcher.
    name: str = field(init=False)
    params: type = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.rpc.name)
        object.__setattr__(self, "params", self.rpc.params)


def handler_name(rpc: Rpc[Any, Any]) -> str:
    """The name of the handler of ``rpc``: ``files.read`` is ``files_read``."""
    return rpc.name.replace(".", "_")


def bind(
    capability: object,
    rpcs: Iterable[Rpc[Any, Any]],
    direct: Iterable[Rpc[Any, Any]] = (),
) -> list[Method]:
    """The dispatch entries of a capability: each of ``rpcs`` with its handler, found by name.

    Those also in ``direct`` are marked :attr:`Method.direct` (their handlers
    need no current task before they first suspend).
    ``tests/unit/test_app.py`` holds each handler's annotations to its
    declaration (params and result types).
    """
    marked = set(direct)
    return [
        Method(rpc, getattr(capability, handler_name(rpc)), direct=rpc in marked) for rpc in rpcs
    ]
