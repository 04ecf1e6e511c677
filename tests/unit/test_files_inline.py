"""Small local file I/O on the event loop agrees with the worker-thread path, case by case.

Two ``files`` capabilities get the same calls on twin directories: one that
trusts its directory as local (small reads and writes then run inline, and
its pool never starts a thread) and one that trusts nothing (every unit in a
worker thread). Results, errors and the files left behind must match. Small
atomic writes commit inline only while the pool is idle and commits are
quick: the last tests hold each condition false in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from execd import fsops
from execd.config import Config
from execd.errors import ExecdError
from execd.files import FilesCapability, _read_unit
from execd.local_fs import (
    INLINE_MAX,
    INLINE_READ_MAX,
    SYNC_INLINE_MAX,
    LocalFiles,
    mount_types,
)
from execd.workers import WorkerPool
from protocol.rpc.files import ReadParams, WriteParams
from tests.support.local_ctx import LocalContext

Case = Callable[[FilesCapability, Path], Awaitable[Any]]


def _outcome(cap: FilesCapability, root: Path, case: Case) -> tuple[Any, dict[str, Any]]:
    async def main() -> Any:
        return await case(cap, root)

    try:
        result: Any = msgspec.to_builtins(asyncio.run(main()))
    except ExecdError as exc:
        result = (type(exc).__name__, exc.message.replace(str(root), "ROOT"), exc.data)
    if isinstance(result, tuple) and isinstance(result[2], dict) and "path" in result[2]:
        result[2]["path"] = result[2]["path"].replace(str(root), "ROOT")
    files = {
        entry.name: (entry.read_bytes(), stat.S_IMODE(entry.stat().st_mode))
        for entry in sorted(root.iterdir())
        if entry.is_file() and not entry.is_fifo()
    }
    return result, files


def _setup(root: Path) -> None:
    root.mkdir()
    (root / "small.txt").write_bytes(b"hello world\n" * 100)
    (root / "long.txt").write_bytes(b"x" * 10_000)
    (root / "empty").write_bytes(b"")
    (root / "edge.bin").write_bytes(bytes(range(256)) * (INLINE_READ_MAX // 256))
    (root / "dir").mkdir()
    os.mkfifo(root / "fifo")


def _read(**params: Any) -> Case:
    async def case(cap: FilesCapability, root: Path) -> Any:
        rest = {key: value for key, value in params.items() if key != "path"}
        read = ReadParams(path=str(root / params["path"]), checksum=True, **rest)
        return await cap.files_read(read, LocalContext())

    return case


def _write(**params: Any) -> Case:
    async def case(cap: FilesCapability, root: Path) -> Any:
        rest = {key: value for key, value in params.items() if key != "path"}
        write = WriteParams(path=str(root / params["path"]), **{"atomic": False, **rest})
        return await cap.files_write(write, LocalContext())

    return case


INLINE_CASES: dict[str, Case] = {
    "read whole": _read(path="small.txt"),
    "read range": _read(path="small.txt", offset=5, length=20),
    "read a range ending past the end": _read(path="small.txt", offset=1000, length=500),
    "read past the end": _read(path="small.txt", offset=5000),
    "read empty": _read(path="empty"),
    "read at the inline bound": _read(path="edge.bin"),
    "read over max_bytes": _read(path="small.txt", max_bytes=10),
    "read missing": _read(path="missing"),
    "read a directory": _read(path="dir"),
    "read a fifo": _read(path="fifo"),
    "write new": _write(path="new.txt", data=b"new content"),
    "write shorter over longer": _write(path="long.txt", data=b"short"),
    "write empty over longer": _write(path="long.txt", data=b""),
    "write with mode": _write(path="small.txt", data=b"moded", mode=0o640),
    "append": _write(path="small.txt", data=b"tail", append=True),
    "write a fifo": _write(path="fifo", data=b"x"),
    "write a directory": _write(path="dir", data=b"x"),
    "write with expected_size": _write(path="new.txt", data=b"abc", expected_size=3),
    "atomic write": _write(path="small.txt", data=b"atomic", atomic=True),
    "atomic write new": _write(path="new.txt", data=b"atomic", atomic=True),
    "atomic write with mode": _write(path="small.txt", data=b"m", atomic=True, mode=0o604),
    "atomic write at the sync bound": _write(
        path="small.txt", data=b"s" * SYNC_INLINE_MAX, atomic=True
    ),
    "atomic write a directory": _write(path="dir", data=b"x", atomic=True),
    "atomic write a fifo": _write(path="fifo", data=b"x", atomic=True),
}
THREAD_CASES: dict[str, Case] = {
    "write into a missing directory": _write(path="nowhere/new.txt", data=b"x"),
    "write creating parents": _write(path="a/b/new.txt", data=b"x", create_parents=True),
    "write over the inline bound": _write(path="big.bin", data=b"z" * (INLINE_MAX + 1)),
    "atomic write over the sync bound": _write(
        path="small.txt", data=b"s" * (SYNC_INLINE_MAX + 1), atomic=True
    ),
    "durable atomic write": _write(path="small.txt", data=b"d", atomic=True, durable=True),
    "durable plain write": _write(path="small.txt", data=b"d", durable=True),
}


def _pair(tmp_path: Path) -> tuple[FilesCapability, WorkerPool, FilesCapability, Path, Path]:
    fast_root, slow_root = tmp_path / "fast", tmp_path / "slow"
    _setup(fast_root)
    _setup(slow_root)
    local = LocalFiles()
    if not local.note(str(fast_root / "small.txt"), os.stat(fast_root).st_dev):
        pytest.skip(f"{tmp_path} is not on a local filesystem")
    pool = WorkerPool()
    fast = FilesCapability(Config(), pool, local)
    slow = FilesCapability(Config(), WorkerPool(), LocalFiles(mountinfo="/nonexistent"))
    return fast, pool, slow, fast_root, slow_root


@pytest.mark.parametrize("name", list(INLINE_CASES))
def test_inline_agrees_with_the_thread_path(tmp_path: Path, name: str) -> None:
    fast, pool, slow, fast_root, slow_root = _pair(tmp_path)
    case = INLINE_CASES[name]
    assert _outcome(fast, fast_root, case) == _outcome(slow, slow_root, case)
    assert pool.threads == 0, "the call did not run inline"


@pytest.mark.parametrize("name", list(THREAD_CASES))
def test_what_may_wait_keeps_the_thread_and_agrees(tmp_path: Path, name: str) -> None:
    fast, _, slow, fast_root, slow_root = _pair(tmp_path)
    case = THREAD_CASES[name]
    assert _outcome(fast, fast_root, case) == _outcome(slow, slow_root, case)


def _threads_for_atomic_write(fast: FilesCapability, pool: WorkerPool, root: Path) -> int:
    _outcome(fast, root, _write(path="small.txt", data=b"atomic", atomic=True))
    return pool.threads


def test_slow_commits_send_commits_to_the_thread_for_a_while(tmp_path: Path) -> None:
    local = LocalFiles(slow_sync=0.002, stall_sync=0.02, sync_backoff=0.2)
    assert local.syncs_inline()
    for _ in range(50):
        local.synced(0.0004)
    assert local.syncs_inline(), "quick commits change nothing"
    local.synced(0.008)
    assert local.syncs_inline(), "one slow commit among quick ones keeps the loop"
    slow = 1
    while local.syncs_inline():
        local.synced(0.008)
        slow += 1
        assert slow < 10, "slow commits never sent the commits to the thread"
    # The average of commit times: 0.4 ms -> 1.35 ms -> 2.2 ms, over the 2 ms mark.
    assert slow == 2
    time.sleep(0.25)
    assert local.syncs_inline(), "commits come back to the loop after the backoff"
    local.synced(0.003)
    assert not local.syncs_inline(), "one slow commit right after the backoff sends them back"
    time.sleep(0.25)
    local.synced(0.0004)
    assert local.syncs_inline(), "one quick commit after the backoff keeps them on the loop"

    stalled = LocalFiles(slow_sync=0.002, stall_sync=0.02, sync_backoff=0.2)
    for _ in range(50):
        stalled.synced(0.0004)
    stalled.synced(0.021)
    assert not stalled.syncs_inline(), "a stalling commit sends commits to the thread at once"

    fast, pool, _, fast_root, _ = _pair(tmp_path)
    fast._local.synced(60.0)
    assert _threads_for_atomic_write(fast, pool, fast_root) == 1
    assert (fast_root / "small.txt").read_bytes() == b"atomic"


def test_a_busy_pool_keeps_commits_in_the_thread(tmp_path: Path) -> None:
    fast, pool, _, fast_root, _ = _pair(tmp_path)
    release = threading.Event()

    async def main() -> tuple[bool, int]:
        unit = await pool.submit("another connection", release.wait)
        try:
            busy = not pool.idle
            write = WriteParams(path=str(fast_root / "small.txt"), data=b"atomic")
            await fast.files_write(write, LocalContext())
            return busy, pool.threads
        finally:
            release.set()
            await unit

    busy, threads = asyncio.run(main())
    assert busy and threads == 2, "the commit did not go to a thread of its own"
    assert pool.idle
    assert (fast_root / "small.txt").read_bytes() == b"atomic"


def _deleted_files_held() -> list[str]:
    """What this process holds open that no name points at any more."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.endswith(" (deleted)"):
                held.append(target)
    return held


@pytest.mark.parametrize("how", ["inline", "thread", "stream"])
def test_a_replaced_file_is_freed_right_after_the_answer(tmp_path: Path, how: str) -> None:
    fast, pool, _, root, _ = _pair(tmp_path)
    target = root / "small.txt"
    if how == "thread":
        fast._local.synced(60.0)  # commits off the loop for a while
    ctx = LocalContext()
    if how == "stream":
        ctx.feed("data", b"streamed")
        ctx.feed("data", b"", end=True)
        params = WriteParams(path=str(target), stream=True)
    else:
        params = WriteParams(path=str(target), data=b"streamed")

    async def main() -> tuple[list[str], list[str]]:
        before = _deleted_files_held()
        await fast.files_write(params, ctx)
        answered = [name for name in _deleted_files_held() if name not in before]
        await asyncio.sleep(0)  # the event loop's next round
        return answered, [name for name in _deleted_files_held() if name not in before]

    answered, after = asyncio.run(main())
    assert answered == [f"{target} (deleted)"], "the rename freed the old file before the answer"
    assert after == [], "the replaced file was not freed after the answer"
    assert target.read_bytes() == b"streamed"
    assert pool.threads == (0 if how == "inline" else 1)


@pytest.mark.parametrize(
    ("case", "kept"),
    [
        ("small", True),
        ("at the bound", True),
        ("over the bound", False),
        ("through a symlink", False),
        ("new", False),
        ("not asked", False),
    ],
)
def test_a_sink_keeps_only_a_small_regular_file_it_replaces(
    tmp_path: Path, case: str, kept: bool
) -> None:
    target = tmp_path / "target"
    size = {"at the bound": fsops.KEEP_REPLACED_MAX, "over the bound": fsops.KEEP_REPLACED_MAX + 1}
    if case != "new":
        target.write_bytes(b"o" * size.get(case, 10))
    path = target
    if case == "through a symlink":
        path = tmp_path / "link"
        path.symlink_to(target)
    old = target.stat().st_ino if case != "new" else None
    sink = fsops.FileSink(
        str(path),
        atomic=True,
        append=False,
        mode=None,
        create_parents=False,
        keep_replaced=case != "not asked",
    )
    fds = len(os.listdir("/proc/self/fd"))
    sink.open()
    sink.write(b"new")
    assert sink.take_replaced() is None, "handed over before the commit"
    sink.commit()
    replaced = sink.take_replaced()
    assert (replaced is not None) == kept
    if replaced is not None:
        info = os.fstat(replaced)
        assert (info.st_ino, info.st_nlink) == (old, 0)
        os.close(replaced)
    sink.abort()  # after a commit: nothing left to release
    assert len(os.listdir("/proc/self/fd")) == fds
    assert target.read_bytes() == b"new"


def test_an_aborted_sink_closes_the_file_it_held(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"old")
    fds = len(os.listdir("/proc/self/fd"))
    sink = fsops.FileSink(
        str(target), atomic=True, append=False, mode=None, create_parents=False, keep_replaced=True
    )
    sink.open()
    sink.write(b"new")
    assert len(os.listdir("/proc/self/fd")) == fds + 2  # the temporary and the old file
    sink.abort()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert target.read_bytes() == b"old"
    assert sink.take_replaced() is None


def test_a_directory_is_trusted_only_once_seen_local(tmp_path: Path) -> None:
    local = LocalFiles()
    path = str(tmp_path / "file")
    assert not local.trusted(path)
    assert local.note(path, os.stat(tmp_path).st_dev) == local.trusted(path)
    proc = os.stat("/proc/self").st_dev
    assert not local.note(path, proc) and not local.trusted(path)
    assert not local.note(path, None)
    # What was trusted a moment ago is still checked against the device found.
    assert local.note(path, os.stat(tmp_path).st_dev) and local.trusted(path)
    assert not local.note(path, proc, trusted=True) and not local.trusted(path)
    assert not local.note(path, None, trusted=True)


def _counted_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    read_block = fsops.read_block

    def counting(fd: int, size: int, offset: int, hasher: Any) -> bytes:
        sizes.append(size)
        return read_block(fd, size, offset, hasher)

    monkeypatch.setattr(fsops, "read_block", counting)
    return sizes


@pytest.mark.parametrize(
    ("on_disk", "size", "expected", "reads"),
    [
        (4096, 4096, (4096, True), 1),  # ends where fstat said: no empty read after it
        (4096, -1, (4096, True), 2),  # size unknown: the empty read proves the end
        (8192, 4096, (4097, False), 1),  # grew since fstat: read on
        (100, 4096, (100, True), 2),  # shrank since fstat: the empty read proves the end
    ],
)
def test_a_read_unit_ends_at_the_size_fstat_gave_without_an_empty_read(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    on_disk: int,
    size: int,
    expected: tuple[int, bool],
    reads: int,
) -> None:
    path = tmp_path / "file"
    path.write_bytes(os.urandom(on_disk))
    sizes = _counted_reads(monkeypatch)
    fd = os.open(path, os.O_RDONLY)
    try:
        data, at_end = _read_unit(fd, 4097, 0, None, size)
    finally:
        os.close(fd)
    assert (len(data), at_end) == expected
    assert data == path.read_bytes()[: len(data)]
    assert len(sizes) == reads


def test_mount_types_parses_mountinfo() -> None:
    text = (
        "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
        "40 35 0:52 / /srv rw shared:7 - nfs4 host:/export rw\n"
        "garbage\n"
    )
    assert mount_types(text) == {os.makedev(98, 0): "ext3", os.makedev(0, 52): "nfs4"}
