"""execd.spawn_at: a command with a working directory through glibc's posix_spawn, against Popen.

Both ways of starting a command elsewhere run the same cases and must agree:
the working directory, PATH lookup, the signals a child starts with, which
descriptors it gets, and the typed error of every failure.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from execd import spawn as sp
from execd import spawn_at
from execd.errors import InvalidParams, SpawnFailed
from tests.support.procs import searchable_path
from tests.unit.test_spawn import collect

ENV = dict(os.environ)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["posix_spawn", "popen"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test runs once through posix_spawn with a chdir action and once through Popen."""
    if request.param == "posix_spawn":
        if not spawn_at.available():
            pytest.skip("this C library has no posix_spawn_file_actions_addchdir_np")
    else:
        monkeypatch.setattr(spawn_at, "available", lambda: False)
    yield request.param


async def test_runs_in_the_directory_with_the_commands_path(way: str, tmp_path: Path) -> None:
    tool = tmp_path / "bin" / "mytool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho tool:$(pwd):$FOO\n")
    tool.chmod(0o755)
    env = dict(ENV, FOO="bar", PATH=f"{tool.parent}:{ENV.get('PATH', '/usr/bin:/bin')}")
    status, out, _ = await collect(sp.spawn(["mytool"], env=env, cwd=str(tmp_path)))
    assert (sp.decode_status(status), out) == ((0, None), f"tool:{tmp_path}:bar\n".encode())
    # A relative program name is found from the new working directory.
    status, out, _ = await collect(sp.spawn(["./bin/mytool"], env=env, cwd=str(tmp_path)))
    assert out == f"tool:{tmp_path}:bar\n".encode()
    # execd's own PATH: searched by the C library.
    status, out, _ = await collect(sp.spawn(["pwd"], env=ENV, cwd=str(tmp_path)))
    assert out == f"{tmp_path}\n".encode()


async def test_child_starts_clean(
    way: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    leak = os.open("/dev/null", os.O_RDONLY)
    os.set_inheritable(leak, True)  # as if inherited from execd's parent
    monkeypatch.setattr(sp, "_swept", False)  # as in a fresh execd
    try:
        script = "ls /proc/self/fd; echo --; grep ^SigIgn /proc/self/status"
        _, out, _ = await collect(sp.spawn(["/bin/sh", "-c", script], env=ENV, cwd=str(tmp_path)))
    finally:
        os.close(leak)
    listing, status = out.decode().split("--\n")
    fds = {int(x) for x in listing.split()}
    assert fds <= {0, 1, 2, 3}, fds
    ignored = int(status.split()[1], 16)
    for signum in (signal.SIGPIPE, signal.SIGINT, signal.SIGQUIT):
        assert not ignored & (1 << (signum - 1)), signum


async def test_failures_are_typed_alike(way: str, tmp_path: Path) -> None:
    not_exec = tmp_path / "data.txt"
    not_exec.write_text("hello")
    before = len(os.listdir("/proc/self/fd"))
    cases: list[tuple[list[str], dict[str, str], str, str, str]] = [
        (["true"], ENV, str(tmp_path / "missing"), "working directory", "ENOENT"),
        (["true"], ENV, str(not_exec), "working directory", "ENOTDIR"),
        (["no-such-program-xyz"], dict(ENV, PATH=searchable_path()), "/", "command", "ENOENT"),
        ([str(not_exec)], ENV, str(tmp_path), "command", "EACCES"),
    ]
    for argv, env, cwd, what, code in cases:
        with pytest.raises(SpawnFailed) as info:
            sp.spawn(argv, env=env, cwd=cwd)
        assert (info.value.data["what"], info.value.data["errno"]) == (what, code), argv
    for argv, env in ((["echo", "a\0b"], ENV), (["true"], {"A=B": "1"})):
        with pytest.raises(InvalidParams):
            sp.spawn(argv, env=env, cwd=str(tmp_path))
    assert len(os.listdir("/proc/self/fd")) <= before


async def test_each_spawn_gets_its_own_environment(way: str, tmp_path: Path) -> None:
    """The environment vector is reused only for the very same variables, and checked each time."""
    show = ["/bin/sh", "-c", 'echo "$A:${B-unset}"']
    first = dict(ENV, A="B=c")
    for env, expected in ((first, b"B=c:unset\n"), (dict(first), b"B=c:unset\n")):
        _, out, _ = await collect(sp.spawn(show, env=env, cwd=str(tmp_path)))
        assert out == expected
    changed = dict(ENV, A="d", B="e")
    _, out, _ = await collect(sp.spawn(show, env=changed, cwd=str(tmp_path)))
    assert out == b"d:e\n"
    _, out, _ = await collect(sp.spawn(show, env=first, cwd=str(tmp_path)))
    assert out == b"B=c:unset\n"
    # Right after it, an environment whose entry reads the same ("A=B=c") but with a
    # name no process can receive.
    renamed = {**{k: v for k, v in ENV.items() if k != "A"}, "A=B": "c"}
    with pytest.raises(InvalidParams):
        sp.spawn(show, env=renamed, cwd=str(tmp_path))


async def test_kept_file_actions_follow_each_spawns_directory_and_pipes(
    way: str, tmp_path: Path
) -> None:
    """More directories than the kept file actions, each twice: every command runs where it was
    asked, with its own pipes and stdin, and what is kept stays bounded."""
    count = spawn_at._KEPT_ACTIONS + 4
    directories = [tmp_path / f"d{index}" for index in range(count)]
    for directory in directories:
        directory.mkdir()
    show = ["/bin/sh", "-c", "pwd; read line; echo $line >&2"]
    for directory in [*directories, *directories]:
        child = sp.spawn(show, env=ENV, cwd=str(directory), stdin_pipe=True)
        assert child.stdin is not None
        os.write(child.stdin, f"in:{directory.name}\n".encode())
        child.close_stdin()
        status, out, err = await collect(child)
        assert (status, out, err) == (
            0,
            f"{directory}\n".encode(),
            f"in:{directory.name}\n".encode(),
        )
    libc = spawn_at._load()
    if way == "posix_spawn":
        assert libc is not None
        assert 0 < len(libc.actions) <= spawn_at._KEPT_ACTIONS


async def test_the_same_variables_in_another_order_reach_the_child_in_that_order(
    way: str, tmp_path: Path
) -> None:
    """The kept environment vector is reused only for the same names in the same order."""
    base = {k: v for k, v in ENV.items() if k not in ("A_FIRST", "B_SECOND")}
    ordered = {"A_FIRST": "1", "B_SECOND": "2", **base}
    reordered = {"B_SECOND": "2", "A_FIRST": "1", **base}
    names = [b"A_FIRST", b"B_SECOND"]
    for env, expected in ((ordered, names), (reordered, names[::-1]), (ordered, names)):
        _, out, _ = await collect(
            sp.spawn(["/bin/cat", "/proc/self/environ"], env=env, cwd=str(tmp_path))
        )
        seen = [entry.split(b"=", 1)[0] for entry in out.split(b"\0")]
        assert [name for name in seen if name in names] == expected
