"""What ``files.write`` fsyncs, with and without ``durable``.

An atomic write fsyncs its temporary before the rename (so a crash leaves the
old content or the new, never a part); ``durable`` adds the directory's fsync
after the rename, and in plain mode the file's before the answer. Every
``os.fsync`` the handler makes is recorded here by the path its descriptor
names at that moment, the real fsync still running.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from execd.config import Config
from execd.files import FilesCapability
from protocol.rpc.files import WriteParams
from tests.support.local_ctx import LocalContext

CAP = FilesCapability(Config())
SMALL = b"content\n"
#: Large enough to be written in worker threads block by block when streamed.
BIG = os.urandom(3 * 1024 * 1024 + 17)


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths fsynced during the test, in order."""
    seen: list[str] = []
    real: Callable[[int], None] = os.fsync

    def recording(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return seen


def write(params: WriteParams, chunks: list[bytes] | None = None) -> int:
    async def main() -> int:
        ctx = LocalContext()
        for chunk in chunks or []:
            ctx.feed("data", chunk)
        if chunks is not None:
            ctx.feed("data", b"", end=True)
        return (await CAP.files_write(params, ctx)).size

    return asyncio.run(main())


def is_temporary_of(path: str, target: Path) -> bool:
    name = os.path.basename(path)
    return os.path.dirname(path) == str(target.parent) and name.startswith(f".{target.name}.")


@pytest.mark.parametrize("streamed", [False, True], ids=["inline", "streamed"])
@pytest.mark.parametrize("durable", [False, True], ids=["default", "durable"])
def test_atomic_write_fsyncs_the_temporary_and_the_directory_only_when_durable(
    tmp_path: Path, fsynced: list[str], durable: bool, streamed: bool
) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    data = BIG if streamed else SMALL
    if streamed:
        params = WriteParams(path=str(target), stream=True, durable=durable)
        assert write(params, [data[: 1 << 20], data[1 << 20 :]]) == len(data)
    else:
        assert write(WriteParams(path=str(target), data=data, durable=durable)) == len(data)
    assert target.read_bytes() == data
    assert len(fsynced) == (2 if durable else 1), fsynced
    assert is_temporary_of(fsynced[0], target), fsynced
    if durable:
        assert fsynced[1] == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["out.bin"]


@pytest.mark.parametrize("append", [False, True], ids=["overwrite", "append"])
@pytest.mark.parametrize("durable", [False, True], ids=["default", "durable"])
def test_plain_write_fsyncs_the_file_only_when_durable(
    tmp_path: Path, fsynced: list[str], durable: bool, append: bool
) -> None:
    target = tmp_path / "plain.txt"
    target.write_bytes(b"old content that is longer\n")
    params = WriteParams(path=str(target), data=SMALL, atomic=False, append=append, durable=durable)
    assert write(params) == len(SMALL)
    expected = b"old content that is longer\n" + SMALL if append else SMALL
    assert target.read_bytes() == expected
    assert fsynced == ([str(target)] if durable else [])
