"""Where a launched execd runs and keeps its state, and how it is reached: cwd, ledgers, ports."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harnessd.demo import free_port
from harnessd.errors import LaunchFailed
from harnessd.launcher import serve
from harnessd.runtime import LocalRuntime
from protocol.ledger_chain import GENESIS_HASH
from tests.conftest import one_loop
from tests.support.cut_proxy import CutProxy

pytestmark = [pytest.mark.anyio, one_loop, pytest.mark.timeout(60)]


def _runtime(state_home: Path) -> LocalRuntime:
    """A runtime whose default state directory for execd is ``state_home/execd``."""
    return LocalRuntime(env={**os.environ, "XDG_STATE_HOME": str(state_home)})


async def test_commands_run_in_the_cwd_given_to_serve(tmp_path: Path) -> None:
    here = tmp_path / "the workspace"
    here.mkdir()
    async with serve(cwd=str(here)) as session:
        result = await session.client.run(["pwd"])
        assert result.stdout.decode().strip() == str(here)
        relative = await session.client.run(["sh", "-c", "echo made > out.txt"])
        assert relative.exit_code == 0
    assert (here / "out.txt").read_text() == "made\n"


async def test_a_cwd_that_cannot_be_entered_fails_the_launch_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "not there"
    with pytest.raises(LaunchFailed, match="cwd") as caught:
        await serve(cwd=str(missing), workdir=str(tmp_path / "w"), start_timeout=10)
    assert str(missing) in str(caught.value)
    with pytest.raises(ValueError, match="cwd"):
        await serve(cwd="relative/dir")


async def test_the_ledger_of_a_launched_execd_lives_and_goes_with_its_session(
    tmp_path: Path,
) -> None:
    state_home = tmp_path / "state-home"
    session = await serve(_runtime(state_home))
    workdir = Path(session.workdir)
    head = await session.client.ledger_append("s1", 1, GENESIS_HASH, [b"entry"])
    assert head.seq == 1
    ledgers = list(workdir.glob("state-*/ledger/s1.*"))
    assert sorted(p.suffix for p in ledgers) == [".index", ".ledger"]
    closed = await session.close()
    assert closed.clean and not closed.log_kept
    assert not workdir.exists()
    # Nothing went to the user's state directory.
    assert not state_home.exists() or list(state_home.rglob("*")) == []


async def test_a_given_workdir_keeps_only_the_log_of_a_failed_close(tmp_path: Path) -> None:
    given, state_home = tmp_path / "given", tmp_path / "state-home"
    session = await serve(_runtime(state_home), workdir=str(given))
    await session.client.ledger_append("s1", 1, GENESIS_HASH, [b"entry"])
    os.kill(session.pid, 9)
    closed = await session.close()
    assert closed.log_kept
    assert [p.name for p in given.iterdir()] == [os.path.basename(session.log_path)]
    assert not state_home.exists() or list(state_home.rglob("*")) == []


async def test_a_forwarded_port_is_reached_through_connect_port(tmp_path: Path) -> None:
    bound = free_port()
    forward = await CutProxy("127.0.0.1", bound).start()
    try:
        async with serve(port=bound, connect_port=forward.port) as session:
            assert session.port == forward.port
            assert (await session.client.run(["true"])).exit_code == 0
            assert forward.accepted == 1
            await session.client.close()
            await session.reconnect()
            assert forward.accepted == 2
    finally:
        await forward.close()
    with pytest.raises(ValueError, match="connect_port"):
        await serve(connect_port=70000)
