"""execd.calls: a call's first step runs at once; a call that suspends finishes in a task, alike."""

from __future__ import annotations

import asyncio

import pytest

from execd import calls

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("direct", [True, False])
async def test_a_call_that_never_suspends_needs_no_task(direct: bool) -> None:
    ran: list[str] = []

    async def handler() -> None:
        ran.append("done")

    task = calls.start(asyncio.get_running_loop(), handler(), "noop", direct)
    if task is not None:  # 3.11 without direct: an ordinary task
        assert not direct
        await task
    assert ran == ["done"]


@pytest.mark.parametrize("direct", [True, False])
async def test_a_call_that_suspends_finishes_in_a_task(direct: bool) -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[int] = loop.create_future()
    seen: list[object] = []

    async def handler() -> None:
        seen.append("first step")
        seen.append(await gate)
        await asyncio.sleep(0)
        async with asyncio.timeout(5):  # needs a current task, which it has by now
            seen.append(await asyncio.sleep(0, "slept"))

    task = calls.start(loop, handler(), "suspends", direct)
    assert task is not None and not task.done()
    gate.set_result(7)
    await task
    assert seen == ["first step", 7, "slept"]


@pytest.mark.parametrize("direct", [True, False])
async def test_cancelling_the_rest_reaches_the_handler(direct: bool) -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    seen: list[str] = []

    async def handler() -> None:
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled in the handler")
            raise

    task = calls.start(loop, handler(), "cancelled", direct)
    assert task is not None
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled in the handler"]


@pytest.mark.parametrize("direct", [True, False])
async def test_an_error_after_resuming_is_the_tasks(direct: bool) -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()

    async def handler() -> None:
        await gate
        raise ValueError("after the first suspension")

    task = calls.start(loop, handler(), "fails", direct)
    assert task is not None
    gate.set_exception(KeyError("through the future"))
    with pytest.raises(KeyError):
        await task
    gate2: asyncio.Future[None] = loop.create_future()

    async def handler2() -> None:
        await gate2
        raise ValueError("after the first suspension")

    task = calls.start(loop, handler2(), "fails", direct)
    assert task is not None
    gate2.set_result(None)
    with pytest.raises(ValueError, match="after the first suspension"):
        await task
