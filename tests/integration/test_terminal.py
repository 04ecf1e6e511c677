"""Terminals against a real execd: a real pseudo-terminal, line discipline, resize, close."""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from harnessd.api import ExecdClient
from harnessd.errors import AlreadyAttached, NoSuchProcess, ProcessLimit
from tests.conftest import eventually, one_loop

pytestmark = [pytest.mark.anyio, one_loop]


async def test_tty_prints_a_pts_device(client: ExecdClient) -> None:
    term = await client.open_terminal(["tty"])
    output = await term.read(timeout=30, until=b"\n")
    assert re.match(rb"/dev/pts/\d+\r\n", output), output
    assert term.info.tty == output.strip().decode()
    info = await term.wait(timeout=30)
    assert info.exit_code == 0


async def test_stty_size_follows_a_resize(client: ExecdClient) -> None:
    async with await client.open_terminal(["sh"], rows=30, cols=100) as term:
        await term.send(b"stty size\n")
        assert b"30 100" in await term.read(timeout=30, until=b"30 100")
        await term.resize(40, 132)
        await term.send(b"stty size\n")
        assert b"40 132" in await term.read(timeout=30, until=b"40 132")


async def test_the_program_sees_sigwinch(client: ExecdClient) -> None:
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGWINCH, lambda *a: print('winch', flush=True))\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    async with await client.open_terminal([sys.executable, "-c", script]) as term:
        assert b"ready" in await term.read(timeout=30, until=b"ready")
        await term.resize(50, 60)
        assert b"winch" in await term.read(timeout=30, until=b"winch")


async def test_python_repl_evaluates_keys(client: ExecdClient) -> None:
    async with await client.open_terminal([sys.executable, "-i", "-q"]) as term:
        assert b">>> " in await term.read(timeout=30, until=b">>> ")
        await term.send(b"6 * 7\n")
        assert b"42\r\n>>> " in await term.read(timeout=30, until=b">>> ")
        await term.send(b"\x04")
        info = await term.wait(timeout=30)
        assert info.exit_code == 0


async def test_ctrl_c_interrupts_sleep_and_the_prompt_returns(client: ExecdClient) -> None:
    async with await client.open_terminal(["sh"], env={"PS1": "PROMPT> "}) as term:
        assert b"PROMPT> " in await term.read(timeout=30, until=b"PROMPT> ")
        await term.send(b"sleep 30; echo after-$?\n")
        await eventually(lambda: _has_child_named(term.info.pid, "sleep"), what="sleep running")
        await term.send(b"\x03")
        # Ctrl-C through the line discipline: SIGINT to the foreground job, the shell survives.
        output = await term.read(timeout=30, until=b"PROMPT> ")
        assert b"PROMPT> " in output
        await term.send(b"echo alive\n")
        assert b"alive" in await term.read(timeout=30, until=b"alive")


def _has_child_named(parent: int, name: str) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if f"({name})" in stat and int(fields[1]) == parent:
            return True
    return False


async def test_close_kills_a_double_forked_child(client: ExecdClient, tmp_path: object) -> None:
    pidfile = os.path.join(str(tmp_path), "pid")
    script = f"(sleep 300 & echo $! > {pidfile}) ; echo started; exec sleep 300"
    term = await client.open_terminal(command=script)
    assert b"started" in await term.read(timeout=30, until=b"started")
    orphan = int(await eventually(lambda: _read(pidfile), what="pid file"))
    assert _alive(orphan)
    info = await term.close(grace=2)
    assert info.state == "exited"
    assert info.signal == signal.SIGHUP
    await eventually(lambda: not _alive(orphan), what="double-forked child gone")
    with pytest.raises(NoSuchProcess):
        await client.attach_terminal(term.terminal_id).wait(timeout=0)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


async def test_detach_and_reattach_replays_recent_output(client: ExecdClient) -> None:
    term = await client.open_terminal(["sh"])
    await term.send(b"echo first-line\n")
    assert b"first-line" in await term.read(timeout=30, until=b"first-line\r\n")
    await term.detach()
    again = client.attach_terminal(term.terminal_id)
    replay = await again.read(timeout=30, until=b"first-line\r\n")
    assert b"first-line" in replay
    with pytest.raises(AlreadyAttached):
        await client.attach_terminal(term.terminal_id).read(timeout=5)
    await again.send(b"exit 3\n")
    assert (await again.wait(timeout=30)).exit_code == 3


async def test_output_iterator_streams_until_exit(client: ExecdClient) -> None:
    term = await client.open_terminal(command="for i in 1 2 3; do echo line$i; done")
    collected = b""
    async for chunk in term.output():
        collected += chunk
    assert collected.split() == [b"line1", b"line2", b"line3"]
    assert term.info.state == "exited" and term.info.exit_code == 0


async def test_terminals_carry_the_marker_and_take_limits(client: ExecdClient) -> None:
    marker = (await client.server_info()).marker
    async with await client.open_terminal(
        ["sh", "-c", "ulimit -n; sleep 30"], limits={"open_files": 55}, cwd="/tmp"
    ) as term:
        assert b"55" in await term.read(timeout=30, until=b"55")
        with open(f"/proc/{term.info.pid}/environ", "rb") as f:
            assert marker.encode() in f.read()
        assert os.readlink(f"/proc/{term.info.pid}/cwd") == "/tmp"


@pytest.mark.execd_args("--max-processes", "1")
async def test_running_terminals_count_against_the_process_limit(client: ExecdClient) -> None:
    async with await client.open_terminal(["sleep", "30"]):
        with pytest.raises(ProcessLimit):
            await client.open_terminal(["sleep", "30"])


async def test_an_attached_reader_loses_nothing_of_a_flood(client: ExecdClient) -> None:
    # Eight times the daemon's ring: only flow control keeps every byte.
    size = 8 * 1024 * 1024
    flood = f"import sys; sys.stdout.write('x' * {size}); sys.stdout.flush()"
    term = await client.open_terminal([sys.executable, "-c", flood])
    chunks = term.output()
    received = len(await anext(chunks))
    # A reader that stops taking output stops the program (it would finish in well under this).
    paused = await client.attach_terminal(term.terminal_id).wait(timeout=3)
    assert paused.state == "running"
    async for chunk in chunks:
        received += len(chunk)
    assert term.lost == 0
    assert received == size
    assert term.info.exit_code == 0


async def test_terminals_die_with_the_session(client: ExecdClient, tmp_path: object) -> None:
    pidfile = os.path.join(str(tmp_path), "pid")
    term = await client.open_terminal(command=f"sleep 300 & echo $! > {pidfile}; exec sleep 301")
    background = int(await eventually(lambda: _read(pidfile), what="pid file"))
    leader = term.info.pid
    await client.cleanup()
    await eventually(lambda: not _alive(leader), what="terminal's program gone")
    await eventually(lambda: not _alive(background), what="its background job gone")
