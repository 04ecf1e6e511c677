"""execd's built-in workspace utilities, the runtime that uses them, and installing the worker.

``execd tool ...`` runs as a real subprocess; :class:`WorkerToolRuntime` launches
a real execd through them (here with ``python -m execd`` behind a one-line
wrapper standing in for the worker file). Installing needs the built worker
(:mod:`tests.support.worker_build`) and goes through a real command prefix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harnessd.errors import LaunchFailed
from harnessd.launcher import serve
from harnessd.runtime import CommandPrefixRuntime
from harnessd.worker_install import (
    WorkerFile,
    WorkerInstallFailed,
    install_worker,
    remove_worker,
)
from harnessd.worker_runtime import WorkerToolRuntime
from tests.conftest import eventually, one_loop
from tests.support import worker_build

pytestmark = [pytest.mark.anyio, one_loop, pytest.mark.timeout(120)]

PWD = "import os; print(os.getcwd())"


def tool(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "execd", "tool", *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
    )


def test_files_and_directories(tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b"
    assert tool("mkdir", "-p", "-m", "700", "--", str(deep)).returncode == 0
    assert oct(deep.stat().st_mode & 0o777) == "0o700"
    again = tool("mkdir", "-m", "700", "--", str(deep))
    assert again.returncode == 1 and b"File exists" in again.stderr

    target = tmp_path / "new" / "file"
    assert tool("write", "-m", "640", "-p", "--", str(target), stdin=b"data").returncode == 0
    assert target.read_bytes() == b"data" and oct(target.stat().st_mode & 0o777) == "0o640"
    assert oct(target.parent.stat().st_mode & 0o777) == "0o700"
    assert tool("write", str(target), stdin=b"other").returncode == 1
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    assert tool("write", str(link), stdin=b"x").returncode == 1
    assert not (tmp_path / "elsewhere").exists()
    assert tool("cat", "--", str(target)).stdout == b"data"

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "stay").write_text("x")
    (deep / "through").symlink_to(kept)
    assert tool("rm", "-rf", "--", str(tmp_path / "a"), str(tmp_path / "missing")).returncode == 0
    assert not (tmp_path / "a").exists() and (kept / "stay").exists()
    assert tool("rm", str(tmp_path / "missing")).returncode == 1
    assert tool("rm", str(kept)).returncode == 1
    assert tool("rmdir", str(kept)).returncode == 1
    (kept / "stay").unlink()
    assert tool("rmdir", str(kept)).returncode == 0 and not kept.exists()


def test_probe_describes_the_workspace() -> None:
    facts = json.loads(tool("probe").stdout)
    assert facts["arch"] == os.uname().machine
    assert facts["uid"] == os.getuid() and facts["shell"] is True
    # Run from a Python installation, not the worker file.
    assert facts["worker"] is None and facts["sha256"] is None


async def test_start_supervises_and_reports_how_the_command_ended(tmp_path: Path) -> None:
    log = tmp_path / "log"
    started = tool("start", str(log), "--", sys.executable, "-c", "print('hello'); exit(3)")
    assert started.returncode == 0, started.stderr
    await eventually(lambda: b'"source": "supervisor"' in log.read_bytes(), what="exit line")
    lines = log.read_bytes().splitlines()
    assert lines[0] == b"hello"
    assert json.loads(lines[-1]) == {"event": "exited", "code": 3, "source": "supervisor"}
    assert oct(log.stat().st_mode & 0o777) == "0o600"

    killed = tmp_path / "killed"
    script = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert tool("start", str(killed), "--", sys.executable, "-c", script).returncode == 0
    await eventually(lambda: b"supervisor" in killed.read_bytes(), what="exit line")
    assert json.loads(killed.read_bytes().splitlines()[-1])["code"] == 128 + 9

    missing = tool("start", str(tmp_path / "never"), "--", str(tmp_path / "no-such-program"))
    assert missing.returncode == 1 and b"No such file" in missing.stderr


@pytest.fixture
def python_worker(tmp_path: Path) -> str:
    """An executable that is execd the way the worker file is (``WORKER tool ...``, ``WORKER``)."""
    wrapper = tmp_path / "worker"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m execd "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


async def test_a_session_through_the_workers_own_utilities(
    tmp_path: Path, python_worker: str
) -> None:
    runtime = WorkerToolRuntime([], python_worker)
    options = {"extra_args": ("--state-dir", str(tmp_path / "state"))}
    async with serve(runtime, execd_command=[python_worker], **options) as session:  # type: ignore[arg-type]
        ran = await session.client.run(["echo", "through the tools"])
        assert ran.stdout == b"through the tools\n"
        workdir, log = session.workdir, session.log_path
        assert Path(log).exists()
    assert not Path(workdir).exists()


async def test_start_enters_the_directory_it_is_given(tmp_path: Path) -> None:
    log = tmp_path / "log"
    here = tmp_path / "here"
    here.mkdir()
    started = tool("start", "--cwd", str(here), str(log), "--", sys.executable, "-c", PWD)
    assert started.returncode == 0, started.stderr
    await eventually(lambda: b'"source": "supervisor"' in log.read_bytes(), what="exit line")
    lines = log.read_bytes().splitlines()
    assert lines[0] == str(here).encode()
    assert json.loads(lines[-1]) == {"event": "exited", "code": 0, "source": "supervisor"}

    # A directory that cannot be entered: nothing starts, the supervisor says why (126).
    missing = tmp_path / "missing"
    refused = tmp_path / "refused"
    started = tool("start", "--cwd", str(missing), str(refused), "--", sys.executable, "-c", PWD)
    assert started.returncode == 0, started.stderr
    await eventually(lambda: b"supervisor" in refused.read_bytes(), what="exit line")
    said, ended = refused.read_bytes().decode().splitlines()
    assert said.startswith(f"execd tool start: cannot enter {missing}: "), said
    assert json.loads(ended) == {
        "event": "exited",
        "code": 126,
        "source": "supervisor",
        "error": "cannot enter the directory given as cwd",
    }


async def test_serve_in_a_cwd_through_the_workers_own_utilities(
    tmp_path: Path, python_worker: str
) -> None:
    """``serve(cwd=...)`` where execd starts without a shell: the worker's supervisor enters it."""
    here = tmp_path / "the workspace"
    here.mkdir()
    runtime = WorkerToolRuntime([], python_worker)
    state = ("--state-dir", str(tmp_path / "state"))
    async with serve(
        runtime, execd_command=[python_worker], cwd=str(here), extra_args=state
    ) as session:
        ran = await session.client.run([sys.executable, "-c", PWD])
        assert ran.stdout.decode().strip() == str(here)
        execd_cwd = os.readlink(f"/proc/{session.pid}/cwd")
        assert execd_cwd == str(here)

    missing = tmp_path / "not there"
    with pytest.raises(LaunchFailed, match="cwd") as caught:
        await serve(
            runtime,
            execd_command=[python_worker],
            cwd=str(missing),
            workdir=str(tmp_path / "w"),
            extra_args=state,
            start_timeout=30,
        )
    assert "exited with status 126" in str(caught.value)
    assert str(missing) in str(caught.value)


async def test_install_is_cached_verified_and_removed(tmp_path: Path) -> None:
    try:
        built = worker_build.worker()
    except worker_build.Unavailable as exc:
        pytest.skip(str(exc))
    worker = await WorkerFile.locate(str(built))
    runtime = CommandPrefixRuntime([])
    directory = tmp_path / "cache"
    first = await install_worker(runtime, worker, directory=str(directory))
    assert first.uploaded and not first.bare
    assert first.path == str(directory / worker.name)
    assert sorted(os.listdir(directory)) == [worker.name]
    second = await install_worker(runtime, worker, directory=str(directory))
    assert not second.uploaded

    # A damaged file by that name is replaced, not trusted.
    Path(first.path).write_bytes(b"\x7fELF damaged")
    third = await install_worker(runtime, worker, directory=str(directory))
    assert third.uploaded
    assert WorkerFile.load(third.path).sha256 == worker.sha256

    await remove_worker(third)
    assert os.listdir(directory) == []
    with pytest.raises(WorkerInstallFailed):
        await WorkerFile.locate(str(tmp_path / "no-such-worker"))
