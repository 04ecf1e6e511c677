"""execd.inotify: the pure record parser, the ctypes binding and the shared hub."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execd.inotify import (
    HEADER,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_IGNORED,
    IN_ISDIR,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_Q_OVERFLOW,
    Inotify,
    InotifyHub,
    RawEvent,
    describe,
    encode_event,
    parse_events,
)

pytestmark = pytest.mark.anyio


def kernel_watches(fd: int) -> int:
    """How many watches the kernel lists for inotify descriptor ``fd``."""
    with open(f"/proc/self/fdinfo/{fd}") as info:
        return sum(1 for line in info if line.startswith("inotify wd:"))


# -- the parser ---------------------------------------------------------------------


def test_encode_matches_kernel_layout() -> None:
    data = encode_event(RawEvent(3, IN_CREATE, 0, "hello"))
    assert len(data) == HEADER.size + 16
    assert HEADER.unpack_from(data) == (3, IN_CREATE, 0, 16)
    assert data[HEADER.size :] == b"hello" + b"\0" * 11
    nameless = encode_event(RawEvent(-1, IN_Q_OVERFLOW, 0, ""))
    assert nameless == HEADER.pack(-1, IN_Q_OVERFLOW, 0, 0)


def test_parse_known_records() -> None:
    records = [
        RawEvent(1, IN_MOVED_FROM, 77, "a"),
        RawEvent(1, IN_MOVED_TO, 77, "b" * 15),
        RawEvent(2, IN_IGNORED, 0, ""),
        RawEvent(1, IN_CREATE | IN_ISDIR, 0, "x" * 16),
    ]
    data = b"".join(encode_event(r) for r in records)
    parsed, used = parse_events(data)
    assert parsed == records
    assert used == len(data)


def test_parse_stops_at_truncated_record() -> None:
    first = encode_event(RawEvent(1, IN_CREATE, 0, "keep"))
    second = encode_event(RawEvent(1, IN_CREATE, 0, "lost"))
    for cut in range(len(second)):
        parsed, used = parse_events(first + second[:cut])
        assert parsed == [RawEvent(1, IN_CREATE, 0, "keep")]
        assert used == len(first)
    huge_len = HEADER.pack(1, IN_CREATE, 0, 2**32 - 1) + b"abc"
    assert parse_events(huge_len) == ([], 0)


def test_parse_decodes_undecodable_names_losslessly() -> None:
    raw_name = b"caf\xe9-\xff"
    name = os.fsdecode(raw_name)
    parsed, _ = parse_events(encode_event(RawEvent(5, IN_CLOSE_WRITE, 0, name)))
    assert os.fsencode(parsed[0].name) == raw_name


def test_encode_rejects_nul_and_describe_names_bits() -> None:
    with pytest.raises(ValueError):
        encode_event(RawEvent(1, IN_CREATE, 0, "a\0b"))
    assert describe(IN_CREATE | IN_ISDIR) == "CREATE|ISDIR"
    assert describe(0) == "0"


names = st.binary(min_size=0, max_size=300).filter(lambda b: b"\0" not in b).map(os.fsdecode)
records = st.builds(
    RawEvent,
    wd=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    mask=st.integers(min_value=0, max_value=2**32 - 1),
    cookie=st.integers(min_value=0, max_value=2**32 - 1),
    name=names,
)
encoded = st.tuples(records, st.none() | st.integers(min_value=0, max_value=40))


@settings(max_examples=200, deadline=None)
@given(st.lists(encoded, max_size=20))
def test_any_concatenation_parses_back(items: list[tuple[RawEvent, int | None]]) -> None:
    data = b"".join(encode_event(record, padding=padding) for record, padding in items)
    parsed, used = parse_events(data)
    assert parsed == [record for record, _ in items]
    assert used == len(data)


@settings(max_examples=200, deadline=None)
@given(st.lists(encoded, min_size=1, max_size=8), st.data())
def test_truncation_yields_a_prefix(
    items: list[tuple[RawEvent, int | None]], data: st.DataObject
) -> None:
    chunks = [encode_event(record, padding=padding) for record, padding in items]
    whole = b"".join(chunks)
    cut = data.draw(st.integers(min_value=0, max_value=len(whole)))
    parsed, used = parse_events(memoryview(whole)[:cut])
    assert parsed == [record for record, _ in items[: len(parsed)]]
    assert used == sum(len(chunk) for chunk in chunks[: len(parsed)])
    assert used <= cut
    if len(parsed) < len(items):
        assert cut < used + len(chunks[len(parsed)])


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    parsed, used = parse_events(data)
    assert 0 <= used <= len(data)
    assert parse_events(data[:used]) == (parsed, used)


# -- the binding -----------------------------------------------------------------------


def test_binding_reads_real_events(tmp_path: Path) -> None:
    ino = Inotify()
    try:
        wd = ino.add_watch(str(tmp_path), IN_CREATE | IN_CLOSE_WRITE)
        assert ino.add_watch(str(tmp_path), IN_CREATE | IN_CLOSE_WRITE) == wd
        (tmp_path / "f").write_text("x")
        (tmp_path / "d").mkdir()
        parsed, _ = parse_events(ino.read_raw())
        assert [(e.wd, e.mask, e.name) for e in parsed] == [
            (wd, IN_CREATE, "f"),
            (wd, IN_CLOSE_WRITE, "f"),
            (wd, IN_CREATE | IN_ISDIR, "d"),
        ]
        assert ino.read_raw() == b""
        ino.rm_watch(wd)
        parsed, _ = parse_events(ino.read_raw())
        assert [(e.wd, e.mask) for e in parsed] == [(wd, IN_IGNORED)]
        with pytest.raises(OSError) as missing:
            ino.add_watch(str(tmp_path / "missing"), IN_CREATE)
        assert missing.value.errno == errno.ENOENT
        with pytest.raises(OSError) as nul:
            ino.add_watch("a\0b", IN_CREATE)
        assert nul.value.errno == errno.EINVAL
        with pytest.raises(OSError) as gone:
            ino.rm_watch(wd)
        assert gone.value.errno == errno.EINVAL
    finally:
        ino.close()
    ino.close()
    assert ino.closed
    with pytest.raises(ValueError):
        ino.fileno()


# -- the hub ---------------------------------------------------------------------------


class Recorder:
    """A WatchUser that records what the hub delivers."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []
        self.changed = asyncio.Event()

    def on_event(self, event: RawEvent) -> None:
        self.log.append(("event", (event.mask & ~IN_ISDIR, event.name)))
        self.changed.set()

    def on_move(self, source: RawEvent | None, target: RawEvent | None) -> None:
        self.log.append(
            ("move", (source.name if source else None, target.name if target else None))
        )
        self.changed.set()

    def on_overflow(self) -> None:
        self.log.append(("overflow", None))
        self.changed.set()

    def on_ignored(self, wd: int) -> None:
        self.log.append(("ignored", wd))
        self.changed.set()

    async def wait_for(self, entry: tuple[str, object], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while entry not in self.log:
                self.changed.clear()
                await self.changed.wait()


async def test_hub_refcounts_shared_watches(tmp_path: Path) -> None:
    hub = InotifyHub()
    one, two = Recorder(), Recorder()
    wd1, fresh1 = hub.acquire(one, str(tmp_path))
    wd2, fresh2 = hub.acquire(two, str(tmp_path))
    assert wd1 == wd2 and fresh1 and fresh2
    assert hub.acquire(one, str(tmp_path)) == (wd1, False)
    fd = hub.fileno()
    assert fd is not None and kernel_watches(fd) == 1
    hub.release(one, wd1)
    assert kernel_watches(fd) == 1
    (tmp_path / "f").write_text("x")
    await two.wait_for(("event", (IN_CLOSE_WRITE, "f")))
    assert one.log == []
    hub.release(two, wd1)
    assert hub.fileno() is None  # no watch left: the descriptor is closed
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor is closed


async def test_hub_pairs_renames_and_splits_sides(tmp_path: Path) -> None:
    left, right, outside = tmp_path / "left", tmp_path / "right", tmp_path / "outside"
    for d in (left, right, outside):
        d.mkdir()
    hub = InotifyHub(move_grace=0.01)
    both, only_left = Recorder(), Recorder()
    hub.acquire(both, str(left))
    hub.acquire(both, str(right))
    hub.acquire(only_left, str(left))
    (left / "a").write_text("")
    os.rename(left / "a", right / "b")
    await both.wait_for(("move", ("a", "b")))
    await only_left.wait_for(("move", ("a", None)))
    (outside / "c").write_text("")
    os.rename(outside / "c", right / "c")
    await both.wait_for(("move", (None, "c")))
    os.rename(right / "c", outside / "c")
    await both.wait_for(("move", ("c", None)))
    assert ("move", ("c", None)) not in only_left.log
    hub.close()


async def test_hub_reports_ignored_when_the_directory_goes(tmp_path: Path) -> None:
    hub = InotifyHub()
    user = Recorder()
    target = tmp_path / "d"
    target.mkdir()
    wd, _ = hub.acquire(user, str(target))
    target.rmdir()
    await user.wait_for(("ignored", wd))
    assert not hub.holds(user, wd)
    assert hub.fileno() is None  # the last watch went with the directory
