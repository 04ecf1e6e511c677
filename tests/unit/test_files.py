"""The ``files.*`` handlers against real files, driven through LocalContext."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import shutil
import stat
import subprocess
import tempfile
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from execd.config import Config, Limits
from execd.context import ConnectionLost
from execd.errors import (
    AlreadyExists,
    CrossDevice,
    ExecdError,
    InvalidParams,
    InvalidPath,
    IsADirectory,
    NoSpace,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotSupported,
    PermissionDenied,
    ReadOnly,
    StreamError,
    TooLarge,
)
from execd.files import FilesCapability
from protocol.errors import ErrorCode
from protocol.rpc import files as files_rpc
from protocol.rpc.files import (
    ChmodParams,
    ListParams,
    ListResult,
    MkdirParams,
    MoveParams,
    ReadParams,
    RemoveParams,
    Sha256Params,
    StatParams,
    WriteParams,
)
from tests.support.local_ctx import LocalContext

MiB = 1024 * 1024
IS_ROOT = os.geteuid() == 0
ZEROS = bytes(MiB)

_T = TypeVar("_T")

CAP = FilesCapability(Config())


def run(coro: Awaitable[_T]) -> _T:
    async def main() -> _T:
        return await coro

    return asyncio.run(main())


def fails(cls: type[ExecdError], coro: Awaitable[Any]) -> ExecdError:
    """Run ``coro`` and return the typed error it must raise."""
    with pytest.raises(cls) as info:
        run(coro)
    assert type(info.value) is cls
    return info.value


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(directory: Path, keep: set[str]) -> set[str]:
    return set(os.listdir(directory)) - keep


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def tmpfs(size: str, *options: str) -> Iterator[Path]:
    """Mount a private tmpfs (root only); unmounted and removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="files-tmpfs-"))
    opts = ",".join((f"size={size}", *options))
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
        where.rmdir()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- contexts with special behaviour ----------------------------------------------------


class FailingStreamContext(LocalContext):
    """Delivers some client chunks, then the connection breaks."""

    def __init__(self, chunks: list[bytes]) -> None:
        super().__init__()
        self._chunks = chunks

    async def receive(self, stream: str) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk
        raise ConnectionLost("client went away mid-stream")


class CountingContext(LocalContext):
    """Keeps nothing it is sent: counts bytes, checks they are zeros, tracks chunk sizes."""

    def __init__(self, max_chunk: int) -> None:
        super().__init__(max_chunk=max_chunk)
        self.count = 0
        self.largest = 0
        self.all_zero = True

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        self.count += len(data)
        self.largest = max(self.largest, len(data))
        if data != (ZEROS if len(data) == len(ZEROS) else bytes(len(data))):
            self.all_zero = False
        if end:
            self.ended.add(stream)
        await asyncio.sleep(0)


class StalledContext(LocalContext):
    """A peer that never grants credit: every send waits forever."""

    def __init__(self) -> None:
        super().__init__()
        self.sending = asyncio.Event()

    async def send(self, stream: str, data: bytes, *, end: bool = False) -> None:
        self.sending.set()
        await asyncio.Event().wait()


# -- the method table and the wire shapes -----------------------------------------------


def test_methods_table_covers_every_files_method() -> None:
    assert {m.rpc for m in CAP.methods()} == set(files_rpc.RPCS)


def test_schema_bounds_reject_absurd_values() -> None:
    encode = msgspec.msgpack.encode
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(encode({"path": "x" * 4097}), type=ReadParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(encode({"path": "a", "offset": -1}), type=ReadParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(encode({"path": "a", "mode": 0o10000}), type=ChmodParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(encode({"path": "a", "limit": 10**9}), type=ListParams)
    # Unknown fields are tolerated (newer clients), defaults are omitted on the wire.
    decoded = msgspec.msgpack.decode(encode({"path": "a", "future": 1}), type=ReadParams)
    assert decoded == ReadParams(path="a")
    assert msgspec.msgpack.decode(encode(ReadParams(path="a"))) == {"path": "a"}


# -- files.read ----------------------------------------------------------------------


def test_read_small_file_inline(tmp_path: Path) -> None:
    target = tmp_path / "small.txt"
    target.write_bytes(b"hello world")
    ctx = LocalContext()
    result = run(CAP.files_read(ReadParams(checksum=True, path=str(target)), ctx))
    assert result.data == b"hello world"
    assert (result.size, result.bytes_sent, result.streamed, result.eof) == (11, 11, False, True)
    assert result.sha256 == sha(b"hello world")
    assert not ctx.sent and not ctx.ended


def test_read_range_and_past_end(tmp_path: Path) -> None:
    target = tmp_path / "range.bin"
    target.write_bytes(bytes(range(100)))
    ctx = LocalContext()
    middle = run(
        CAP.files_read(ReadParams(checksum=True, path=str(target), offset=10, length=5), ctx)
    )
    assert middle.data == bytes(range(10, 15))
    assert middle.sha256 == sha(bytes(range(10, 15)))
    assert not middle.eof
    tail = run(
        CAP.files_read(ReadParams(checksum=True, path=str(target), offset=95, length=50), ctx)
    )
    assert tail.data == bytes(range(95, 100)) and tail.eof
    beyond = run(CAP.files_read(ReadParams(checksum=True, path=str(target), offset=1000), ctx))
    assert beyond.data == b"" and beyond.bytes_sent == 0 and beyond.eof


def test_read_stream_requested_for_small_file(tmp_path: Path) -> None:
    target = tmp_path / "s.txt"
    target.write_bytes(b"abc")
    ctx = LocalContext()
    result = run(CAP.files_read(ReadParams(checksum=True, path=str(target), stream=True), ctx))
    assert result.streamed and result.data is None
    assert ctx.received("data") == b"abc"
    assert "data" in ctx.ended
    assert (result.bytes_sent, result.sha256) == (3, sha(b"abc"))


def test_read_streams_when_content_exceeds_one_frame(tmp_path: Path) -> None:
    content = random.Random(1).randbytes(200_000)
    target = tmp_path / "mid.bin"
    target.write_bytes(content)
    ctx = LocalContext(max_chunk=64 * 1024)
    result = run(CAP.files_read(ReadParams(checksum=True, path=str(target)), ctx))
    assert result.streamed and result.data is None
    assert ctx.received("data") == content
    assert all(len(chunk) <= 64 * 1024 for chunk in ctx.sent["data"])
    assert result.sha256 == sha(content)
    # The same file fits inline when frames are large enough.
    big_ctx = LocalContext(max_chunk=1024 * 1024)
    inline = run(CAP.files_read(ReadParams(checksum=True, path=str(target)), big_ctx))
    assert inline.data == content and not big_ctx.sent


def test_read_inline_max_streams_what_exceeds_it_and_inlines_the_rest(tmp_path: Path) -> None:
    content = random.Random(2).randbytes(100_000)
    target = tmp_path / "inline.bin"
    target.write_bytes(content)
    big_frames = 1024 * 1024
    # Over inline_max: streamed although one reply frame would hold it.
    ctx = LocalContext(max_chunk=big_frames)
    params = ReadParams(path=str(target), inline_max=len(content) - 1)
    result = run(CAP.files_read(params, ctx))
    assert result.streamed and result.data is None and ctx.received("data") == content
    # At most inline_max: inline, nothing on the stream.
    ctx = LocalContext(max_chunk=big_frames)
    params = ReadParams(path=str(target), inline_max=len(content))
    result = run(CAP.files_read(params, ctx))
    assert not result.streamed and result.data == content and not ctx.sent
    # The frame still bounds it: a larger inline_max does not make a reply too large.
    ctx = LocalContext(max_chunk=64 * 1024)
    params = ReadParams(path=str(target), inline_max=len(content))
    result = run(CAP.files_read(params, ctx))
    assert result.streamed and ctx.received("data") == content


def test_read_max_bytes(tmp_path: Path) -> None:
    target = tmp_path / "m.bin"
    target.write_bytes(b"x" * 1000)
    error = fails(
        TooLarge,
        CAP.files_read(ReadParams(checksum=True, path=str(target), max_bytes=999), LocalContext()),
    )
    assert error.data["size"] == 1000
    assert error.code == ErrorCode.TOO_LARGE
    # A range within the guard is fine.
    params = ReadParams(checksum=True, path=str(target), offset=500, length=100, max_bytes=100)
    assert run(CAP.files_read(params, LocalContext())).data == b"x" * 100


def test_read_64_mib_streamed_reassembles_exactly(tmp_path: Path) -> None:
    content = random.Random(64).randbytes(64 * MiB)
    target = tmp_path / "big.bin"
    target.write_bytes(content)
    ctx = LocalContext(max_chunk=256 * 1024)
    result = run(CAP.files_read(ReadParams(checksum=True, path=str(target), stream=True), ctx))
    received = ctx.received("data")
    assert len(received) == len(content) and received == content
    assert result.sha256 == sha(content) == sha(received)
    assert result.bytes_sent == result.size == 64 * MiB
    assert max(len(chunk) for chunk in ctx.sent["data"]) <= 256 * 1024
    assert "data" in ctx.ended


@pytest.mark.slow
def test_read_1_gib_with_bounded_memory(tmp_path: Path) -> None:
    target = tmp_path / "sparse.bin"
    with target.open("wb") as handle:
        handle.truncate(1024 * MiB)
    ctx = CountingContext(max_chunk=256 * 1024)
    tracemalloc.start()
    try:
        result = run(CAP.files_read(ReadParams(checksum=True, path=str(target)), ctx))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.streamed and ctx.count == result.bytes_sent == 1024 * MiB
    assert ctx.all_zero and ctx.largest <= 1024 * MiB
    # SHA-256 of 2**30 zero bytes.
    assert result.sha256 == "49bc20df15e412a64472421e13fe86ff1c5165e18b2afccf160d4dc19fe68a14"
    assert peak < 16 * MiB, f"peak traced memory {peak} bytes"


def test_read_cancelled_while_waiting_for_credit_releases_the_file(tmp_path: Path) -> None:
    target = tmp_path / "c.bin"
    target.write_bytes(b"z" * (3 * MiB))

    async def main() -> None:
        before = open_fds()
        ctx = StalledContext()
        task = asyncio.create_task(
            CAP.files_read(ReadParams(checksum=True, path=str(target), stream=True), ctx)
        )
        await asyncio.wait_for(ctx.sending.wait(), 30)
        assert open_fds() == before + 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert open_fds() == before

    asyncio.run(main())


def test_read_pseudo_files_whose_size_says_zero() -> None:
    small = run(CAP.files_read(ReadParams(checksum=True, path="/proc/self/status"), LocalContext()))
    assert small.size == 0 and not small.streamed and small.eof
    assert small.data is not None and small.data.startswith(b"Name:")
    # Larger than one tiny frame: the inline read turns into a stream mid-way.
    ctx = LocalContext(max_chunk=2048)
    big = run(CAP.files_read(ReadParams(checksum=True, path="/proc/self/smaps"), ctx))
    received = ctx.received("data")
    assert big.streamed and big.data is None and "data" in ctx.ended
    assert big.bytes_sent == len(received) > 2048
    assert big.sha256 == sha(received)


def test_read_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    os.mkfifo(tmp_path / "fifo")
    ctx = LocalContext()
    missing = fails(
        NotFound, CAP.files_read(ReadParams(checksum=True, path=str(tmp_path / "nope")), ctx)
    )
    assert missing.data["errno"] == "ENOENT"
    assert str(tmp_path / "nope") in missing.message
    fails(IsADirectory, CAP.files_read(ReadParams(checksum=True, path=str(tmp_path)), ctx))
    fails(
        NotADirectory,
        CAP.files_read(ReadParams(checksum=True, path=str(tmp_path / "file" / "x")), ctx),
    )
    fails(NotSupported, CAP.files_read(ReadParams(checksum=True, path=str(tmp_path / "fifo")), ctx))
    fails(InvalidPath, CAP.files_read(ReadParams(checksum=True, path=""), ctx))
    fails(
        InvalidPath, CAP.files_read(ReadParams(checksum=True, path=str(tmp_path / "a\x00b")), ctx)
    )
    fails(InvalidPath, CAP.files_read(ReadParams(checksum=True, path="a" * 5000), ctx))
    fails(
        InvalidPath,
        CAP.files_read(ReadParams(checksum=True, path=str(tmp_path / ("n" * 300))), ctx),
    )


def _as_unprivileged_user(calls: list[Callable[[], Awaitable[Any]]]) -> list[str]:
    """Run each call in a forked child that dropped to uid/gid 65534; name each outcome."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            outcomes = []
            for call in calls:
                try:
                    run(call())
                    outcomes.append("succeeded")
                except ExecdError as exc:
                    outcomes.append(f"{type(exc).__name__} {int(exc.code)}")
            os.write(write_end, "\n".join(outcomes).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return report.split("\n")


def test_permission_denied() -> None:
    # A fresh directory straight under the temp root, so that only its own
    # permission bits decide (pytest's tmp_path sits in a private directory).
    where = Path(tempfile.mkdtemp(prefix="files-perm-"))
    target = where / "private"
    target.write_bytes(b"secret")
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: CAP.files_read(ReadParams(checksum=True, path=str(target)), LocalContext()),
        lambda: CAP.files_write(
            WriteParams(checksum=True, path=str(target), data=b"no"), LocalContext()
        ),
        lambda: CAP.files_list(ListParams(path=str(where)), LocalContext()),
    ]
    try:
        # Others (and, below, the owner) may enter the directory but not list or write it.
        where.chmod(0o711)
        target.chmod(0o600)
        if IS_ROOT:
            # Root bypasses permission bits: make the calls from a child that is not root.
            code = int(ErrorCode.PERMISSION_DENIED)
            assert _as_unprivileged_user(calls) == [f"PermissionDenied {code}"] * 3
        else:
            target.chmod(0)
            where.chmod(0o100)
            for call in calls:
                fails(PermissionDenied, call())
            where.chmod(0o700)
            target.chmod(0o600)
        assert target.read_bytes() == b"secret"
        assert set(os.listdir(where)) == {"private"}
    finally:
        where.chmod(0o700)
        shutil.rmtree(where)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="setting the immutable attribute needs root")
def test_write_over_immutable_target_fails_cleanly(tmp_path: Path) -> None:
    target = tmp_path / "frozen"
    target.write_bytes(b"old")
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    made = subprocess.run(["chattr", "+i", str(target)], capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"this filesystem has no immutable attribute: {made.stderr!r}")
    try:
        # The rename over the target is refused after all data went to the temporary.
        params = WriteParams(checksum=True, path=str(target), data=b"n" * (3 * MiB))
        error = fails(PermissionDenied, CAP.files_write(params, LocalContext()))
        assert error.data["errno"] == "EPERM"
        assert target.read_bytes() == b"old"
        assert leftovers(tmp_path, {"frozen"}) == set()
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)


# -- files.write ---------------------------------------------------------------------


def test_write_new_file_inline(tmp_path: Path) -> None:
    target = tmp_path / "new.txt"
    result = run(
        CAP.files_write(
            WriteParams(checksum=True, path=str(target), data=b"content"), LocalContext()
        )
    )
    assert target.read_bytes() == b"content"
    assert (result.size, result.sha256) == (7, sha(b"content"))
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~current_umask()
    assert leftovers(tmp_path, {"new.txt"}) == set()


def test_write_atomic_preserves_mode_unless_given(tmp_path: Path) -> None:
    target = tmp_path / "keep.sh"
    target.write_bytes(b"old")
    target.chmod(0o751)
    run(CAP.files_write(WriteParams(checksum=True, path=str(target), data=b"new"), LocalContext()))
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o751
    run(
        CAP.files_write(
            WriteParams(checksum=True, path=str(target), data=b"newer", mode=0o600), LocalContext()
        )
    )
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    fresh = tmp_path / "fresh"
    run(
        CAP.files_write(
            WriteParams(checksum=True, path=str(fresh), data=b"", mode=0o640), LocalContext()
        )
    )
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o640 and fresh.read_bytes() == b""
    assert leftovers(tmp_path, {"keep.sh", "fresh"}) == set()


def test_write_atomic_replaces_inode_plain_write_keeps_it(tmp_path: Path) -> None:
    target = tmp_path / "inode"
    target.write_bytes(b"0123456789")
    before = target.stat().st_ino
    run(CAP.files_write(WriteParams(checksum=True, path=str(target), data=b"ab"), LocalContext()))
    assert target.stat().st_ino != before and target.read_bytes() == b"ab"
    middle = target.stat().st_ino
    params = WriteParams(checksum=True, path=str(target), data=b"x", atomic=False, mode=0o604)
    run(CAP.files_write(params, LocalContext()))
    assert target.stat().st_ino == middle and target.read_bytes() == b"x"
    assert stat.S_IMODE(target.stat().st_mode) == 0o604


def test_write_append(tmp_path: Path) -> None:
    target = tmp_path / "log"
    target.write_bytes(b"one\n")
    params = WriteParams(checksum=True, path=str(target), data=b"two\n", append=True, atomic=False)
    result = run(CAP.files_write(params, LocalContext()))
    assert target.read_bytes() == b"one\ntwo\n"
    assert (result.size, result.sha256) == (4, sha(b"two\n"))
    error = fails(
        InvalidParams,
        CAP.files_write(
            WriteParams(checksum=True, path=str(target), data=b"x", append=True), LocalContext()
        ),
    )
    assert "atomic" in error.message
    assert target.read_bytes() == b"one\ntwo\n"


def test_write_create_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c.txt"
    fails(
        NotFound,
        CAP.files_write(WriteParams(checksum=True, path=str(target), data=b"x"), LocalContext()),
    )
    assert not (tmp_path / "a").exists()
    params = WriteParams(checksum=True, path=str(target), data=b"x", create_parents=True)
    run(CAP.files_write(params, LocalContext()))
    assert target.read_bytes() == b"x"


def test_write_through_symlink_updates_the_link_target(tmp_path: Path) -> None:
    real = tmp_path / "real.txt"
    real.write_bytes(b"old")
    real.chmod(0o640)
    link = tmp_path / "link.txt"
    link.symlink_to("real.txt")
    run(CAP.files_write(WriteParams(checksum=True, path=str(link), data=b"new"), LocalContext()))
    assert link.is_symlink() and real.read_bytes() == b"new"
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert leftovers(tmp_path, {"real.txt", "link.txt"}) == set()


def test_write_through_a_dangling_symlink_creates_the_file_it_names(tmp_path: Path) -> None:
    link = tmp_path / "link.txt"
    link.symlink_to("missing.txt")
    run(CAP.files_write(WriteParams(checksum=True, path=str(link), data=b"new"), LocalContext()))
    assert link.is_symlink() and (tmp_path / "missing.txt").read_bytes() == b"new"
    assert leftovers(tmp_path, {"missing.txt", "link.txt"}) == set()


def test_atomic_write_goes_around_a_taken_temporary_name(tmp_path: Path) -> None:
    from execd import fsops

    target = tmp_path / "t.txt"
    target.write_bytes(b"old")
    # The first-choice name is predictable: whatever sits there is left alone.
    squatted = tmp_path / f".t.txt.{fsops._TEMP_TAG}.tmp"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"keep")
    squatted.symlink_to(elsewhere)
    for data in (b"first", b"second"):
        run(CAP.files_write(WriteParams(path=str(target), data=data), LocalContext()))
        assert target.read_bytes() == data
    assert squatted.is_symlink() and elsewhere.read_bytes() == b"keep"
    assert leftovers(tmp_path, {"t.txt", "elsewhere", squatted.name}) == set()

    async def many() -> None:
        # Concurrent writes to one target from one process: one name each.
        ctx = LocalContext()
        payloads = [bytes([n]) * 100_000 for n in range(8)]
        await asyncio.gather(
            *(CAP.files_write(WriteParams(path=str(target), data=p), ctx) for p in payloads)
        )
        assert target.read_bytes() in payloads

    squatted.unlink()
    run(many())
    assert leftovers(tmp_path, {"t.txt", "elsewhere"}) == set()


@pytest.mark.skipif(not IS_ROOT, reason="giving a file to another user needs root")
def test_atomic_write_keeps_the_old_owner_and_mode(tmp_path: Path) -> None:
    target = tmp_path / "theirs.txt"
    target.write_bytes(b"old")
    os.chown(target, 1001, 1001)
    target.chmod(0o604)
    run(CAP.files_write(WriteParams(checksum=True, path=str(target), data=b"new"), LocalContext()))
    info = target.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (1001, 1001, 0o604)
    assert target.read_bytes() == b"new"


def test_write_refuses_special_files_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    ctx = LocalContext()
    for atomic in (False, True):
        # A FIFO without a reader: the open must not wait for one.
        error = fails(
            NotSupported,
            CAP.files_write(WriteParams(path=str(fifo), data=b"x", atomic=atomic), ctx),
        )
        assert error.data == {"path": str(fifo)}
        streamed = WriteParams(path=str(fifo), stream=True, atomic=atomic)
        fails(NotSupported, CAP.files_write(streamed, LocalContext()))
        assert fifo.is_fifo(), "the FIFO was replaced"
    # A device: neither written through nor replaced by a rename.
    before = os.stat("/dev/null")
    for atomic in (False, True):
        fails(
            NotSupported,
            CAP.files_write(WriteParams(path="/dev/null", data=b"x", atomic=atomic), ctx),
        )
    after = os.stat("/dev/null")
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert leftovers(tmp_path, {"fifo"}) == set()


def test_write_errors(tmp_path: Path) -> None:
    ctx = LocalContext()
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_bytes(b"f")
    fails(
        IsADirectory,
        CAP.files_write(WriteParams(checksum=True, path=str(tmp_path / "dir"), data=b"x"), ctx),
    )
    plain = WriteParams(checksum=True, path=str(tmp_path / "dir"), data=b"x", atomic=False)
    fails(IsADirectory, CAP.files_write(plain, ctx))
    nested = str(tmp_path / "file" / "x")
    fails(NotADirectory, CAP.files_write(WriteParams(checksum=True, path=nested, data=b"x"), ctx))
    both = WriteParams(checksum=True, path=str(tmp_path / "w"), data=b"x", stream=True)
    fails(InvalidParams, CAP.files_write(both, ctx))
    fails(InvalidParams, CAP.files_write(WriteParams(checksum=True, path=str(tmp_path / "w")), ctx))
    wrong_size = WriteParams(checksum=True, path=str(tmp_path / "w"), data=b"abc", expected_size=4)
    fails(InvalidParams, CAP.files_write(wrong_size, ctx))
    fails(InvalidPath, CAP.files_write(WriteParams(checksum=True, path="", data=b"x"), ctx))
    assert leftovers(tmp_path, {"dir", "file"}) == set()
    assert os.listdir(tmp_path / "dir") == []


def _feed(ctx: LocalContext, content: bytes, chunk: int, *, end: bool = True) -> None:
    for start in range(0, len(content), chunk):
        ctx.feed("data", content[start : start + chunk])
    if end:
        ctx.feed("data", b"", end=True)


def test_write_streamed_64_mib(tmp_path: Path) -> None:
    content = random.Random(7).randbytes(64 * MiB)
    target = tmp_path / "big.bin"

    async def main() -> None:
        ctx = LocalContext()
        _feed(ctx, content, 64 * 1024)
        params = WriteParams(
            checksum=True, path=str(target), stream=True, expected_size=len(content)
        )
        result = await CAP.files_write(params, ctx)
        assert (result.size, result.sha256) == (len(content), sha(content))

    asyncio.run(main())
    assert target.stat().st_size == len(content)
    assert sha(target.read_bytes()) == sha(content)
    assert leftovers(tmp_path, {"big.bin"}) == set()


def test_write_streamed_with_wrong_expected_size_keeps_target(tmp_path: Path) -> None:
    target = tmp_path / "t"
    target.write_bytes(b"original")

    async def attempt(content: bytes, expected: int) -> ExecdError:
        ctx = LocalContext()
        _feed(ctx, content, 1000)
        params = WriteParams(checksum=True, path=str(target), stream=True, expected_size=expected)
        with pytest.raises(StreamError) as info:
            await CAP.files_write(params, ctx)
        return info.value

    short = asyncio.run(attempt(b"a" * 5000, 6000))
    assert short.data == {"expected_size": 6000, "received": 5000}
    long = asyncio.run(attempt(b"a" * 5000, 4500))
    assert long.data["received"] > 4500
    assert target.read_bytes() == b"original"
    assert leftovers(tmp_path, {"t"}) == set()


def test_write_failing_client_stream_leaves_target_intact(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"old content")
    target.chmod(0o640)
    ctx = FailingStreamContext([b"n" * (256 * 1024)] * 12)
    with pytest.raises(ConnectionLost):
        run(CAP.files_write(WriteParams(checksum=True, path=str(target), stream=True), ctx))
    assert target.read_bytes() == b"old content"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert leftovers(tmp_path, {"precious"}) == set()


def test_write_cancelled_midway_leaves_target_intact(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"old content")

    async def main() -> None:
        ctx = LocalContext()
        _feed(ctx, b"n" * (3 * MiB), 64 * 1024, end=False)
        task = asyncio.create_task(
            CAP.files_write(WriteParams(checksum=True, path=str(target), stream=True), ctx)
        )
        # Wait until the temporary file holds data, i.e. the write is truly under way.
        for _ in range(3000):
            temps = leftovers(tmp_path, {"precious"})
            if temps and (tmp_path / temps.pop()).stat().st_size > 0:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the streamed write never started writing")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert target.read_bytes() == b"old content"
    assert leftovers(tmp_path, {"precious"}) == set()


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="mounting a tiny tmpfs to fill the disk needs root")
def test_write_no_space_leaves_no_torn_file() -> None:
    with tmpfs("1m") as where:
        target = where / "target"
        target.write_bytes(b"old")
        ctx = LocalContext()
        error = fails(
            NoSpace,
            CAP.files_write(
                WriteParams(checksum=True, path=str(target), data=b"x" * (2 * MiB)), ctx
            ),
        )
        assert error.data["errno"] == "ENOSPC"
        assert str(target) in error.message
        assert target.read_bytes() == b"old"
        assert set(os.listdir(where)) == {"target"}

        async def streamed(expected: int | None) -> None:
            stream_ctx = LocalContext()
            _feed(stream_ctx, b"y" * (2 * MiB), 64 * 1024)
            params = WriteParams(
                checksum=True, path=str(target), stream=True, expected_size=expected
            )
            with pytest.raises(NoSpace):
                await CAP.files_write(params, stream_ctx)

        asyncio.run(streamed(None))
        asyncio.run(streamed(2 * MiB))  # fails up front, while reserving space
        assert target.read_bytes() == b"old"
        assert set(os.listdir(where)) == {"target"}


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="mounting a read-only tmpfs needs root")
def test_write_read_only_filesystem() -> None:
    with tmpfs("1m", "ro") as where:
        target = str(where / "x")
        fails(
            ReadOnly,
            CAP.files_write(WriteParams(checksum=True, path=target, data=b"x"), LocalContext()),
        )
        fails(ReadOnly, CAP.files_mkdir(MkdirParams(path=target), LocalContext()))


def test_relative_paths_resolve_against_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run(CAP.files_write(WriteParams(checksum=True, path="rel.txt", data=b"here"), LocalContext()))
    assert (tmp_path / "rel.txt").read_bytes() == b"here"
    assert (
        run(CAP.files_read(ReadParams(checksum=True, path="rel.txt"), LocalContext())).data
        == b"here"
    )
    run(CAP.files_mkdir(MkdirParams(path="sub/deeper"), LocalContext()))
    assert (tmp_path / "sub" / "deeper").is_dir()


# -- files.stat ----------------------------------------------------------------------


def test_stat(tmp_path: Path) -> None:
    ctx = LocalContext()
    target = tmp_path / "f"
    target.write_bytes(b"12345")
    target.chmod(0o640)
    os.utime(target, ns=(1_000_000_000, 1_500_000_000_123))
    info = run(CAP.files_stat(StatParams(path=str(target)), ctx))
    assert (info.type, info.size, info.mode, info.target) == ("file", 5, 0o640, None)
    assert info.mtime_ns == 1_500_000_000_123
    assert info.mtime == pytest.approx(1500.000000123)
    assert (info.uid, info.gid) == (os.getuid(), os.getgid())
    assert run(CAP.files_stat(StatParams(path=str(tmp_path)), ctx)).type == "dir"
    link = tmp_path / "link"
    link.symlink_to("f")
    followed = run(CAP.files_stat(StatParams(path=str(link)), ctx))
    assert (followed.type, followed.size, followed.target) == ("file", 5, "f")
    itself = run(CAP.files_stat(StatParams(path=str(link), follow_symlinks=False), ctx))
    assert (itself.type, itself.target) == ("symlink", "f")
    dangling = tmp_path / "dangling"
    dangling.symlink_to("missing")
    fails(NotFound, CAP.files_stat(StatParams(path=str(dangling)), ctx))
    unfollowed = run(CAP.files_stat(StatParams(path=str(dangling), follow_symlinks=False), ctx))
    assert unfollowed.target == "missing"
    os.mkfifo(tmp_path / "fifo")
    assert run(CAP.files_stat(StatParams(path=str(tmp_path / "fifo")), ctx)).type == "other"
    fails(NotFound, CAP.files_stat(StatParams(path=str(tmp_path / "nope")), ctx))
    fails(NotADirectory, CAP.files_stat(StatParams(path=str(target / "x")), ctx))
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    fails(InvalidPath, CAP.files_stat(StatParams(path=str(loop)), ctx))


# -- files.list ----------------------------------------------------------------------


def _tree(root: Path) -> None:
    (root / "b").mkdir()
    (root / "b" / "inner.txt").write_bytes(b"12")
    (root / "b" / "deep").mkdir()
    (root / "b" / "deep" / "leaf").write_bytes(b"")
    (root / "a.txt").write_bytes(b"a")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret").write_bytes(b"s")
    (root / "c-loop").symlink_to(".")


def _paths(result: ListResult) -> list[str]:
    return [entry.path for entry in result.entries]


def test_list_flat_and_recursive(tmp_path: Path) -> None:
    _tree(tmp_path)
    ctx = LocalContext()
    flat = run(CAP.files_list(ListParams(path=str(tmp_path)), ctx))
    assert _paths(flat) == [".hidden", "a.txt", "b", "c-loop"]
    assert not flat.truncated
    kinds = {entry.path: (entry.type, entry.size) for entry in flat.entries}
    assert kinds["a.txt"] == ("file", 1)
    assert kinds["b"][0] == "dir" and kinds["c-loop"][0] == "symlink"
    deep = run(CAP.files_list(ListParams(path=str(tmp_path), recursive=True), ctx))
    assert _paths(deep) == [
        ".hidden",
        ".hidden/secret",
        "a.txt",
        "b",
        "b/deep",
        "b/deep/leaf",
        "b/inner.txt",
        "c-loop",
    ]
    visible = run(
        CAP.files_list(ListParams(path=str(tmp_path), recursive=True, include_hidden=False), ctx)
    )
    assert _paths(visible) == ["a.txt", "b", "b/deep", "b/deep/leaf", "b/inner.txt", "c-loop"]


def test_list_limit_and_truncation(tmp_path: Path) -> None:
    _tree(tmp_path)
    ctx = LocalContext()
    cut = run(CAP.files_list(ListParams(path=str(tmp_path), recursive=True, limit=3), ctx))
    assert _paths(cut) == [".hidden", ".hidden/secret", "a.txt"] and cut.truncated
    exact = run(CAP.files_list(ListParams(path=str(tmp_path), recursive=True, limit=8), ctx))
    assert len(exact.entries) == 8 and not exact.truncated
    capped = FilesCapability(Config(limits=Limits(max_list_entries=2)))
    clamped = run(capped.files_list(ListParams(path=str(tmp_path), limit=1000), ctx))
    assert len(clamped.entries) == 2 and clamped.truncated
    default = run(capped.files_list(ListParams(path=str(tmp_path)), ctx))
    assert len(default.entries) == 2 and default.truncated
    nothing = run(CAP.files_list(ListParams(path=str(tmp_path), limit=0), ctx))
    assert nothing.entries == [] and nothing.truncated


def test_list_stays_within_one_reply_frame(tmp_path: Path) -> None:
    for index in range(1500):
        (tmp_path / f"{index:04d}-{'x' * 40}").write_bytes(b"")
    small = run(CAP.files_list(ListParams(path=str(tmp_path)), LocalContext(max_chunk=64 * 1024)))
    assert small.truncated and 0 < len(small.entries) < 1500
    assert len(msgspec.msgpack.encode(small)) <= 64 * 1024
    large = run(CAP.files_list(ListParams(path=str(tmp_path)), LocalContext(max_chunk=16 * MiB)))
    assert not large.truncated and len(large.entries) == 1500


def test_list_skips_undecodable_names_and_reports_errors(tmp_path: Path) -> None:
    (tmp_path / "ok").write_bytes(b"")
    with open(os.path.join(os.fsencode(tmp_path), b"bad-\xff"), "wb"):
        pass
    result = run(CAP.files_list(ListParams(path=str(tmp_path)), LocalContext()))
    assert _paths(result) == ["ok"] and result.skipped == 1
    msgspec.msgpack.encode(result)
    ctx = LocalContext()
    fails(NotADirectory, CAP.files_list(ListParams(path=str(tmp_path / "ok")), ctx))
    fails(NotFound, CAP.files_list(ListParams(path=str(tmp_path / "missing")), ctx))


@pytest.mark.skipif(IS_ROOT, reason="root can read any directory")
def test_list_names_unreadable_subdirectories(tmp_path: Path) -> None:
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "inside").write_bytes(b"")
    (tmp_path / "locked").chmod(0)
    try:
        result = run(CAP.files_list(ListParams(path=str(tmp_path), recursive=True), LocalContext()))
    finally:
        (tmp_path / "locked").chmod(0o700)
    assert _paths(result) == ["locked"] and result.unreadable == ["locked"]


# -- files.mkdir ---------------------------------------------------------------------


def test_mkdir(tmp_path: Path) -> None:
    ctx = LocalContext()
    nested = tmp_path / "x" / "y" / "z"
    assert run(CAP.files_mkdir(MkdirParams(path=str(nested)), ctx)).created
    assert nested.is_dir()
    assert not run(CAP.files_mkdir(MkdirParams(path=str(nested)), ctx)).created
    fails(AlreadyExists, CAP.files_mkdir(MkdirParams(path=str(nested), exist_ok=False), ctx))
    orphan = tmp_path / "no" / "parent"
    fails(NotFound, CAP.files_mkdir(MkdirParams(path=str(orphan), parents=False), ctx))
    exact = tmp_path / "exact"
    assert run(
        CAP.files_mkdir(MkdirParams(path=str(exact), mode=0o2750, parents=False), ctx)
    ).created
    assert stat.S_IMODE(exact.stat().st_mode) == 0o2750
    (tmp_path / "file").write_bytes(b"")
    fails(AlreadyExists, CAP.files_mkdir(MkdirParams(path=str(tmp_path / "file")), ctx))
    fails(NotADirectory, CAP.files_mkdir(MkdirParams(path=str(tmp_path / "file" / "sub")), ctx))


# -- files.remove --------------------------------------------------------------------


def test_remove(tmp_path: Path) -> None:
    ctx = LocalContext()
    (tmp_path / "f").write_bytes(b"")
    assert run(CAP.files_remove(RemoveParams(path=str(tmp_path / "f")), ctx)).removed
    assert not (tmp_path / "f").exists()
    fails(NotFound, CAP.files_remove(RemoveParams(path=str(tmp_path / "f")), ctx))
    gone = run(CAP.files_remove(RemoveParams(path=str(tmp_path / "f"), missing_ok=True), ctx))
    assert not gone.removed
    (tmp_path / "empty").mkdir()
    assert run(CAP.files_remove(RemoveParams(path=str(tmp_path / "empty")), ctx)).removed
    full = tmp_path / "full"
    (full / "sub").mkdir(parents=True)
    (full / "sub" / "x").write_bytes(b"")
    error = fails(NotEmpty, CAP.files_remove(RemoveParams(path=str(full)), ctx))
    assert error.code == ErrorCode.NOT_EMPTY
    assert full.is_dir()
    link = tmp_path / "link"
    link.symlink_to(full)
    assert run(CAP.files_remove(RemoveParams(path=str(link)), ctx)).removed
    assert not link.is_symlink() and (full / "sub" / "x").exists()
    assert run(CAP.files_remove(RemoveParams(path=str(full), recursive=True), ctx)).removed
    assert not full.exists()
    for root in ("/", "//", "/tmp/.."):
        fails(InvalidPath, CAP.files_remove(RemoveParams(path=root, recursive=True), ctx))


# -- files.move ----------------------------------------------------------------------


def test_move_within_filesystem(tmp_path: Path) -> None:
    ctx = LocalContext()
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    src = tmp_path / "one" / "f"
    src.write_bytes(b"payload")
    dst = tmp_path / "two" / "g"
    result = run(CAP.files_move(MoveParams(src=str(src), dst=str(dst)), ctx))
    assert not result.copied and dst.read_bytes() == b"payload" and not src.exists()
    other = tmp_path / "one" / "h"
    other.write_bytes(b"other")
    keep = MoveParams(src=str(other), dst=str(dst), overwrite=False)
    fails(AlreadyExists, CAP.files_move(keep, ctx))
    assert dst.read_bytes() == b"payload" and other.exists()
    run(CAP.files_move(MoveParams(src=str(other), dst=str(dst)), ctx))
    assert dst.read_bytes() == b"other" and not other.exists()
    (tmp_path / "two" / "sub").mkdir()
    (tmp_path / "two" / "sub" / "x").write_bytes(b"")
    into_full = MoveParams(src=str(tmp_path / "one"), dst=str(tmp_path / "two"))
    fails(NotEmpty, CAP.files_move(into_full, ctx))
    file_over_dir = MoveParams(src=str(dst), dst=str(tmp_path / "two" / "sub"))
    fails(IsADirectory, CAP.files_move(file_over_dir, ctx))
    missing = MoveParams(src=str(tmp_path / "missing"), dst=str(tmp_path / "z"))
    fails(NotFound, CAP.files_move(missing, ctx))
    run(CAP.files_move(MoveParams(src=str(tmp_path / "one"), dst=str(tmp_path / "three")), ctx))
    assert (tmp_path / "three").is_dir() and not (tmp_path / "one").exists()


@contextlib.contextmanager
def other_filesystem(near: Path) -> Iterator[Path]:
    """A writable directory on a different filesystem than ``near``."""
    if IS_ROOT:
        with tmpfs("64m") as where:
            yield where
        return
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != near.stat().st_dev:
        where = Path(tempfile.mkdtemp(dir=shm))
        try:
            yield where
        finally:
            shutil.rmtree(where)
        return
    pytest.skip("no second filesystem: not root and /dev/shm is unusable")


def test_move_across_filesystems(tmp_path: Path) -> None:
    ctx = LocalContext()
    with other_filesystem(tmp_path) as far:
        content = random.Random(3).randbytes(3 * MiB + 17)
        src = tmp_path / "file.bin"
        src.write_bytes(content)
        src.chmod(0o640)
        os.utime(src, ns=(1_000_000_000, 2_000_000_000))
        dst = far / "file.bin"
        result = run(CAP.files_move(MoveParams(src=str(src), dst=str(dst)), ctx))
        assert result.copied and not src.exists()
        assert dst.read_bytes() == content
        assert stat.S_IMODE(dst.stat().st_mode) == 0o640
        assert dst.stat().st_mtime_ns == 2_000_000_000

        tree = tmp_path / "tree"
        (tree / "sub").mkdir(parents=True)
        (tree / "sub" / "leaf").write_bytes(b"leaf")
        (tree / "top").write_bytes(b"top")
        (tree / "link").symlink_to("sub/leaf")
        (tree / "sub").chmod(0o750)
        moved = far / "tree"
        assert run(CAP.files_move(MoveParams(src=str(tree), dst=str(moved)), ctx)).copied
        assert not tree.exists()
        assert (moved / "sub" / "leaf").read_bytes() == b"leaf"
        assert (moved / "top").read_bytes() == b"top"
        assert os.readlink(moved / "link") == "sub/leaf"
        assert stat.S_IMODE((moved / "sub").stat().st_mode) == 0o750

        back = tmp_path / "again"
        back.write_bytes(b"new")
        refused = MoveParams(src=str(back), dst=str(dst), overwrite=False)
        fails(AlreadyExists, CAP.files_move(refused, ctx))
        assert dst.read_bytes() == content and back.exists()
        run(CAP.files_move(MoveParams(src=str(back), dst=str(dst)), ctx))
        assert dst.read_bytes() == b"new" and not back.exists()

        os.mkfifo(tmp_path / "fifo")
        fifo_move = MoveParams(src=str(tmp_path / "fifo"), dst=str(far / "fifo"))
        error = fails(CrossDevice, CAP.files_move(fifo_move, ctx))
        assert error.code == ErrorCode.CROSS_DEVICE
        assert (tmp_path / "fifo").exists()
        assert sorted(os.listdir(far)) == ["file.bin", "tree"]


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="mounting a tiny tmpfs to fill the disk needs root")
def test_move_across_filesystems_without_space_keeps_source(tmp_path: Path) -> None:
    src = tmp_path / "big"
    src.write_bytes(b"b" * (2 * MiB))
    with tmpfs("1m") as far:
        error = fails(
            NoSpace, CAP.files_move(MoveParams(src=str(src), dst=str(far / "big")), LocalContext())
        )
        assert error.code == ErrorCode.NO_SPACE
        assert os.listdir(far) == []
    assert src.read_bytes() == b"b" * (2 * MiB)


# -- files.chmod and files.sha256 ----------------------------------------------------


def test_chmod(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"")
    ctx = LocalContext()
    assert run(CAP.files_chmod(ChmodParams(path=str(target), mode=0o4711), ctx)).mode == 0o4711
    assert stat.S_IMODE(target.stat().st_mode) == 0o4711
    fails(NotFound, CAP.files_chmod(ChmodParams(path=str(tmp_path / "nope"), mode=0o600), ctx))


def test_sha256(tmp_path: Path) -> None:
    content = random.Random(5).randbytes(5 * MiB + 3)
    target = tmp_path / "h.bin"
    target.write_bytes(content)
    ctx = LocalContext()
    result = run(CAP.files_sha256(Sha256Params(path=str(target)), ctx))
    assert (result.sha256, result.size) == (sha(content), len(content))
    (tmp_path / "empty").write_bytes(b"")
    empty = run(CAP.files_sha256(Sha256Params(path=str(tmp_path / "empty")), ctx))
    assert (empty.sha256, empty.size) == (sha(b""), 0)
    fails(IsADirectory, CAP.files_sha256(Sha256Params(path=str(tmp_path)), ctx))
    fails(NotFound, CAP.files_sha256(Sha256Params(path=str(tmp_path / "nope")), ctx))


def test_checksum_is_only_computed_on_request(tmp_path: Path) -> None:
    target = tmp_path / "plain.txt"
    target.write_bytes(b"abc")
    result = run(CAP.files_read(ReadParams(path=str(target)), LocalContext()))
    assert result.sha256 is None
    assert result.data == b"abc"
    written = run(CAP.files_write(WriteParams(path=str(target), data=b"xyz"), LocalContext()))
    assert written.sha256 is None
    assert target.read_bytes() == b"xyz"
