"""The shell tool's bounded copy of streamed output keeps what execd keeps in collected mode."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from harnessd.tool_text import HeadTail, format_run, memory_note
from protocol.rpc.shell import RunResult


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


def test_a_command_failing_under_an_rlimit_memory_limit_is_told_so() -> None:
    def result(**fields: Any) -> RunResult:
        return RunResult(pid=1, stderr=b"MemoryError\n", **fields)

    failed = format_run(result(exit_code=1, limits={"memory": "rlimit"}))
    assert failed.startswith("exit code 1; the command ran under a memory limit (an address")
    assert memory_note(result(exit_code=1, limits={"memory": "rlimit"}), 256 << 20) is not None
    assert "of 256 MiB" in str(
        memory_note(result(signal=11, limits={"memory": "rlimit"}), 256 << 20)
    )
    # Nothing to say: it succeeded, execd could tell the limit, or the limit is a cgroup's.
    assert memory_note(result(exit_code=0, limits={"memory": "rlimit"})) is None
    told = result(exit_code=137, limit_exceeded="memory", limits={"memory": "cgroup-v2"})
    assert memory_note(told) is None
    assert memory_note(result(exit_code=1, limits={"memory": "cgroup-v1"})) is None
    assert memory_note(result(exit_code=1)) is None
