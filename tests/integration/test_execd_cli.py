"""execd's command line: every startup mistake is one line naming what is wrong, and a
state directory that cannot be created falls back to a private one it announces."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import cli
from tests.support.worker_env import WorkerPythonUnavailable, make_package_dir, prepare

pytestmark = pytest.mark.timeout(120)


def _execd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return cli.run("execd", *args, env={"EXECD_TOKEN": "t" * 64, **(env or {})})


def _events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _refused(done: subprocess.CompletedProcess[str], status: int, *named: str) -> None:
    assert done.returncode == status, done.stderr
    line = cli.one_line(done.stderr, "execd")
    for text in named:
        assert text in line
    last = _events(done.stdout)[-1]
    assert last["event"] == "exited" and last["code"] == status and last["error"]


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--port", "70000"),
        ("--port", "-1"),
        ("--port", "4464x"),
        ("--lease", "-1"),
        ("--lease", "0"),
        ("--lease", "inf"),
        ("--log-level", "LOUD"),
    ],
)
def test_a_bad_option_value_is_a_usage_error(option: str, value: str) -> None:
    _refused(_execd(option, value), 2, option, repr(value))


def test_token_file_mistakes_name_the_file(tmp_path: Path) -> None:
    for path, why in cli.token_file_mistakes(tmp_path):
        _refused(_execd("--token-file", str(path)), 2, str(path), why)


def test_a_state_dir_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    wanted = blocker / "state"
    _refused(_execd("--state-dir", str(wanted)), 1, str(wanted))


def test_a_port_in_use_is_named(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _execd("--port", str(port), "--state-dir", str(tmp_path / "state"))
    _refused(done, 1, f"127.0.0.1:{port}")


def _fallback_env(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    env = {"HOME": str(home), "XDG_STATE_HOME": "", "TMPDIR": str(temp)}
    return env, home, temp


def _listening(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr
    events = _events(done.stdout)
    assert events[0]["event"] == "listening", done.stdout
    return events[0]


def test_an_unusable_default_state_dir_falls_back_to_a_private_temp_dir(tmp_path: Path) -> None:
    env, home, temp = _fallback_env(tmp_path)
    first = _listening(_execd("--lease", "0.3", env=env))
    private = temp / f"execd-state-{os.getuid()}"
    assert first["state_dir"] == str(private)
    assert str(home) in first["state_dir_fallback"]
    info = private.lstat()
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()
    # The next execd of the same user finds its ledger where it left it.
    assert _listening(_execd("--lease", "0.3", env=env))["state_dir"] == str(private)


def test_a_usable_default_state_dir_is_announced_without_a_fallback(tmp_path: Path) -> None:
    state_home = tmp_path / "xdg"
    event = _listening(_execd("--lease", "0.3", env={"XDG_STATE_HOME": str(state_home)}))
    assert event["state_dir"] == str(state_home / "execd")
    assert "state_dir_fallback" not in event


def test_the_fallback_never_uses_a_name_someone_else_planted(tmp_path: Path) -> None:
    env, _, temp = _fallback_env(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = temp / f"execd-state-{os.getuid()}"
    planted.symlink_to(elsewhere)
    event = _listening(_execd("--lease", "0.3", env=env))
    used = Path(event["state_dir"])
    assert used.parent == temp and used != planted
    assert used.name.startswith(f"execd-state-{os.getuid()}-")
    assert stat.S_IMODE(used.lstat().st_mode) == 0o700
    assert list(elsewhere.iterdir()) == []


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run execd as another user")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is missing")
def test_under_setpriv_with_roots_home_execd_starts_and_says_where_its_state_is(
    tmp_path: Path,
) -> None:
    nobody = 65534
    as_nobody = [
        shutil.which("setpriv") or "setpriv",
        f"--reuid={nobody}",
        f"--regid={nobody}",
        "--clear-groups",
    ]
    package_dir = make_package_dir()
    temp = Path(tmp_path.anchor) / "tmp" / f"sx-setpriv-{os.getpid()}"
    temp.mkdir(mode=0o1777)
    temp.chmod(0o1777)
    try:
        try:
            worker = prepare(as_nobody, package_dir)
        except WorkerPythonUnavailable as exc:
            pytest.skip(str(exc))
        # setpriv keeps root's HOME, which nobody cannot write: the example of docs/runtime.md.
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/root",
            "TMPDIR": str(temp),
            "EXECD_TOKEN": "t" * 64,
            **worker.environment(),
        }
        done = subprocess.run(
            [
                *as_nobody,
                "env",
                "-i",
                *(f"{k}={v}" for k, v in env.items()),
                *worker.execd_command(),
                "--lease",
                "0.3",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd="/",
        )
        event = _listening(done)
        private = temp / f"execd-state-{nobody}"
        assert event["state_dir"] == str(private)
        assert "/root/.local/state/execd" in event["state_dir_fallback"]
        info = private.lstat()
        assert info.st_uid == nobody and stat.S_IMODE(info.st_mode) == 0o700
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(package_dir, ignore_errors=True)
