"""Random cuts over mixed calls: each call's effect happens at most once, and success means done.

Hypothesis draws a sequence of calls (shell appends, file appends, echoes;
some slow) and where to cut the TCP connection under them (so many bytes
into either direction, once or twice). A real execd serves them through a
:class:`~tests.support.cut_proxy.CutProxy`; a client that reconnects by
itself (as a launcher session does) reattaches what was in flight. Whatever
the cuts, every call's side effect is there at most once, and every call the
client was told succeeded has its effect there exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import harnessd
from harnessd.api import ExecdClient
from harnessd.reattach import Reconnector
from tests.support.cut_proxy import CutProxy
from tests.support.daemon import RunningExecd, start_execd

Kind = Literal["shell", "slow_shell", "append_file", "echo"]


@dataclass(frozen=True)
class Op:
    kind: Kind
    token: str


@dataclass(frozen=True)
class Cut:
    direction: Literal["up", "down"]
    nbytes: int


KINDS: tuple[Kind, ...] = get_args(Kind)

ops_strategy = st.lists(st.sampled_from(KINDS), min_size=1, max_size=8).map(
    lambda kinds: [Op(kind, f"t{i}") for i, kind in enumerate(kinds)]
)
cuts_strategy = st.lists(
    st.builds(Cut, st.sampled_from(["up", "down"]), st.integers(0, 4000)), min_size=1, max_size=2
)


@pytest.fixture(scope="module")
def shared_execd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningExecd]:
    with start_execd(tmp_path_factory.mktemp("execd"), "--request-grace", "30") as running:
        yield running


class Driver:
    """A client that reconnects through the proxy by itself and reattaches its calls."""

    def __init__(self, execd: RunningExecd, proxy: CutProxy, cuts: list[Cut]) -> None:
        self.execd = execd
        self.proxy = proxy
        self.cuts = list(cuts)
        self.client: ExecdClient | None = None
        self.reconnector = Reconnector(self.reconnect, self.current, lambda: False, 20.0)

    def current(self) -> ExecdClient:
        assert self.client is not None
        return self.client

    async def connect(self) -> ExecdClient:
        client = await harnessd.connect(
            "127.0.0.1", self.proxy.port, self.execd.token, reattach_within=20.0
        )
        client.on_lost = self.reconnector.lost
        if self.cuts:
            cut = self.cuts.pop(0)
            self.proxy.cut_after(cut.direction, cut.nbytes)
        return client

    async def reconnect(self) -> None:
        fresh = await self.connect()
        old, self.client = self.current(), fresh
        fresh.adopt(await old.release())

    async def run(self, op: Op, root: Path) -> Any:
        # Each call asks the current client: one started on a closed client fails at once.
        client = self.current()
        if op.kind == "shell":
            return await client.run(command=f"echo {op.token} >> {root}/log")
        if op.kind == "slow_shell":
            return await client.run(command=f"sleep 0.2; echo {op.token} >> {root}/log")
        if op.kind == "append_file":
            path = f"{root}/{op.token}"
            return await client.write_file(path, op.token.encode(), atomic=False, append=True)
        return await client.echo(op.token.encode())


def effects(root: Path, op: Op) -> int:
    """How many times ``op``'s side effect happened (echo has none: 0)."""
    if op.kind in ("shell", "slow_shell"):
        log = root / "log"
        lines = log.read_text().split() if log.exists() else []
        return lines.count(op.token)
    if op.kind == "append_file":
        path = root / op.token
        return path.read_text().count(op.token) if path.exists() else 0
    return 0


async def scenario(
    execd: RunningExecd, root: Path, ops: list[Op], cuts: list[Cut], concurrent: bool
) -> None:
    proxy = await CutProxy(execd.host, execd.port).start()
    driver = Driver(execd, proxy, cuts)
    try:
        driver.client = await driver.connect()
        outcomes: list[Any] = []
        if concurrent:
            runs = [asyncio.wait_for(driver.run(op, root), 40) for op in ops]
            outcomes = list(await asyncio.gather(*runs, return_exceptions=True))
        for op in [] if concurrent else ops:
            try:
                outcomes.append(await asyncio.wait_for(driver.run(op, root), 40))
            except (harnessd.HarnessError, OSError) as exc:
                outcomes.append(exc)
                # A call that failed because the connection was gone: wait for the new one.
                if driver.current().closed:
                    await asyncio.wait_for(reconnected(driver), 40)
        event(f"cuts: {proxy.cuts}")
        for outcome in outcomes:
            event(f"outcome: {type(outcome).__name__}")
        for op, outcome in zip(ops, outcomes, strict=True):
            count = effects(root, op)
            assert count <= 1, f"{op} happened {count} times"
            if isinstance(outcome, BaseException):
                assert isinstance(outcome, harnessd.HarnessError), repr(outcome)
            else:
                if op.kind == "echo":
                    assert outcome == op.token.encode()
                else:
                    assert count == 1, f"{op} reported success but did not happen"
                if op.kind in ("shell", "slow_shell"):
                    assert outcome.exit_code == 0
    finally:
        await driver.reconnector.stop()
        if driver.client is not None:
            await driver.client.close()
        await proxy.close()


async def reconnected(driver: Driver) -> None:
    while driver.current().closed:
        driver.reconnector.lost()
        await asyncio.sleep(0.02)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=ops_strategy, cuts=cuts_strategy, concurrent=st.booleans())
def test_random_cuts_never_run_a_call_twice_and_success_means_done(
    shared_execd: RunningExecd,
    tmp_path_factory: pytest.TempPathFactory,
    ops: list[Op],
    cuts: list[Cut],
    concurrent: bool,
) -> None:
    root = tmp_path_factory.mktemp("cuts")
    asyncio.run(scenario(shared_execd, root, ops, cuts, concurrent))
