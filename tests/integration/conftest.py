"""Fixtures of the integration tests that cut connections: a proxy in front of execd, its clients."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.cut_proxy import CutProxy
from tests.support.daemon import RunningExecd
from tests.support.proxied import Clients


@pytest.fixture
async def proxy(execd: RunningExecd) -> AsyncIterator[CutProxy]:
    """A :class:`CutProxy` in front of the test's execd."""
    cut = await CutProxy(execd.host, execd.port).start()
    try:
        yield cut
    finally:
        await cut.close()


@pytest.fixture
async def clients(execd: RunningExecd, proxy: CutProxy) -> AsyncIterator[Clients]:
    """Clients of the test's execd through :func:`proxy` (reattach allowed), closed at the end."""
    opened = Clients(execd, proxy)
    try:
        yield opened
    finally:
        await opened.close()
