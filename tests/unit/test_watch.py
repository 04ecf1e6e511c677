"""execd.watch: subscriptions and path waits on real inotify in tmp_path."""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from execd.config import Config
from execd.errors import (
    InvalidPath,
    LimitExceeded,
    NoSuchWatch,
    NotFound,
    OperationTimeout,
    ShuttingDown,
)
from execd.watch import WatchCapability
from protocol.rpc.watch import (
    Condition,
    SubscribeParams,
    UnsubscribeParams,
    WaitForPathParams,
    WatchEvent,
)
from tests.conftest import eventually
from tests.support.capabilities import limits_for
from tests.support.local_ctx import LocalContext

T = TypeVar("T")
Pushed = tuple[int, str, Any]
REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.anyio


@pytest.fixture
async def cap(request: pytest.FixtureRequest) -> AsyncIterator[WatchCapability]:
    """A watch capability (limits from a ``limits`` mark), closed after the test."""
    cap = WatchCapability(Config(limits=limits_for(request)))
    try:
        yield cap
    finally:
        await cap.close()


def watched_inodes(cap: WatchCapability) -> list[int]:
    """The inodes the kernel lists as watched on the capability's descriptor (none if closed)."""
    fd = cap.hub.fileno()
    if fd is None:
        return []
    with open(f"/proc/self/fdinfo/{fd}") as info:
        lines = [line.split() for line in info if line.startswith("inotify wd:")]
    return [int(field[4:], 16) for fields in lines for field in fields if field.startswith("ino:")]


def kernel_watches(cap: WatchCapability) -> int:
    """Watches the kernel lists on the capability's inotify descriptor (0 if closed)."""
    return len(watched_inodes(cap))


def watching(cap: WatchCapability, path: Path) -> bool:
    """Whether the kernel watches ``path`` for the capability (a waiter has armed there)."""
    return os.stat(path).st_ino in watched_inodes(cap)


async def until(
    ctx: LocalContext, done: Callable[[list[Pushed]], bool], timeout: float = 10.0
) -> list[Pushed]:
    """Collect pushed events until ``done(collected)``; fail after ``timeout``."""
    got: list[Pushed] = []
    async with asyncio.timeout(timeout):
        while not done(got):
            got.append(await ctx.event_queue.get())
    return got


async def until_kind(ctx: LocalContext, kind: str, path: str | None = None) -> list[Pushed]:
    def done(got: list[Pushed]) -> bool:
        return any(n == kind and (path is None or d.path == path) for _, n, d in got)

    return await until(ctx, done)


_SENTINEL = ".settled-"
_sentinels = itertools.count()


async def settled(
    ctx: LocalContext,
    directory: Path,
    kind: str = "closed_write",
    *,
    reported_in: Path | None = None,
) -> list[Pushed]:
    """Every event ``ctx`` gets before the ``kind`` event of a file made in ``directory`` now.

    A subscription pushes events in the order the kernel reported their
    causes, so once the sentinel's event is in, nothing caused before it is
    still on its way: the end of a burst is an event, not a quiet period.
    (A rename out of the watch is the exception: it is reported once the hub
    gives up pairing it; wait for it by name.) ``reported_in`` is the
    directory the subscription names for ``directory`` (the link it followed,
    say). Events about any sentinel are left out.
    """
    name = f"{_SENTINEL}{next(_sentinels)}"
    sentinel = directory / name
    sentinel.write_text("")
    if kind == "deleted":
        sentinel.unlink()
    got = await until_kind(ctx, kind, str((reported_in or directory) / name))
    return [event for event in got if _SENTINEL not in os.path.basename(event[2].path)]


def view(events: list[Pushed]) -> list[tuple[Any, ...]]:
    """(kind, path, is_dir[, from, to]) per event, for comparisons."""
    out: list[tuple[Any, ...]] = []
    for _, kind, data in events:
        assert isinstance(data, WatchEvent)
        if kind == "moved":
            out.append((kind, data.path, data.is_dir, data.from_path, data.to_path))
        else:
            out.append((kind, data.path, data.is_dir))
    return out


def assert_in_order(actual: list[tuple[Any, ...]], expected: list[tuple[Any, ...]]) -> None:
    position = 0
    for item in actual:
        if position < len(expected) and item == expected[position]:
            position += 1
    assert position == len(expected), f"missing {expected[position]} in {actual}"


async def subscribe(
    cap: WatchCapability, ctx: LocalContext, path: Path | str, **options: Any
) -> int:
    result = await cap.watch_subscribe(SubscribeParams(path=str(path), **options), ctx)
    return result.watch_id


# -- event kinds --------------------------------------------------------------------------


async def test_every_event_kind_with_is_dir(cap: WatchCapability, tmp_path: Path) -> None:
    ctx = LocalContext()
    watch_id = await subscribe(cap, ctx, tmp_path)
    f, g, sub, sub2 = (str(tmp_path / n) for n in ("f", "g", "sub", "sub2"))
    with open(f, "w") as handle:
        handle.write("data")
    os.chmod(f, 0o600)
    os.rename(f, g)
    os.mkdir(sub)
    os.chmod(sub, 0o700)
    os.rename(sub, sub2)
    os.unlink(g)
    os.rmdir(sub2)
    got = await until_kind(ctx, "deleted", sub2)
    assert {topic for topic, _, _ in got} == {watch_id}
    assert_in_order(
        view(got),
        [
            ("created", f, False),
            ("modified", f, False),
            ("closed_write", f, False),
            ("attrib", f, False),
            ("moved", g, False, f, g),
            ("created", sub, True),
            ("attrib", sub, True),
            ("moved", sub2, True, sub, sub2),
            ("deleted", g, False),
            ("deleted", sub2, True),
        ],
    )


async def test_moves_with_one_side_outside_the_watch(cap: WatchCapability, tmp_path: Path) -> None:
    watched, outside = tmp_path / "watched", tmp_path / "outside"
    watched.mkdir()
    outside.mkdir()
    (watched / "leaving").write_text("")
    (outside / "arriving").mkdir()
    ctx = LocalContext()
    await subscribe(cap, ctx, watched)
    os.rename(watched / "leaving", outside / "leaving")
    got = await until_kind(ctx, "moved")
    assert view(got)[-1] == (
        "moved",
        str(watched / "leaving"),
        False,
        str(watched / "leaving"),
        None,
    )
    os.rename(outside / "arriving", watched / "arrived")
    got = await until_kind(ctx, "moved")
    arrived = str(watched / "arrived")
    assert view(got)[-1] == ("moved", arrived, True, None, arrived)


async def test_single_file_root_and_symlink_follow(cap: WatchCapability, tmp_path: Path) -> None:
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    single = tmp_path / "single.txt"
    single.write_text("")
    followed, unfollowed, file_ctx = LocalContext(), LocalContext(), LocalContext()
    await subscribe(cap, followed, link)
    await subscribe(cap, unfollowed, link, follow=False)
    await subscribe(cap, file_ctx, single)
    (target / "x").write_text("")
    got = await until_kind(followed, "closed_write")
    assert view(got)[0] == ("created", str(link / "x"), False)
    with open(single, "a") as handle:
        handle.write("more")
    got = await until_kind(file_ctx, "closed_write")
    assert ("modified", str(single), False) in view(got)
    link.unlink()
    got = await until_kind(unfollowed, "ended")
    assert [n for _, n, _ in got][-2:] == ["root_deleted", "ended"]
    assert await settled(followed, target, reported_in=link) == []


# -- recursive watches -------------------------------------------------------------------


async def test_recursive_watch_picks_up_new_directories(
    cap: WatchCapability, tmp_path: Path
) -> None:
    (tmp_path / "old" / "deep").mkdir(parents=True)
    ctx = LocalContext()
    result = await cap.watch_subscribe(SubscribeParams(path=str(tmp_path), recursive=True), ctx)
    assert result.watched == 3
    (tmp_path / "old" / "deep" / "a").write_text("")
    await until_kind(ctx, "closed_write", str(tmp_path / "old" / "deep" / "a"))

    new = tmp_path / "new"
    new.mkdir()
    await until_kind(ctx, "created", str(new))
    (new / "f").write_text("x")
    await until_kind(ctx, "closed_write", str(new / "f"))

    # created in one go: inner entries exist before their directory is watched
    (tmp_path / "x" / "y" / "z").mkdir(parents=True)
    (tmp_path / "x" / "y" / "z" / "file").write_text("x")
    last = str(tmp_path / "x" / "y" / "z" / "file")
    got = await until_kind(ctx, "created", last)
    got += await settled(ctx, tmp_path)
    created = [d.path for _, n, d in got if n == "created"]
    expected = [
        str(tmp_path / "x"),
        str(tmp_path / "x" / "y"),
        str(tmp_path / "x" / "y" / "z"),
        last,
    ]
    assert sorted(created) == sorted(expected)  # each exactly once
    (tmp_path / "x" / "y" / "z" / "later").write_text("")
    await until_kind(ctx, "created", str(tmp_path / "x" / "y" / "z" / "later"))


async def test_recursive_moves_keep_and_drop_watches(cap: WatchCapability, tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a" / "inner").mkdir(parents=True)
    (outside / "tree" / "sub").mkdir(parents=True)
    (outside / "tree" / "sub" / "file").write_text("")
    ctx = LocalContext()
    await subscribe(cap, ctx, root, recursive=True)
    os.rename(root / "a", root / "b")
    await until_kind(ctx, "moved")
    (root / "b" / "inner" / "f").write_text("")
    await until_kind(ctx, "created", str(root / "b" / "inner" / "f"))

    os.rename(outside / "tree", root / "tree")
    got = await until_kind(ctx, "created", str(root / "tree" / "sub" / "file"))
    assert ("moved", str(root / "tree"), True, None, str(root / "tree")) in view(got)
    (root / "tree" / "sub" / "new").write_text("")
    await until_kind(ctx, "created", str(root / "tree" / "sub" / "new"))

    before = kernel_watches(cap)
    os.rename(root / "b", outside / "b")
    await until_kind(ctx, "moved", str(root / "b"))
    assert kernel_watches(cap) == before - 2
    (outside / "b" / "inner" / "g").write_text("")
    assert await settled(ctx, root) == []


# -- filters and debounce ---------------------------------------------------------------


async def test_event_filter(cap: WatchCapability, tmp_path: Path) -> None:
    ctx = LocalContext()
    await subscribe(cap, ctx, tmp_path, events=["deleted"])
    f = tmp_path / "f"
    f.write_text("x")
    os.chmod(f, 0o600)
    f.unlink()
    got = await until_kind(ctx, "deleted")
    got += await settled(ctx, tmp_path, "deleted")
    assert view(got) == [("deleted", str(f), False)]


async def test_debounce_coalesces_a_burst(cap: WatchCapability, tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("")
    plain, debounced = LocalContext(), LocalContext()
    kinds = ["modified", "closed_write"]
    await subscribe(cap, plain, tmp_path, events=kinds)
    await subscribe(cap, debounced, tmp_path, events=kinds, debounce=0.5)
    for _ in range(20):
        with open(f, "a") as handle:
            handle.write("x")
    got = await until_kind(debounced, "closed_write")
    got += await settled(debounced, tmp_path)
    assert [(n, d.count) for _, n, d in got] == [("modified", 20), ("closed_write", 20)]
    raw = await until(plain, lambda g: len(g) >= 40)
    assert sum(1 for _, n, _ in raw if n == "closed_write") == 20


async def test_debounce_keeps_structural_order(cap: WatchCapability, tmp_path: Path) -> None:
    ctx = LocalContext()
    await subscribe(cap, ctx, tmp_path, events=["created", "deleted"], debounce=0.3)
    f = tmp_path / "f"
    for _ in range(2):
        f.write_text("")
        f.unlink()
    f.write_text("")
    got = await until(ctx, lambda g: len(g) >= 5)
    got += await settled(ctx, tmp_path, "created")
    assert [n for _, n, _ in got] == ["created", "deleted", "created", "deleted", "created"]


# -- explicit ends and losses -----------------------------------------------------------


async def test_root_deleted_then_ended(cap: WatchCapability, tmp_path: Path) -> None:
    deleted_root, moved_root = tmp_path / "deleted", tmp_path / "moved"
    (deleted_root / "sub").mkdir(parents=True)
    (deleted_root / "sub" / "f").write_text("")
    moved_root.mkdir()
    one, two = LocalContext(), LocalContext()
    first = await subscribe(cap, one, deleted_root, recursive=True)
    await subscribe(cap, two, moved_root)
    shutil.rmtree(deleted_root)
    got = await until_kind(one, "ended")
    tail = [(n, d.reason, d.path) for _, n, d in got[-2:]]
    assert tail == [
        ("root_deleted", "deleted", str(deleted_root)),
        ("ended", "root_deleted", str(deleted_root)),
    ]
    assert ("deleted", str(deleted_root / "sub"), True) in view(got)
    os.rename(moved_root, tmp_path / "elsewhere")
    got = await until_kind(two, "ended")
    assert [(n, d.reason) for _, n, d in got] == [
        ("root_deleted", "moved"),
        ("ended", "root_deleted"),
    ]
    assert kernel_watches(cap) == 0
    with pytest.raises(NoSuchWatch):
        await cap.watch_unsubscribe(UnsubscribeParams(watch_id=first), one)


@pytest.mark.limits(watch_queue=4)
async def test_full_subscriber_queue_reports_dropped_count(
    cap: WatchCapability, tmp_path: Path
) -> None:
    ctx = LocalContext()
    await subscribe(cap, ctx, tmp_path)
    for i in range(40):  # no await: all 40 land in one read
        os.mkdir(tmp_path / f"d{i}")
    got = await until_kind(ctx, "overflow")
    got += await settled(ctx, tmp_path, "created")
    overflows = [d for _, n, d in got if n == "overflow"]
    assert len(overflows) == 1
    assert overflows[0].source == "queue"
    created = sum(1 for _, n, _ in got if n == "created")
    assert overflows[0].dropped > 0
    assert created + overflows[0].dropped == 40
    os.mkdir(tmp_path / "after")
    await until_kind(ctx, "created", str(tmp_path / "after"))
    await cap.close()


@contextmanager
def sysctl(path: str, value: int) -> Iterator[None]:
    """Set a /proc/sys value, restoring the old one on exit.

    An exclusive lock serialises test processes running at once, so none
    saves another's lowered value as the one to restore.
    """
    with open("/tmp/execd-tests-sysctl.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(path) as current:
            old = current.read().strip()
        with open(path, "w") as knob:
            knob.write(str(value))
        try:
            yield
        finally:
            with open(path, "w") as knob:
                knob.write(old)


async def test_kernel_queue_overflow(cap: WatchCapability, tmp_path: Path) -> None:
    knob = "/proc/sys/fs/inotify/max_queued_events"
    if os.geteuid() != 0 or not os.access(knob, os.W_OK):
        pytest.skip("lowering fs.inotify.max_queued_events needs root")
    one, two = LocalContext(), LocalContext()
    (tmp_path / "other").mkdir()
    # the limit is read when the descriptor is created, by the first subscribe
    with sysctl(knob, 8):
        await subscribe(cap, one, tmp_path, recursive=True)
    await subscribe(cap, two, tmp_path / "other")
    for i in range(64):
        os.mkdir(tmp_path / f"d{i}")
    got = await until_kind(one, "overflow")
    assert [d.source for _, n, d in got if n == "overflow"] == ["kernel"]
    got = await until_kind(two, "overflow")
    assert [d.source for _, n, d in got if n == "overflow"] == ["kernel"]
    # the recursive watch re-learned its tree (on the overflow, before it was
    # reported): a directory whose creation was lost is watched now
    (tmp_path / "d63" / "inside").write_text("")
    await until_kind(one, "created", str(tmp_path / "d63" / "inside"))


LIMIT_CHILD = textwrap.dedent(
    """
    import asyncio, ctypes, json, os, sys
    from pathlib import Path

    CLONE_NEWUSER = 0x10000000
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER) != 0:
        print(json.dumps({"skip": "user namespaces unavailable: " + os.strerror(ctypes.get_errno())}))
        sys.exit(0)
    try:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
        with open("/proc/sys/user/max_inotify_watches", "w") as f:
            f.write("3")
    except OSError as exc:
        print(json.dumps({"skip": f"cannot lower the namespace watch limit: {exc}"}))
        sys.exit(0)

    from execd.config import Config
    from execd.errors import WatchLimit
    from execd.watch import WatchCapability
    from protocol.rpc.watch import SubscribeParams
    from tests.support.local_ctx import LocalContext

    async def main():
        base = Path(sys.argv[1])
        big, small = base / "big", base / "small"
        for i in range(6):
            (big / f"d{i}").mkdir(parents=True)
        (small / "d0").mkdir(parents=True)
        cap, ctx = WatchCapability(Config()), LocalContext()
        out = {}
        try:
            await cap.watch_subscribe(SubscribeParams(path=str(big), recursive=True), ctx)
            out["subscribe"] = "ok"
        except WatchLimit as exc:
            out["subscribe"] = ["WatchLimit", int(exc.code), exc.data]
        out["after_failure"] = cap.hub.fileno()
        await cap.watch_subscribe(SubscribeParams(path=str(small), recursive=True), ctx)
        for i in range(1, 4):
            (small / f"d{i}").mkdir()
        seen = []
        async with asyncio.timeout(10):
            while not any(n == "watch_limit" for n, _ in seen):
                _, name, data = await ctx.event_queue.get()
                seen.append((name, data.path))
        out["events"] = seen
        await cap.close()
        print(json.dumps(out))

    asyncio.run(main())
    """
)


def test_watch_limit_at_subscribe_and_later(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-c", LIMIT_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["subscribe"][:2] == ["WatchLimit", 501]
    assert out["subscribe"][2]["errno"] == "ENOSPC"
    assert out["after_failure"] is None  # the failed subscribe released every watch
    small = tmp_path / "small"
    assert ["watch_limit", str(small / "d2")] in out["events"] or [
        "watch_limit",
        str(small / "d3"),
    ] in out["events"]
    assert ["created", str(small / "d1")] in out["events"]


# -- wait_for_path -----------------------------------------------------------------------


async def test_wait_for_path_whose_parents_do_not_exist_yet(
    cap: WatchCapability, tmp_path: Path
) -> None:
    target = tmp_path / "a" / "b" / "c" / "ready"
    waiting = asyncio.create_task(
        cap.watch_wait_for_path(WaitForPathParams(path=str(target), timeout=20), LocalContext())
    )
    # Each step waits until the waiter watches the nearest existing ancestor.
    await eventually(lambda: watching(cap, tmp_path))
    (tmp_path / "a" / "b").mkdir(parents=True)
    await eventually(lambda: watching(cap, tmp_path / "a" / "b"))
    assert not waiting.done()
    (tmp_path / "a" / "b" / "c").mkdir()
    await eventually(lambda: watching(cap, tmp_path / "a" / "b" / "c"))
    assert not waiting.done()
    target.write_text("")
    result = await asyncio.wait_for(waiting, 10)
    assert result.met is True and result.waited > 0
    assert kernel_watches(cap) == 0 and cap.hub.fileno() is None


async def test_wait_for_path_timeout_and_immediate(cap: WatchCapability, tmp_path: Path) -> None:
    ctx = LocalContext()
    missing = str(tmp_path / "never")
    with pytest.raises(OperationTimeout) as timed_out:
        await cap.watch_wait_for_path(WaitForPathParams(path=missing, timeout=0.2), ctx)
    assert timed_out.value.data["path"] == missing
    with pytest.raises(OperationTimeout):
        await cap.watch_wait_for_path(WaitForPathParams(path=missing, timeout=0), ctx)
    result = await cap.watch_wait_for_path(
        WaitForPathParams(path=str(tmp_path), condition="dir", timeout=0), ctx
    )
    assert result.met and result.waited < 1
    assert kernel_watches(cap) == 0


async def met_after(
    cap: WatchCapability,
    path: Path,
    condition: Condition,
    armed_at: Path,
    change: Callable[[], object],
) -> None:
    """``wait_for_path`` waits (armed at ``armed_at``) until ``change()`` makes ``condition`` true."""
    params = WaitForPathParams(path=str(path), condition=condition)
    waiting = asyncio.create_task(cap.watch_wait_for_path(params, LocalContext()))
    await eventually(lambda: watching(cap, armed_at), what=f"a watch on {armed_at}")
    assert not waiting.done()
    change()
    assert (await asyncio.wait_for(waiting, 10)).met


def append(path: Path, text: str) -> None:
    with open(path, "a") as handle:
        handle.write(text)


def replace_by_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


async def test_wait_for_path_absent_and_ancestor_rename(
    cap: WatchCapability, tmp_path: Path
) -> None:
    doomed = tmp_path / "doomed"
    doomed.write_text("")
    await met_after(cap, doomed, "absent", tmp_path, doomed.unlink)
    deep = tmp_path / "top" / "mid" / "leaf"
    deep.mkdir(parents=True)
    renamed = tmp_path / "renamed"
    await met_after(cap, deep, "absent", deep.parent, lambda: (tmp_path / "top").rename(renamed))


async def test_wait_for_path_type_and_nonempty(cap: WatchCapability, tmp_path: Path) -> None:
    log, out, slot = tmp_path / "log", tmp_path / "out", tmp_path / "slot"
    log.write_text("")
    await met_after(cap, log, "nonempty", log, lambda: append(log, "line\n"))
    out.mkdir()
    await met_after(cap, out, "nonempty", out, (out / "part").mkdir)
    slot.write_text("")
    await met_after(cap, slot, "dir", tmp_path, lambda: replace_by_directory(slot))


# -- lifecycle ---------------------------------------------------------------------------


async def test_unsubscribe_stops_events(cap: WatchCapability, tmp_path: Path) -> None:
    ctx = LocalContext()
    watch_id = await subscribe(cap, ctx, tmp_path)
    (tmp_path / "one").write_text("")
    await until_kind(ctx, "closed_write")
    result = await cap.watch_unsubscribe(UnsubscribeParams(watch_id=watch_id), ctx)
    assert result.watch_id == watch_id
    got = await until_kind(ctx, "ended")
    assert got[-1][2].reason == "unsubscribed"
    # Nothing is watched any more: no change can reach the subscription.
    assert kernel_watches(cap) == 0
    (tmp_path / "two").write_text("")
    assert ctx.event_queue.empty()
    with pytest.raises(NoSuchWatch):
        await cap.watch_unsubscribe(UnsubscribeParams(watch_id=watch_id), ctx)


async def test_shared_watch_descriptor_is_refcounted(cap: WatchCapability, tmp_path: Path) -> None:
    ctx = LocalContext()
    first = await subscribe(cap, ctx, tmp_path)
    second = await subscribe(cap, ctx, tmp_path, events=["created"])
    assert kernel_watches(cap) == 1
    await cap.watch_unsubscribe(UnsubscribeParams(watch_id=first), ctx)
    assert kernel_watches(cap) == 1
    await until_kind(ctx, "ended")
    (tmp_path / "f").write_text("")
    got = await until_kind(ctx, "created")
    assert {topic for topic, _, _ in got} == {second}
    await cap.watch_unsubscribe(UnsubscribeParams(watch_id=second), ctx)
    assert kernel_watches(cap) == 0 and cap.hub.fileno() is None


async def test_connection_close_removes_its_watches(cap: WatchCapability, tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    closing, staying = LocalContext(), LocalContext()
    await subscribe(cap, closing, tmp_path / "a")
    await subscribe(cap, closing, tmp_path / "b", recursive=True)
    await subscribe(cap, staying, tmp_path / "c")
    assert kernel_watches(cap) == 3
    await closing.close()
    assert kernel_watches(cap) == 1
    assert cap.subscriptions(closing.connection_id) == []
    (tmp_path / "c" / "f").write_text("")
    await until_kind(staying, "created")
    await staying.close()
    assert kernel_watches(cap) == 0


@pytest.mark.limits(max_watches=2)
async def test_limits_and_typed_errors(cap: WatchCapability, tmp_path: Path) -> None:
    ctx = LocalContext()
    await subscribe(cap, ctx, tmp_path)
    await subscribe(cap, ctx, tmp_path)
    with pytest.raises(LimitExceeded):
        await subscribe(cap, ctx, tmp_path)
    other = LocalContext()
    with pytest.raises(NotFound):
        await subscribe(cap, other, tmp_path / "missing")
    with pytest.raises(InvalidPath):
        await subscribe(cap, other, "bad\0path")
    assert cap.subscriptions(other.connection_id) == []
    await subscribe(cap, other, tmp_path)


async def test_close_ends_subscriptions_and_waits(cap: WatchCapability, tmp_path: Path) -> None:
    ctx = LocalContext()
    await subscribe(cap, ctx, tmp_path)
    waiting = asyncio.create_task(
        cap.watch_wait_for_path(WaitForPathParams(path=str(tmp_path / "never")), ctx)
    )
    await eventually(lambda: watching(cap, tmp_path))
    await cap.close()
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(waiting, 10)
    got = await until_kind(ctx, "ended")
    assert got[-1][2].reason == "shutdown"
    assert cap.hub.fileno() is None
    with pytest.raises(ShuttingDown):
        await subscribe(cap, ctx, tmp_path)
