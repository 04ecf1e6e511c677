"""Schemas of request ids: calls that outlive their connection and run at most once.

A ``call`` may carry a request id (``rid``, 16 random bytes; PROTOCOL.md
section 8.1). execd then keeps the call running for a grace period when its
connection is lost, keeps its outcome for a bounded retention window once it
has finished, and never runs a second call with the same id. After
reconnecting, a client asks for the outcome with ``request.attach``: it gets
the rest of the call's output streams (from the offsets it already holds) and
then the call's own reply or error, exactly as the original call would have
had them; or ``REQUEST_NOT_KNOWN`` when execd does not know the id.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from protocol.messages import Nonce, RequestId
from protocol.rpc import Rpc, Schema

#: Why an id is not known (``data.reason`` of REQUEST_NOT_KNOWN).
NotKnownReason = Literal["unknown", "evicted"]


class AttachParams(Schema, kw_only=True):
    """``request.attach``: the outcome of the call with request id ``rid``.

    ``offsets`` maps each output stream name to the bytes of it the client
    already holds; the attach call's streams carry the rest, from there.
    ``sent_on``: the server nonce of the connection the call was first sent
    on; when execd does not know the id, it says whether that connection was
    one of its own (``NotKnown.seen``).
    """

    rid: RequestId
    sent_on: Nonce | None = None
    offsets: Annotated[
        dict[str, Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=8)
    ] = msgspec.field(default_factory=dict)


class NotKnown(Schema, kw_only=True):
    """``data`` of a REQUEST_NOT_KNOWN error.

    ``reason``: ``"evicted"`` when the outcome was dropped from the retention
    window (oldest first) or its grace expired before anyone attached and it
    was evicted since; ``"unknown"`` when this execd never saw the id (it never
    arrived, or execd restarted since). ``seen``: the attach's ``sent_on``
    names a connection of this execd, so the call never arrived and sending it
    again with the same id is safe (it cannot have run; a copy still on its way
    would attach rather than run).
    """

    reason: NotKnownReason
    rid: str
    seen: bool = False


# -- the methods --------------------------------------------------------------
#: The result is the attached call's own result, whatever its method's type.
ATTACH: Final = Rpc("request.attach", AttachParams, msgspec.Raw)

RPCS: Final = (ATTACH,)

#: Methods whose calls belong to their connection and are never tracked by request id:
#: a watch lives and dies with the connection that subscribed, and an attach is itself
#: a way back to a request.
CONNECTION_SCOPED: Final = frozenset({ATTACH.name, "watch.subscribe", "watch.unsubscribe"})
