"""The shell tool's bounded copy of streamed output keeps what execd keeps in collected mode."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from harnessd.tool_text import HeadTail


@given(st.integers(0, 64), st.lists(st.binary(max_size=40), max_size=30))
def test_head_tail_keeps_the_first_and_last_bytes(cap: int, chunks: list[bytes]) -> None:
    kept = HeadTail(cap)
    for chunk in chunks:
        kept.add(chunk)
        assert len(kept.head) + len(kept.tail) <= 2 * cap + max(map(len, chunks), default=0)
    data = b"".join(chunks)
    value, dropped = kept.value()
    head = cap // 2
    tail = cap - head
    if len(data) <= cap:
        assert (value, dropped) == (data, 0)
    else:
        assert value == data[:head] + data[len(data) - tail :]
        assert dropped == len(data) - cap
