"""A session reconnects by itself, and a call made while its connection is down is never lost.

The session's client goes through a :class:`~tests.support.cut_proxy.CutProxy`.
A connection dropped with nothing in flight is replaced by itself; a call
made while it is down waits for the new connection and runs there once, or,
past ``reattach_within``, fails with :class:`~harnessd.errors.NotSent`, which
guarantees it never ran. A plain client says NotSent at once.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

import harnessd
from tests.conftest import eventually, one_loop
from tests.support.cut_proxy import CutProxy
from tests.support.daemon import RunningExecd
from tests.support.procs import run_python
from tests.support.proxied import proxied_session

pytestmark = [pytest.mark.anyio, one_loop, pytest.mark.timeout(120)]


async def test_a_session_whose_idle_connection_drops_reconnects_by_itself(tmp_path: Path) -> None:
    async with proxied_session(tmp_path) as (session, proxy):
        before = session.client
        await before.noop()
        accepted = proxy.accepted
        assert proxy.cut() == 1
        await eventually(
            lambda: session.client is not before and not session.client.closed,
            timeout=20,
            what="a new connection",
        )
        assert proxy.accepted == accepted + 1
        assert await session.client.echo(b"back") == b"back"


async def test_calls_made_while_the_session_reconnects_wait_and_run_once(tmp_path: Path) -> None:
    target = tmp_path / "ran"
    async with proxied_session(tmp_path) as (session, proxy):
        old = session.client
        proxy.refusing = True
        proxy.cut()
        await eventually(lambda: old.closed, what="the cut noticed")
        run = asyncio.ensure_future(old.run(command=f"echo x >> {target}; echo ran"))
        echo = asyncio.ensure_future(session.client.echo(b"waits"))
        await eventually(lambda: proxy.refused >= 2, what="reconnections refused")
        assert not run.done() and not echo.done() and not target.exists()
        proxy.refusing = False
        result = await asyncio.wait_for(run, 30)
        assert (result.exit_code, result.stdout) == (0, b"ran\n")
        assert await asyncio.wait_for(echo, 30) == b"waits"
        assert target.read_text() == "x\n"
        assert session.client is not old and not session.client.closed


async def test_a_call_made_while_down_past_reattach_within_is_not_sent(tmp_path: Path) -> None:
    target = tmp_path / "ran"
    async with proxied_session(tmp_path, reattach_within=1.0) as (session, proxy):
        old = session.client
        proxy.refusing = True
        proxy.cut()
        await eventually(lambda: old.closed, what="the cut noticed")
        with pytest.raises(harnessd.NotSent, match="not sent"):
            await asyncio.wait_for(old.run(command=f"echo x >> {target}"), 30)
        proxy.refusing = False
        client = await session.reconnect()
        await client.noop()
        assert not target.exists()  # it never ran, and never will


async def test_a_plain_client_whose_connection_is_down_says_not_sent_at_once(
    execd: RunningExecd,
) -> None:
    proxy = await CutProxy(execd.host, execd.port).start()
    try:
        client = await harnessd.connect("127.0.0.1", proxy.port, execd.token)
        proxy.cut()
        await eventually(lambda: client.closed, what="the cut noticed")
        with pytest.raises(harnessd.NotSent):
            await client.noop()
        with pytest.raises(harnessd.NotSent):
            client.run_streaming(["true"])
        await client.close()
        closed = await harnessd.connect(execd.host, execd.port, execd.token)
        await closed.close()
        with pytest.raises(harnessd.NotSent):
            await closed.echo(b"x")
    finally:
        await proxy.close()


def test_the_reconnect_example_loses_nothing(tmp_path: Path) -> None:
    """docs/client.md: a cut and an outage under a running command; every line, once."""
    example = Path(__file__).resolve().parents[2] / "examples" / "reconnect.py"
    done = run_python(str(example), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    cut, *rest = done.stdout.splitlines()
    assert re.fullmatch(r"cut after ([5-9]|1\d) lines", cut), cut
    assert rest == ["all 20 lines, exit code 0, on a new connection", "reconnect: ok"]
    assert list(tmp_path.iterdir()) == [], "the example leaves nothing in its directory"
