"""Schemas of execd's core methods: identity, no-op, echo and session close."""

from __future__ import annotations

from typing import Annotated

import msgspec

from protocol.api.resources import LimitsInfo


class NoParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Methods that take nothing accept an empty map (and ignore extra keys)."""


class EchoParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``server.echo``: the payload comes back unchanged."""

    data: bytes = b""


class ServerInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
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


class CloseParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``session.close``: clean up by marker; with ``shutdown`` execd exits after replying."""

    shutdown: bool = True
    timeout: Annotated[float, msgspec.Meta(ge=0, le=600)] = 10.0


class CloseReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What session close did: processes killed by marker and any left behind."""

    killed: int
    remaining: list[int]
    rounds: int
    elapsed: float
