"""What every test shares: the event loops async tests run on, and waiting for a condition.

Async tests are plain ``async def`` functions in modules marked
``pytestmark = pytest.mark.anyio``: anyio's pytest plugin runs each one, with
its async fixtures, on a fresh event loop chosen by :func:`anyio_backend`,
and fails the test for an exception that reached the loop's exception
handler (a callback that raised, a task whose error nobody retrieved).

A test that needs a real execd takes the :func:`execd` fixture (a
subprocess, its arguments from an ``execd_args`` mark, always torn down) and,
to talk to it, :func:`client`.

By default every async test runs twice, on uvloop (what execd and the
harnessd command line use) and on asyncio's own loop (what a library user
may bring): code that runs in the test's process must work on both. Tests
whose own process only drives real daemons in subprocesses gain nothing
from the second loop; they run once with :data:`one_loop`.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar, overload

import pytest
from hypothesis import settings

import harnessd
from harnessd.api import ExecdClient
from protocol.fuzz.strategies import register_profiles
from tests.support.daemon import RunningExecd, start_execd

T = TypeVar("T")

# The property tests' example counts follow the hypothesis profile: splitexec-nightly runs 50
# times as many (pytest --hypothesis-profile=splitexec-nightly, or HYPOTHESIS_PROFILE=...).
register_profiles()
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])

# Ray takes loopback as this machine's address, so a test's Ray listens on 127.0.0.1 only
# (read once, when Ray is first imported: hence here, before any test module).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

UVLOOP = pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")
ASYNCIO = pytest.param(("asyncio", {}), id="asyncio")

one_loop = pytest.mark.one_loop
"""Run a test (or, as ``pytestmark``, a module's async tests) on asyncio's own loop only."""


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Give every async test its loops: uvloop, then asyncio's own (only that with one_loop)."""
    if "anyio_backend" in metafunc.fixturenames:
        once = metafunc.definition.get_closest_marker("one_loop") is not None
        metafunc.parametrize("anyio_backend", [ASYNCIO] if once else [UVLOOP, ASYNCIO])


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> object:
    """The event loop an async test runs on (each test is parametrized with its loops)."""
    return request.param


@pytest.fixture
def marker_tag() -> str:
    """A fresh marker for the processes one test starts."""
    return secrets.token_hex(8)


@pytest.fixture
def execd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunningExecd]:
    """A real execd for the test, started with the arguments of its ``execd_args`` mark."""
    mark = request.node.get_closest_marker("execd_args")
    with start_execd(tmp_path, *(mark.args if mark is not None else ())) as running:
        yield running


@pytest.fixture
async def client(execd: RunningExecd) -> AsyncIterator[ExecdClient]:
    """A client connected to :func:`execd`, closed after the test."""
    connected = await harnessd.connect(execd.host, execd.port, execd.token)
    try:
        yield connected
    finally:
        await connected.close()


@overload
async def eventually(
    check: Callable[[], Awaitable[T]],
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str = "",
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str = "",
) -> T: ...


async def eventually(
    check: Callable[[], T | Awaitable[T]],
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str = "",
) -> T:
    """Wait until ``check()`` (a function or a coroutine function) gives something true; return it.

    Fails the test (AssertionError naming ``what``) once ``timeout`` seconds
    have passed. For conditions nothing announces: a process's death, a file
    another process writes. Where the code under test offers an event or a
    future, await that instead.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        assert time.monotonic() < deadline, f"{what or 'condition'} not reached in {timeout:g} s"
        await asyncio.sleep(interval)


def eventually_blocking(
    check: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> T:
    """:func:`eventually` for code that runs no event loop (it sleeps the thread)."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what or 'condition'} not reached in {timeout:g} s"
        time.sleep(interval)
    return result
