"""Keepalive groups: one timer per loop and interval, members spread over slots, clean leaving."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from harnessd import keepalive

pytestmark = pytest.mark.timeout(60)

INTERVAL = 0.05


class Member:
    """Counts its ticks; can be told to finish or to fail."""

    def __init__(self) -> None:
        self.ticks = 0
        self.finish = False
        self.fail = False
        self.ticked = asyncio.Event()

    def __call__(self) -> bool:
        self.ticks += 1
        self.ticked.set()
        if self.fail:
            raise RuntimeError("boom")
        return not self.finish

    async def wait_ticks(self, count: int) -> None:
        while self.ticks < count:
            self.ticked.clear()
            await asyncio.wait_for(self.ticked.wait(), 20)


def groups() -> dict[float, keepalive._Group]:
    return keepalive._groups.get(asyncio.get_running_loop(), {})


def test_members_of_one_interval_share_one_group_spread_over_the_slots() -> None:
    async def main() -> None:
        members = [Member() for _ in range(5 * keepalive.SLOTS)]
        memberships = [keepalive.join(INTERVAL, m) for m in members]
        other = Member()
        other_membership = keepalive.join(INTERVAL * 2, other)
        assert set(groups()) == {INTERVAL, INTERVAL * 2}
        group = groups()[INTERVAL]
        assert Counter(len(slot) for slot in group.slots) == {5: keepalive.SLOTS}
        await asyncio.gather(*(m.wait_ticks(3) for m in members), other.wait_ticks(2))
        for membership in (*memberships, other_membership):
            membership.leave()
        assert groups() == {}
        assert group.timer is None

    asyncio.run(main())


def test_every_member_ticks_once_per_round_of_the_slots() -> None:
    """However the slots fire, no member is served twice before all were served once."""

    async def main() -> None:
        members = [Member() for _ in range(40)]
        memberships = [keepalive.join(INTERVAL, m) for m in members]
        for round_ in range(1, 4):
            await asyncio.gather(*(m.wait_ticks(round_) for m in members))
            assert max(m.ticks for m in members) <= round_ + 1
        for membership in memberships:
            membership.leave()

    asyncio.run(main())


def test_a_member_that_finishes_or_fails_leaves_and_the_others_go_on() -> None:
    async def main() -> None:
        done, broken, steady = Member(), Member(), Member()
        done.finish = True
        broken.fail = True
        memberships = [keepalive.join(INTERVAL, m) for m in (done, broken, steady)]
        await asyncio.gather(done.wait_ticks(1), broken.wait_ticks(1))
        await steady.wait_ticks(steady.ticks + 3)
        assert (done.ticks, broken.ticks) == (1, 1)
        assert groups()[INTERVAL].size == 1
        memberships[2].leave()
        memberships[2].leave()  # idempotent
        memberships[0].leave()  # already gone: nothing happens
        assert groups() == {}

    asyncio.run(main())


def test_a_member_that_left_is_not_called_again_and_a_new_group_starts_afresh() -> None:
    async def main() -> None:
        first, second = Member(), Member()
        membership = keepalive.join(INTERVAL, first)
        await first.wait_ticks(2)
        membership.leave()
        seen = first.ticks
        again = keepalive.join(INTERVAL, second)
        await second.wait_ticks(3)
        assert first.ticks == seen
        again.leave()

    asyncio.run(main())


def test_the_interval_must_be_positive() -> None:
    async def main() -> None:
        with pytest.raises(ValueError):
            keepalive.join(0.0, Member())

    asyncio.run(main())
