"""execd.service_log: a service's log file, appended to and read back by offset."""

from __future__ import annotations

from pathlib import Path

import pytest

from execd.service_log import LogFile, tail_start, tail_text

pytestmark = pytest.mark.anyio


async def test_tail_start_reads_backwards_across_blocks(tmp_path: Path) -> None:
    log_file = LogFile(str(tmp_path / "big.log"))
    lines = [b"x" * (i % 97) + b"%d\n" % i for i in range(5000)]
    for line in lines:
        log_file.write(line)
    data = b"".join(lines)
    size = log_file.size()
    assert size == len(data)
    for count in (1, 2, 10, 1000, 4999):
        start = tail_start(log_file, size, count, 0)
        assert data[start:] == b"".join(lines[-count:])
    assert tail_start(log_file, size, 10_000, 0) == 0
    assert tail_start(log_file, size, 10_000, size - 100) == size - 100
    log_file.write(b"unterminated")
    size = log_file.size()
    assert log_file.pread(tail_start(log_file, size, 2, 0), 10**6) == lines[-1] + b"unterminated"
    log_file.close()


async def test_tail_text_is_bounded_and_starts_at_the_floor(tmp_path: Path) -> None:
    log_file = LogFile(str(tmp_path / "service.log"))
    log_file.write(b"from an earlier start\n")
    floor = log_file.size()
    log_file.write(b"".join(b"line %d\n" % i for i in range(100)))
    assert tail_text(log_file, floor) == "".join(f"line {i}\n" for i in range(80, 100))
    log_file.write(b"x" * 10_000)
    assert tail_text(log_file, floor) == "x" * 8192
    assert tail_text(log_file, log_file.size()) == ""
    log_file.close()
