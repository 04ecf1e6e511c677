"""Bounded output buffers: ByteRing and HeadTailBuffer against plain-bytes models."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execd.output import ByteRing, HeadTailBuffer, cut, fit_pair

chunks = st.lists(st.binary(max_size=64), max_size=40)


@given(capacity=st.integers(0, 100), writes=chunks)
@settings(max_examples=200, deadline=None)
def test_ring_keeps_the_last_capacity_bytes(capacity: int, writes: list[bytes]) -> None:
    ring = ByteRing(capacity)
    stream = b""
    for data in writes:
        ring.write(data)
        stream += data
        kept = stream[max(0, len(stream) - capacity) :] if capacity else b""
        assert ring.getvalue() == kept
        assert ring.total == len(stream)
        assert ring.start == len(stream) - len(kept)
        assert len(ring) == len(kept)


@given(
    capacity=st.integers(1, 100),
    writes=chunks,
    offset=st.integers(0, 3000),
    limit=st.one_of(st.none(), st.integers(0, 200)),
)
@settings(max_examples=200, deadline=None)
def test_ring_reads_from_absolute_offsets(
    capacity: int, writes: list[bytes], offset: int, limit: int | None
) -> None:
    ring = ByteRing(capacity)
    stream = b""
    for data in writes:
        ring.write(data)
        stream += data
    data, lost = ring.read_from(offset, limit)
    start = max(0, len(stream) - capacity)
    assert lost == max(0, start - offset)
    begin = max(offset, start)
    expected = stream[begin:] if limit is None else stream[begin : begin + limit]
    assert data == expected


def test_ring_resume_reports_loss_when_reader_falls_behind() -> None:
    ring = ByteRing(8)
    ring.write(b"abcdef")
    data, lost = ring.read_from(0)
    assert (data, lost) == (b"abcdef", 0)
    offset = 6
    ring.write(b"0123456789")  # 16 written, ring holds 89..: offsets 8..15
    data, lost = ring.read_from(offset)
    assert lost == 2
    assert data == b"23456789"
    assert ring.read_from(ring.total) == (b"", 0)


def test_ring_rejects_negative_arguments() -> None:
    with pytest.raises(ValueError):
        ByteRing(-1)
    with pytest.raises(ValueError):
        ByteRing(4).read_from(-1)


def model(stream: bytes, cap: int) -> tuple[bytes, int]:
    """What a HeadTailBuffer of ``cap`` keeps of ``stream``, and what it drops."""
    if len(stream) <= cap:
        return stream, 0
    head, tail = cap // 2, cap - cap // 2
    return stream[:head] + (stream[len(stream) - tail :] if tail else b""), len(stream) - cap


@given(cap=st.integers(0, 120), writes=chunks)
@settings(max_examples=200, deadline=None)
def test_head_tail_matches_model(cap: int, writes: list[bytes]) -> None:
    buf = HeadTailBuffer(cap)
    for data in writes:
        buf.write(data)
    stream = b"".join(writes)
    assert (buf.getvalue(), buf.dropped) == model(stream, cap)
    assert buf.total == len(stream)


@given(cap=st.integers(0, 120), limit=st.integers(0, 150), writes=chunks)
@settings(max_examples=200, deadline=None)
def test_cut_is_a_smaller_cap_after_the_fact(cap: int, limit: int, writes: list[bytes]) -> None:
    buf = HeadTailBuffer(cap)
    stream = b"".join(writes)
    buf.write(stream)
    taken = buf.take()
    assert taken == model(stream, cap)
    assert len(buf) == 0 and buf.getvalue() == b""
    assert cut(taken, limit) == model(stream, min(cap, limit))


@given(
    one=st.binary(max_size=200),
    two=st.binary(max_size=200),
    budget=st.integers(0, 500),
)
@settings(max_examples=300, deadline=None)
def test_fit_pair_shares_the_budget(one: bytes, two: bytes, budget: int) -> None:
    (a, a_dropped), (b, b_dropped) = fit_pair((one, 0), (two, 0), budget)
    assert len(a) + len(b) == min(budget, len(one) + len(two))
    assert (a, a_dropped) == model(one, len(a))
    assert (b, b_dropped) == model(two, len(b))
    # Neither is cut below half the budget while the other keeps more than its half.
    if len(a) < len(one):
        assert len(a) >= budget // 2 or len(b) == len(two)
    if len(b) < len(two):
        assert len(b) >= budget - budget // 2 or len(a) == len(one)


def test_head_tail_large_stream_keeps_ends_and_counts_the_gap() -> None:
    buf = HeadTailBuffer(10)
    for i in range(1000):
        buf.write(b"%04d" % i)
    value = buf.getvalue()
    assert value[:5] == b"00000"
    assert value[5:] == b"80999"
    assert buf.dropped == 4000 - 10


def test_memory_stays_within_the_cap() -> None:
    cap = 64 * 1024
    chunk = b"x" * 65536
    tracemalloc.start()
    try:
        buf = HeadTailBuffer(cap)
        ring = ByteRing(cap)
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(512):  # 32 MiB through each
            buf.write(chunk)
            ring.write(chunk)
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    assert buf.dropped == 512 * 65536 - cap
    assert ring.total == 512 * 65536
    # Two buffers of ``cap`` plus transient views, far below the 64 MiB written.
    assert peak < 8 * cap


def test_small_output_allocates_little() -> None:
    buf = HeadTailBuffer(1 << 30)
    buf.write(b"hello")
    assert buf.getvalue() == b"hello"
    ring = ByteRing(1 << 30)
    ring.write(b"hello")
    assert ring.getvalue() == b"hello"
