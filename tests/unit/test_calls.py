"""execd.calls: a call's first step runs at once; a call that suspends finishes in a task, alike."""

from __future__ import annotations

import asyncio

import pytest

from execd import calls

pytestmark = pytest.mark.anyio


@pytest.fixture(params=[True, False], ids=["direct", "task"])
def direct(request: pytest.FixtureRequest) -> bool:
    """Each test runs with direct first steps and with an ordinary task."""
    value: bool = request.param
    return value


async def test_a_call_that_never_suspends_needs_no_task(direct: bool) -> None:
    ran: list[str] = []

    async def handler() -> None:
        ran.append("done")

    task = calls.start(asyncio.get_running_loop(), handler(), "noop", direct)
    if task is not None:  # 3.11 without direct: an ordinary task
        assert not direct
        await task
    assert ran == ["done"]


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


# At once: a Cancel read right behind its Call, before the task that runs the rest has run.
@pytest.mark.parametrize("at_once", [False, True], ids=["after a step", "at once"])
async def test_cancelling_the_rest_reaches_the_handler(direct: bool, at_once: bool) -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    seen: list[str] = []

    async def handler() -> None:
        seen.append("first step")
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled in the handler")
            raise

    task = calls.start(loop, handler(), "cancelled", direct)
    assert task is not None
    if not at_once:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if not seen:
        # Its first step was left to the task (3.11, not direct), which never ran it, as
        # any task cancelled before it runs.
        assert at_once and not direct
    else:
        # A handler that has started is cancelled where it waits.
        assert seen == ["first step", "cancelled in the handler"]


@pytest.mark.parametrize("gate_error", [KeyError, None], ids=["the future", "the handler"])
async def test_an_error_after_resuming_is_the_tasks(
    direct: bool, gate_error: type[Exception] | None
) -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()

    async def handler() -> None:
        await gate
        raise ValueError("after the first suspension")

    task = calls.start(loop, handler(), "fails", direct)
    assert task is not None
    if gate_error is None:
        gate.set_result(None)
    else:
        gate.set_exception(gate_error("through the future"))
    with pytest.raises(gate_error or ValueError):
        await task
