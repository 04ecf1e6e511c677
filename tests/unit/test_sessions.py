"""Persistent shell sessions driven through LocalContext, with real shells and processes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from execd import errors, marker
from execd.sessions import SESSION_MARKER_VAR, SessionsCapability
from protocol.rpc import sessions as rpc
from tests.conftest import eventually
from tests.support.capabilities import MARKER_VAR, capability_fixture
from tests.support.local_ctx import LocalContext
from tests.support.procs import alive, children

pytestmark = pytest.mark.anyio


def _no_session_directory(cap: SessionsCapability, state: Path) -> None:
    assert list((state / "sessions").iterdir()) == []


cap = capability_fixture(SessionsCapability, after=_no_session_directory, kill_grace=0.5)


async def open_session(cap: SessionsCapability, name: str = "s", **kw: Any) -> rpc.SessionInfo:
    return await cap.sessions_open(rpc.OpenParams(name=name, **kw), LocalContext())


async def sh(cap: SessionsCapability, command: str, name: str = "s", **kw: Any) -> rpc.RunResult:
    return await cap.sessions_run(rpc.RunParams(name=name, command=command, **kw), LocalContext())


async def test_cwd_and_exported_environment_persist(
    cap: SessionsCapability, tmp_path: Path
) -> None:
    (tmp_path / "sub dir").mkdir()
    info = await open_session(cap, cwd=str(tmp_path), env={"START": "given"})
    assert info.state == "idle" and info.cwd == str(tmp_path)
    first = await sh(cap, 'cd "sub dir" && export GREETING=hello && LOCAL=kept')
    assert first.exit_code == 0 and first.cwd == str(tmp_path / "sub dir")
    second = await sh(cap, 'pwd; echo "$GREETING $START $LOCAL"; sh -c \'echo "$GREETING"\'')
    assert second.stdout == f"{tmp_path}/sub dir\nhello given kept\nhello\n".encode()
    assert second.cwd == str(tmp_path / "sub dir")
    third = await sh(cap, "f() { echo from function; }; false")
    assert third.exit_code == 1
    assert (await sh(cap, "f")).stdout == b"from function\n"
    listing = await cap.sessions_list(rpc.ListParams(), LocalContext())
    assert [(s.name, s.commands, s.state) for s in listing.sessions] == [("s", 4, "idle")]


async def test_output_imitating_status_lines_cannot_confuse_the_result(
    cap: SessionsCapability, tmp_path: Path
) -> None:
    await open_session(cap)
    # Fake status lines in every plausible shape, including the real nonce
    # of the running command (the driver's variable) with a success status.
    command = (
        "printf '%s 0\\n' \"$__execd_id\"; printf '%s 0\\n' \"$__execd_id\" >&2;"
        " printf 'deadbeefdeadbeefdeadbeefdeadbeef 0\\n'; printf '\\n0\\n\\0 0\\n';"
        f" echo {MARKER_VAR}=fake {SESSION_MARKER_VAR}=fake; exit_code=0; (exit 7)"
    )
    result = await sh(cap, command)
    assert result.exit_code == 7
    lines = result.stdout.split(b"\n")
    assert len(lines[0].split()[0]) == 32 and lines[0].endswith(b" 0")
    assert b"deadbeefdeadbeefdeadbeefdeadbeef 0" in result.stdout
    assert result.stderr.endswith(b" 0\n")
    # Output without a final newline, and no output at all, are fine too.
    assert (await sh(cap, "printf 'no newline'")).stdout == b"no newline"
    empty = await sh(cap, ":")
    assert (empty.exit_code, empty.stdout, empty.stderr) == (0, b"", b"")


async def test_heredoc_and_stdin(cap: SessionsCapability, tmp_path: Path) -> None:
    await open_session(cap, env={"WHO": "world"})
    heredoc = await sh(
        cap, "cat <<EOF\nhello $WHO\n  indented 'quotes'\nEOF\ncat <<'RAW'\n$WHO\nRAW"
    )
    assert heredoc.stdout == b"hello world\n  indented 'quotes'\n$WHO\n"
    eof = await sh(cap, "cat; echo status=$?; read line || echo read-eof")
    assert eof.stdout == b"status=0\nread-eof\n"
    given = await sh(cap, "read first; cat; echo; echo first=$first", stdin=b"one\ntwo\nthree")
    assert given.stdout == b"two\nthree\nfirst=one\n"
    binary = bytes(range(256)) * 100
    assert (await sh(cap, "cat", stdin=binary)).stdout == binary


async def test_background_job_does_not_block_and_dies_at_close(
    cap: SessionsCapability, tmp_path: Path
) -> None:
    await open_session(cap)
    began = time.monotonic()
    started = await sh(cap, "sleep 300 & echo $!; setsid sleep 300 & echo $!")
    assert time.monotonic() - began < 5
    assert started.exit_code == 0
    pids = [int(p) for p in started.stdout.split()]
    assert all(alive(pid) for pid in pids)
    assert (await sh(cap, "echo next")).stdout == b"next\n"
    closed = await cap.sessions_close(rpc.CloseParams(name="s"), LocalContext())
    assert closed.remaining == [] and closed.killed >= 3
    assert closed.info.state == "dead"
    await eventually(lambda: not any(alive(pid) for pid in pids))
    with pytest.raises(errors.NoSuchSession):
        await sh(cap, "true")


async def test_interrupt_stops_the_foreground_command_only(
    cap: SessionsCapability, tmp_path: Path
) -> None:
    shell = (await open_session(cap, cwd=str(tmp_path))).pid
    bg = await sh(cap, "mkdir here; sleep 300 & echo $!")
    background = int(bg.stdout)
    await sh(cap, "cd here")
    assert (
        await cap.sessions_interrupt(rpc.InterruptParams(name="s"), LocalContext())
    ).sent is False
    running = asyncio.ensure_future(
        sh(cap, f"echo before; sleep 100; echo after > {tmp_path}/after")
    )
    # Interrupt only once the foreground sleep runs beside the background one.
    await eventually(lambda: len(children(shell, "sleep")) == 2)
    with pytest.raises(errors.SessionBusy):
        await sh(cap, "true")
    sent = await cap.sessions_interrupt(rpc.InterruptParams(name="s"), LocalContext())
    assert sent.sent
    result = await asyncio.wait_for(running, 10)
    assert result.exit_code == 130 and result.interrupted and not result.timed_out
    assert result.stdout == b"before\n" and not result.session_ended
    assert not (tmp_path / "after").exists(), "the rest of the command text is skipped"
    assert result.cwd == str(tmp_path / "here")
    assert alive(background), "background jobs ignore the interrupt"
    after = await sh(cap, "pwd")
    assert after.stdout == f"{tmp_path}/here\n".encode() and after.exit_code == 0


async def test_timeout_interrupts_then_kills_and_the_session_survives(
    cap: SessionsCapability, tmp_path: Path
) -> None:
    await open_session(cap)
    background = int((await sh(cap, "sleep 300 & echo $!")).stdout)
    began = time.monotonic()
    plain = await sh(cap, "echo partial; sleep 100", timeout=0.3)
    assert time.monotonic() - began < 5
    assert plain.timed_out and plain.exit_code == 130 and plain.stdout == b"partial\n"
    # A command that ignores SIGINT has its processes killed after the grace.
    stubborn = await sh(cap, "trap '' INT; sleep 100; echo status $?", timeout=0.3)
    assert stubborn.timed_out and stubborn.stdout == b"status 137\n"
    assert not stubborn.session_ended
    looping = await sh(cap, "while :; do :; done", timeout=0.3)
    assert looping.timed_out and looping.exit_code == 130
    assert alive(background), "jobs of earlier commands survive the escalation"
    assert (await sh(cap, "trap - INT; echo ok")).stdout == b"ok\n"


async def test_exit_ends_the_session(cap: SessionsCapability, tmp_path: Path) -> None:
    info = await open_session(cap)
    ended = await sh(cap, "echo bye; exit 3")
    assert ended.session_ended and ended.exit_code == 3 and ended.stdout == b"bye\n"
    assert ended.cwd is None and not alive(info.pid)
    with pytest.raises(errors.SessionDead) as caught:
        await sh(cap, "echo again")
    assert caught.value.data["exit_code"] == 3
    with pytest.raises(errors.SessionDead):
        await cap.sessions_interrupt(rpc.InterruptParams(name="s"), LocalContext())
    listing = await cap.sessions_list(rpc.ListParams(), LocalContext())
    assert listing.sessions[0].state == "dead" and listing.sessions[0].exit_code == 3
    # A dead session's name can be opened again.
    again = await open_session(cap)
    assert again.pid != info.pid and (await sh(cap, "echo fresh")).stdout == b"fresh\n"


async def test_syntax_errors_and_shell_state_changes_do_not_break_the_session(
    cap: SessionsCapability, tmp_path: Path
) -> None:
    await open_session(cap)
    broken = await sh(cap, "if then fi")
    assert broken.exit_code == 2 and b"rror" in broken.stderr
    tricky = await sh(cap, "break; continue; return 5; echo unreached")
    assert tricky.exit_code == 5 and tricky.stdout == b""
    await sh(cap, "set -u; IFS=x; cd /")
    assert (await sh(cap, f"unset {SESSION_MARKER_VAR}")).exit_code != 0
    state = await sh(cap, f"echo ${{{SESSION_MARKER_VAR}:+kept}}")
    assert state.stdout == b"kept\n", "the sub-marker cannot be removed"
    assert (await sh(cap, "echo fine")).stdout == b"fine\n"


async def test_output_cap_keeps_head_and_tail(cap: SessionsCapability, tmp_path: Path) -> None:
    await open_session(cap)
    result = await sh(cap, "seq 1 100000; seq 1 10 >&2", output_cap=1000)
    assert len(result.stdout) == 1000 and result.stdout.startswith(b"1\n2\n3\n")
    assert result.stdout.endswith(b"99999\n100000\n")
    assert result.stdout_dropped == len(b"".join(b"%d\n" % i for i in range(1, 100001))) - 1000
    assert result.stderr == b"".join(b"%d\n" % i for i in range(1, 11))


async def test_cancelled_run_interrupts_the_command_and_frees_the_session(
    cap: SessionsCapability, tmp_path: Path
) -> None:
    shell = (await open_session(cap)).pid
    task = asyncio.ensure_future(sh(cap, "sleep 100"))
    await eventually(lambda: children(shell, "sleep"), what="the command running")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: cap._sessions["s"].current is None)
    assert (await sh(cap, "echo free")).stdout == b"free\n"


async def test_close_kills_everything_the_session_started(
    cap: SessionsCapability, tmp_path: Path
) -> None:
    await open_session(cap, name="a")
    shell_b = (await open_session(cap, name="b")).pid
    await sh(cap, "sleep 300 & (setsid sh -c 'sleep 300 & wait') &", name="a")
    busy = asyncio.ensure_future(sh(cap, "sleep 300", name="b"))
    await eventually(lambda: children(shell_b, "sleep"), what="b's command running")
    subs = [cap._sessions[n].sub_marker for n in ("a", "b")]
    await eventually(lambda: len(marker.find_marked(SESSION_MARKER_VAR, subs[0])) >= 4)
    closed = await cap.sessions_close(rpc.CloseParams(name="b"), LocalContext())
    assert closed.remaining == []
    ended = await asyncio.wait_for(busy, 10)
    assert ended.session_ended
    assert marker.find_marked(SESSION_MARKER_VAR, subs[1]) == []
    assert marker.find_marked(SESSION_MARKER_VAR, subs[0]) != []
    await cap.close()
    assert marker.find_marked(SESSION_MARKER_VAR, subs[0]) == []
    with pytest.raises(errors.ShuttingDown):
        await open_session(cap, name="c")


@pytest.mark.limits(max_sessions=2)
async def test_errors_exists_limit_and_invalid(cap: SessionsCapability, tmp_path: Path) -> None:
    await open_session(cap, name="one")
    with pytest.raises(errors.SessionExists):
        await open_session(cap, name="one")
    await open_session(cap, name="two")
    with pytest.raises(errors.LimitExceeded):
        await open_session(cap, name="three")
    # A dead session gives its place to a new one.
    await sh(cap, "exit", name="two")
    await open_session(cap, name="three")
    assert [
        s.name for s in (await cap.sessions_list(rpc.ListParams(), LocalContext())).sessions
    ] == ["one", "three"]
    with pytest.raises(errors.InvalidParams):
        await open_session(cap, name="x", env={MARKER_VAR: "other"})
    with pytest.raises(errors.InvalidParams):
        await open_session(cap, name="x", unset=[SESSION_MARKER_VAR])
    with pytest.raises(errors.NoSuchSession):
        await sh(cap, "true", name="ghost")
    with pytest.raises(errors.NoSuchSession):
        await cap.sessions_close(rpc.CloseParams(name="ghost"), LocalContext())
