"""execd.requests.RequestTable: the retention window's books, in process.

The integration tests drive retention through a real execd; these hold the
table's own bookkeeping to its bounds over many calls, which a socket would
only make slow: the count and byte bounds, the order of eviction, and the
bounded memory of evicted ids (``EVICTED_MEMORY`` per retained id).
"""

from __future__ import annotations

import msgspec
import pytest

from execd.config import Limits
from execd.context import Method
from execd.errors import ExecdError, InvalidParams, RequestNotKnown
from execd.requests import ENTRY_OVERHEAD, EVICTED_MEMORY, MAPPED_MIN, RequestTable
from protocol.errors import ErrorCode
from protocol.rpc import core
from protocol.rpc import request as api
from protocol.rpc import watch as watch_rpc
from tests.support.local_ctx import LocalContext

pytestmark = pytest.mark.anyio


async def _noop(params: object, ctx: object) -> None:
    return None


NOOP = Method(core.NOOP, _noop)


def _rid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def _run(table: RequestTable, n: int, result: bytes = b"\xc0") -> None:
    """Track and finish call ``n`` (request id ``_rid(n)``) with ``result``."""
    method, tracked = table.track(_rid(n), NOOP)
    assert method is NOOP and tracked
    table.finish(_rid(n), result)


def _table_of_bytes(bound: int) -> RequestTable:
    """A table bounded by ``bound`` bytes (and by a count it will not reach)."""
    return RequestTable(
        msgspec.structs.replace(Limits(), request_retention=100, request_retention_bytes=bound)
    )


async def _reason(table: RequestTable, n: int) -> str:
    """What an attach to call ``n`` hears: "kept", or why it is not known."""
    try:
        await table.request_attach(api.AttachParams(rid=_rid(n), offsets={}), LocalContext())
    except RequestNotKnown as exc:
        assert isinstance(exc.data, dict)
        reason: str = exc.data["reason"]
        return reason
    return "kept"


async def test_the_window_keeps_the_newest_calls_and_remembers_a_bounded_number_evicted() -> None:
    retention = 8
    table = RequestTable(msgspec.structs.replace(Limits(), request_retention=retention))
    calls = retention + EVICTED_MEMORY * retention + 20
    for n in range(calls):
        _run(table, n)
        assert table.kept == min(n + 1, retention)
    assert table.running == 0
    assert table.evictions == calls - retention
    assert table.kept_bytes == retention * (ENTRY_OVERHEAD + 1)
    # The newest are kept, the ones before them remembered as evicted, the oldest forgotten.
    remembered = EVICTED_MEMORY * retention
    first_kept = calls - retention
    for n in range(first_kept, calls):
        assert await _reason(table, n) == "kept"
    for n in (first_kept - 1, first_kept - remembered):
        assert await _reason(table, n) == "evicted"
    for n in (0, first_kept - remembered - 1):
        assert await _reason(table, n) == "unknown"


async def test_the_byte_bound_evicts_the_oldest_outcomes_first() -> None:
    result = bytes(1000)
    per_call = ENTRY_OVERHEAD + len(result)
    table = _table_of_bytes(3 * per_call)
    for n in range(10):
        _run(table, n, result)
        assert table.kept_bytes <= 3 * per_call
    assert table.kept == 3
    assert [await _reason(table, n) for n in range(5, 10)] == [
        "evicted",
        "evicted",
        "kept",
        "kept",
        "kept",
    ]


async def test_a_known_id_attaches_instead_of_running_again() -> None:
    table = RequestTable(Limits())
    _run(table, 1)
    method, tracked = table.track(_rid(1), NOOP)
    assert not tracked and method is not NOOP  # an attach, never a second run
    answer = await method.handler(None, LocalContext(call_id=2))
    assert bytes(answer) == b"\xc0"  # the kept result, as the call's answer


async def _answer(table: RequestTable, n: int) -> bytes | tuple[int, str]:
    """What an attach to call ``n`` is answered: the result, or the error's code and message."""
    try:
        answer = await table.request_attach(
            api.AttachParams(rid=_rid(n), offsets={}), LocalContext()
        )
    except ExecdError as exc:
        return int(exc.code), exc.message
    return bytes(answer)


LARGE_RESULT = msgspec.msgpack.encode(bytes(range(256)) * (MAPPED_MIN // 256))


@pytest.mark.parametrize("outcome", [b"\x92\x01\x02", LARGE_RESULT, InvalidParams("no such thing")])
async def test_a_call_finished_with_its_record_opened_is_kept_as_one_finished_without(
    outcome: bytes | ExecdError,
) -> None:
    # Most calls answer in their first step and never open a record: what the window keeps
    # of them must not differ from what it keeps of a call that ran on.
    bare, opened = RequestTable(Limits()), RequestTable(Limits())
    assert bare.track(_rid(1), NOOP) == (NOOP, True)
    assert opened.track(_rid(1), NOOP) == (NOOP, True)
    req = opened.open(_rid(1), NOOP.name, LocalContext(call_id=1))
    assert opened.running == 1
    bare.finish(_rid(1), outcome)
    opened.finish(_rid(1), outcome, req)
    assert bare.running == opened.running == 0
    assert bare.kept == opened.kept == 1
    assert bare.kept_bytes == opened.kept_bytes
    assert await _answer(bare, 1) == await _answer(opened, 1)


async def test_large_results_are_kept_byte_for_byte_and_counted_and_evicted_as_small_ones() -> None:
    # From MAPPED_MIN on a kept result lives in a mapping of its own, not on the heap.
    assert len(LARGE_RESULT) >= MAPPED_MIN
    per_call = ENTRY_OVERHEAD + len(LARGE_RESULT)
    table = _table_of_bytes(2 * per_call)
    for n in range(4):
        _run(table, n, LARGE_RESULT)
    assert table.kept == 2 and table.kept_bytes == 2 * per_call
    assert [await _reason(table, n) for n in range(4)] == ["evicted", "evicted", "kept", "kept"]
    for n in (2, 3):
        assert await _answer(table, n) == LARGE_RESULT
    method, tracked = table.track(_rid(3), NOOP)
    assert not tracked
    answer = await method.handler(None, LocalContext(call_id=9))
    assert bytes(answer) == LARGE_RESULT


class _Plain(LocalContext):
    """A plain dispatch context: it records the fate the dispatcher reports, which is ignored."""

    def __init__(self, call_id: int = 1) -> None:
        super().__init__(call_id=call_id)
        self.fate: list[str] = []

    def running(self) -> None:
        self.fate.append("running")

    def finished(self, outcome: bytes | ExecdError) -> None:
        self.fate.append("finished")

    def cancelled(self) -> None:
        self.fate.append("cancelled")

    def upload_lost(self) -> ExecdError | None:
        return None


async def test_dispatch_is_the_one_layer_that_tracks_calls() -> None:
    table = RequestTable(Limits())
    # A new id runs the method with a context of its own, on a virtual connection,
    # whose fate the table keeps.
    origin = _Plain(call_id=4)
    method, ctx = table.dispatch(NOOP, origin, _rid(1))
    assert method is NOOP and ctx is not origin
    assert ctx.call_id == 4 and ctx.connection_id == -origin.connection_id
    ctx.running()
    assert table.running == 1
    ctx.finished(b"\xc0")
    assert (table.running, table.kept) == (0, 1)
    # A known id attaches (the method never runs again) with the plain context.
    again = _Plain(call_id=5)
    method, ctx = table.dispatch(NOOP, again, _rid(1))
    assert method is not NOOP and ctx is again
    assert bytes(await method.handler(None, ctx)) == b"\xc0"
    # A method that belongs to its connection is never tracked.
    subscribe = Method(watch_rpc.SUBSCRIBE, _noop)
    plain = _Plain()
    assert table.dispatch(subscribe, plain, _rid(2)) == (subscribe, plain)
    # A tracked call's cancellation is kept as its outcome.
    method, ctx = table.dispatch(NOOP, _Plain(), _rid(3))
    ctx.cancelled()
    assert await _answer(table, 3) == (int(ErrorCode.CANCELLED), "server.noop was cancelled")
