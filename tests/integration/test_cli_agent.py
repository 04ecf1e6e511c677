"""``harnessd demo`` and ``harnessd run`` as a user runs them: every exit closes the session.

Signals, model failures and mistakes, each against real subprocesses: the
command, the execd it launches, the processes the session starts, and (for
``run``) a model endpoint served on a real socket.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from execd.marker import find_marked
from tests.support import cli
from tests.support.daemon import start_execd

pytestmark = pytest.mark.timeout(120)


def _start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return cli.spawn(tmp_path, "harnessd", *args)


def _wait_marked(marker: str, count: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        found = find_marked("EXECD_MARKER", marker)
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"only {found} carry the marker"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen[str], signum: int, command: str) -> str:
    """Wait for ``command`` ended by ``signum``; check its one stderr line, return its stdout."""
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.wait(timeout=60) == 128 + signum
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert signal.Signals(signum).name in cli.one_line(err, command)
    assert "0 processes left" in out
    return out


def _refused(port: int, timeout: float = 15.0) -> bool:
    """Whether connecting to ``port`` is refused (execd is gone) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            try:
                sock.connect(("127.0.0.1", port))
            except ConnectionRefusedError:
                return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_demo_closes_the_session_on_a_stop_signal(tmp_path: Path, signum: int) -> None:
    proc = _start(tmp_path, "demo", "--script", str(cli.slow_demo_script(tmp_path)))
    assert proc.stdout is not None and proc.stderr is not None
    head = cli.read_until(proc.stdout, "a slow step", time.monotonic() + 60)
    up = re.search(r"execd up at \S+ \(pid (\d+), .*marker ([0-9a-f]+)\)", head)
    workspace = re.search(r"workspace: (\S+)", head)
    assert up is not None and workspace is not None, head
    execd_pid, marker = int(up.group(1)), up.group(2)
    marked = _wait_marked(marker, 2)  # the service and the slow step run
    proc.send_signal(signum)
    _finish(proc, signum, "harnessd demo")
    assert cli.wait_gone([execd_pid, *marked], 15) == []
    assert find_marked("EXECD_MARKER", marker) == []
    assert not Path(workspace.group(1)).exists()


def _run_args(model_port: int, workspace: Path) -> list[str]:
    """``harnessd run`` against the model endpoint on ``model_port`` (a local execd), no progress."""
    base_url = f"http://127.0.0.1:{model_port}/v1"
    return [
        "run",
        "--model",
        "m",
        "--base-url",
        base_url,
        "--task",
        "t",
        "--workspace",
        str(workspace),
        "--quiet",  # stderr: only what the command has to say
    ]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_run_closes_the_session_on_a_stop_signal(tmp_path: Path, signum: int) -> None:
    with cli.foreign_server(None) as model_port:  # a model that never answers
        proc = _start(tmp_path, *_run_args(model_port, tmp_path))
        assert proc.stdout is not None and proc.stderr is not None
        head = cli.read_until(proc.stdout, "ledger session:", time.monotonic() + 60)
        up = re.search(r"execd up at [\d.]+:(\d+) \(marker ([0-9a-f]+)\)", head)
        assert up is not None, head
        port = int(up.group(1))
        proc.send_signal(signum)
        out = _finish(proc, signum, "harnessd run")
    assert _refused(port)
    cli.assert_no_log_kept(head + out)
    assert find_marked("EXECD_MARKER", up.group(2)) == []


def test_run_closes_the_session_after_a_model_error(tmp_path: Path) -> None:
    with cli.foreign_server(cli.HTTP_400) as model_port:
        done = cli.run("harnessd", *_run_args(model_port, tmp_path), env={"TMPDIR": str(tmp_path)})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    up = re.search(r"execd up at [\d.]+:(\d+) \(marker ([0-9a-f]+)\)", done.stdout)
    assert up is not None, done.stdout
    assert "stopped: " in done.stdout
    assert "0 processes left" in done.stdout
    assert _refused(int(up.group(1)))
    # The model failed, not execd: nothing of execd's is kept.
    cli.assert_no_log_kept(done.stdout)


def _model_args(*more: str) -> list[str]:
    return ["run", "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--task", "t", *more]


@pytest.mark.parametrize("command", ["run", "demo"])
def test_a_trace_file_that_cannot_be_written_stops_before_execd_starts(
    tmp_path: Path, command: str
) -> None:
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("")
    for trace in (tmp_path / "missing" / "t.jsonl", not_a_dir / "t.jsonl"):
        args = _model_args() if command == "run" else ["demo"]
        done = cli.run("harnessd", *args, "--trace", str(trace), env={"TMPDIR": str(tmp_path)})
        assert done.returncode == 2
        assert str(trace) in cli.one_line(done.stderr, f"harnessd {command}")
        assert "execd up" not in done.stdout


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory")
def test_a_trace_in_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        done = cli.run("harnessd", "demo", "--trace", str(locked / "t.jsonl"))
    finally:
        locked.chmod(0o700)
    assert done.returncode == 2
    assert "Permission denied" in cli.one_line(done.stderr, "harnessd demo")


@pytest.mark.parametrize("key", ["sk-proj-Zq81TfX0aBcD3eF4gH5iJ6kL", "AKIAZQ81TFX0ABCD3EF4"])
def test_a_key_given_as_api_key_env_is_never_echoed(key: str) -> None:
    done = cli.run("harnessd", *_model_args("--api-key-env", key))
    assert done.returncode == 2
    line = cli.one_line(done.stderr, "harnessd run")
    assert "--api-key-env" in line
    assert key not in done.stderr and key not in done.stdout


def test_run_mistakes_are_one_line_each(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    cases = [
        (_model_args("--workspace", str(missing)), str(missing)),
        (_model_args("--port", "70000"), "'70000'"),
        (_model_args("--port", "1", "--token-file", str(missing)), str(missing)),
        (_model_args("--max-turns", "0"), "--max-turns"),
        (_model_args("--lease", "-5"), "--lease"),
    ]
    for args, named in cases:
        done = cli.run("harnessd", *args)
        assert done.returncode == 2, (args, done.stderr)
        assert named in cli.one_line(done.stderr, "harnessd run")
        assert "execd up" not in done.stdout


def test_demo_script_mistakes_name_the_script(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for script in (tmp_path / "missing.json", broken):
        done = cli.run("harnessd", "demo", "--script", str(script))
        assert done.returncode == 2
        assert str(script) in cli.one_line(done.stderr, "harnessd demo")


def test_run_checks_the_workspace_of_a_running_execd(tmp_path: Path) -> None:
    with start_execd(tmp_path) as daemon:
        a_file = tmp_path / "a-file"
        a_file.write_text("")
        for workspace in (tmp_path / "missing", a_file):
            done = cli.run(
                "harnessd",
                *_model_args("--port", str(daemon.port), "--workspace", str(workspace)),
                env={"EXECD_TOKEN": daemon.token},
            )
            assert done.returncode == 2, done.stderr
            line = cli.one_line(done.stderr, "harnessd run")
            assert str(workspace) in line and f"127.0.0.1:{daemon.port}" in line
        assert daemon.proc.poll() is None  # a running execd is not the run's to stop
