"""``harnessd gc``: it removes what is ours and unused, and nothing else.

Each test makes leftovers of the shapes harnessd leaves in a directory of its
own and points the command (or :func:`harnessd.leftovers.collect`) at it.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest

from harnessd.leftovers import Found, Hold, collect
from tests.support import cli

pytestmark = pytest.mark.timeout(60)


def _launcher_dir(parent: Path, name: str = "execd-0123456789abcdef") -> Path:
    directory = parent / name
    directory.mkdir(mode=0o700)
    (directory / "execd-0123456789ab.log").write_text('{"event": "exited", "code": 0}\n')
    (directory / "state-0123456789ab").mkdir()
    (directory / "state-0123456789ab" / "ledger").mkdir()
    return directory


def _by_path(found: list[Found]) -> dict[str, Found]:
    return {f.path: f for f in found}


def test_gc_removes_what_sessions_left_and_says_so(tmp_path: Path) -> None:
    launcher = _launcher_dir(tmp_path)
    run = tmp_path / "harnessd-run-ab_c1234"
    (run / "app").mkdir(parents=True, mode=0o700)
    rollout = tmp_path / "rollout-zz9_8765"
    for part in ("ws", "execd", "state"):
        (rollout / part).mkdir(parents=True, mode=0o700)
    rollout.chmod(0o700)
    unrelated = tmp_path / "execd-notes"
    unrelated.mkdir()
    done = cli.run("harnessd", "gc", "--dir", str(tmp_path), "--older-than", "0")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for path, kind in [
        (launcher, "launcher directory"),
        (run, "run workspace"),
        (rollout, "rollout directory"),
    ]:
        assert f"removed {path} ({kind})" in lines
        assert not path.exists()
    assert unrelated.exists()
    assert str(unrelated) not in done.stdout


def test_a_dry_run_removes_nothing(tmp_path: Path) -> None:
    launcher = _launcher_dir(tmp_path)
    done = cli.run("harnessd", "gc", "--dir", str(tmp_path), "--older-than", "0", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert f"would remove {launcher} (launcher directory)" in done.stdout.splitlines()
    assert launcher.exists()


def test_what_is_in_use_or_new_stays(tmp_path: Path) -> None:
    # execd and its supervisor hold their log open while they live.
    live = _launcher_dir(tmp_path)
    log = next(live.glob("*.log"))
    with open(log, "ab") as handle:
        holder = subprocess.Popen(["sleep", "60"], stdout=handle)
    try:
        # A run's workspace is held by its harnessd (here: by this process).
        held = Hold("harnessd-run-", str(tmp_path))
        try:
            found = _by_path(collect([str(tmp_path)], older_than=0))
            assert os.path.exists(held.path)
            assert found[held.path].why == "held by its owner"
        finally:
            held.remove()
        assert found[str(live)].why == f"in use by process {holder.pid}"
        assert live.exists()
    finally:
        holder.kill()
        holder.wait()
    young = _by_path(collect([str(tmp_path)]))
    assert young[str(live)].why == "changed too recently"
    assert live.exists()
    assert _by_path(collect([str(tmp_path)], older_than=0))[str(live)].removed
    assert not live.exists()


def test_links_are_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    search = tmp_path / "search"
    search.mkdir()
    # A link with a leftover's name, and a leftover with a link inside.
    (search / "harnessd-run-link0000").symlink_to(victim)
    inside = search / "harnessd-run-inside00"
    inside.mkdir(mode=0o700)
    (inside / "escape").symlink_to(victim)
    found = _by_path(collect([str(search)], older_than=0))
    assert not found[str(search / "harnessd-run-link0000")].removed
    assert found[str(inside)].removed
    assert (victim / "precious").read_text() == "keep me"
    assert (search / "harnessd-run-link0000").is_symlink()


def test_only_the_shapes_harnessd_makes_go(tmp_path: Path) -> None:
    odd = tmp_path / "execd-fedcba9876543210"
    odd.mkdir(mode=0o700)
    (odd / "thesis.tex").write_text("not a log")
    shared = _launcher_dir(tmp_path, "execd-aaaaaaaaaaaaaaaa")
    shared.chmod(0o777)
    found = _by_path(collect([str(tmp_path)], older_than=0))
    assert found[str(odd)].why == "its content is not that of a launcher directory"
    assert found[str(shared)].why == "others may write it"
    assert odd.exists() and shared.exists()


def test_a_directory_others_may_rename_in_is_not_searched(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # writable by all, not sticky
    launcher = _launcher_dir(open_dir)
    (found,) = collect([str(open_dir)], older_than=0)
    assert not found.removed and "not sticky" in found.why
    assert launcher.exists()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_root_leaves_other_users_directories_alone(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    theirs = _launcher_dir(tmp_path)
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    (found,) = collect([str(tmp_path)], older_than=0)
    assert found.why == "belongs to another user"
    assert theirs.exists()


def test_gc_is_listed_in_harnessd_help() -> None:
    done = cli.run("harnessd", "--help")
    assert "gc" in done.stdout
    done = cli.run("harnessd", "gc", "--help")
    assert done.returncode == 0 and "--dry-run" in done.stdout
