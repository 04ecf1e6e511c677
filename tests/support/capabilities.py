"""Capabilities under test in the test's own process: configured, marked, and cleaned up after.

Each capability test module makes its fixture with :func:`capability_fixture`.
The capability's processes carry a fresh marker; when the test ends the
capability is closed and the test fails if any marked process survives.
A test adjusts limits with ``@pytest.mark.limits(name=value, ...)``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from execd import marker
from execd.config import Config, Limits
from tests.conftest import eventually

MARKER_VAR = "EXECD_MARKER"


class Closable(Protocol):
    def close(self) -> Awaitable[None]: ...


C = TypeVar("C", bound=Closable)


def limits_for(request: pytest.FixtureRequest, **defaults: Any) -> Limits:
    """``defaults`` overridden by the test's ``limits`` mark."""
    mark = request.node.get_closest_marker("limits")
    return Limits(**(defaults | (mark.kwargs if mark is not None else {})))


@contextlib.asynccontextmanager
async def marked(
    make: Callable[[Config, dict[str, str]], C],
    request: pytest.FixtureRequest,
    tag: str,
    state_dir: Path,
    **defaults: Any,
) -> AsyncIterator[C]:
    """``make(config, base_env)`` with marker ``tag``; closed after, and nothing marked left."""
    config = Config(
        marker_var=MARKER_VAR,
        marker=tag,
        state_dir=str(state_dir),
        limits=limits_for(request, **defaults),
    )
    cap = make(config, marker.child_environment(os.environ, MARKER_VAR, tag))
    try:
        yield cap
    finally:
        await cap.close()
    await eventually(lambda: not marker.find_marked(MARKER_VAR, tag), what="no marked process")


def capability_fixture(
    make: Callable[[Config, dict[str, str]], C],
    *,
    after: Callable[[C, Path], None] | None = None,
    **defaults: Any,
) -> Any:
    """A fixture yielding ``make(...)`` under :func:`marked`, state in ``tmp_path/state``.

    ``after(capability, state_dir)`` checks what is left once it is closed.
    """

    @pytest.fixture
    async def capability(
        request: pytest.FixtureRequest, marker_tag: str, tmp_path: Path
    ) -> AsyncIterator[C]:
        state = tmp_path / "state"
        async with marked(make, request, marker_tag, state, **defaults) as cap:
            yield cap
        if after is not None:
            after(cap, state)

    return capability
