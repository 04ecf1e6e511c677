"""Schemas of execd's core methods: identity, no-op, echo and session close."""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from protocol.rpc import Rpc, Schema
from protocol.rpc.resources import LimitsInfo


class NoParams(Schema):
    """Methods that take nothing accept an empty map (and ignore extra keys)."""


class EchoParams(Schema):
    """``server.echo``: the payload comes back unchanged."""

    data: bytes = b""


class ServerInfo(Schema):
    """``server.info``: who this execd is."""

    pid: int
    uid: int
    marker: str
    marker_var: str
    protocol: int
    version: str
    cwd: str
    ledger_dir: str
    methods: list[str]
    #: execd's default command limits and how each limit is enforced.
    limits: LimitsInfo | None = None


class CloseParams(Schema):
    """``session.close``: clean up by marker; with ``shutdown`` execd exits after replying."""

    shutdown: bool = True
    timeout: Annotated[float, msgspec.Meta(ge=0, le=600)] = 10.0


class CloseReport(Schema):
    """What session close did: processes killed by marker and any left behind."""

    killed: int
    remaining: list[int]
    rounds: int
    elapsed: float


# -- the methods --------------------------------------------------------------
NOOP: Final = Rpc("server.noop", NoParams, type(None))
ECHO: Final = Rpc("server.echo", EchoParams, bytes)
INFO: Final = Rpc("server.info", NoParams, ServerInfo)
CLOSE: Final = Rpc("session.close", CloseParams, CloseReport)

RPCS: Final = (NOOP, ECHO, INFO, CLOSE)
