"""``harnessd exec`` as a user runs it: signals, stdin, closed pipes, and every mistake in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from execd.marker import find_marked
from tests.support import cli
from tests.support.daemon import RunningExecd, start_execd

pytestmark = pytest.mark.timeout(120)

PROG = "harnessd exec"


@pytest.fixture
def execd(tmp_path: Path) -> Iterator[RunningExecd]:
    with start_execd(tmp_path) as daemon:
        yield daemon


Stdio = int | IO[Any] | None
"""What Popen takes for a standard stream: a descriptor, a file, PIPE/DEVNULL, or inherited."""


def _exec(
    execd: RunningExecd,
    *args: str,
    stdin: Stdio = None,
    stdout: Stdio = None,
    stderr: Stdio = None,
) -> subprocess.Popen[str]:
    argv, env = cli.harnessd_exec(execd.port, execd.token, *args)
    return subprocess.Popen(
        argv,
        env=env,
        text=True,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
    )


def _run(execd: RunningExecd, *args: str) -> subprocess.CompletedProcess[str]:
    return cli.run(
        "harnessd", "exec", "--port", str(execd.port), *args, env={"EXECD_TOKEN": execd.token}
    )


def _started(execd: RunningExecd, script: str) -> subprocess.Popen[str]:
    """``harnessd exec -- sh -c SCRIPT`` once SCRIPT has printed ``ready``."""
    proc = _exec(execd, "--", "sh", "-c", script, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    cli.read_until(proc.stdout, "ready", time.monotonic() + 30)
    return proc


def _no_marked_left(marker: str, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = find_marked("EXECD_MARKER", marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_reaches_the_command_and_sets_the_status(
    execd: RunningExecd, signum: int
) -> None:
    proc = _started(execd, "echo ready; exec sleep 60")
    assert proc.stdout is not None and proc.stderr is not None
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == 128 + signum
    assert "Traceback" not in proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert _no_marked_left(execd.marker) == []


def test_a_second_signal_gives_up_on_a_command_that_ignores_the_first(
    execd: RunningExecd,
) -> None:
    proc = _started(execd, "trap '' TERM; echo ready; sleep 60")
    assert proc.stdout is not None and proc.stderr is not None
    proc.send_signal(signal.SIGTERM)
    # The command ignores it: exec keeps waiting, as docker exec would.
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=1.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    line = cli.one_line(proc.stderr.read(), PROG)
    assert "SIGTERM" in line
    proc.stdout.close()
    proc.stderr.close()
    # Closing the connection made execd stop the command (it ignored SIGTERM: SIGKILL after the grace).
    assert _no_marked_left(execd.marker) == []


def test_interactive_returns_when_the_command_ends_while_a_pipe_stays_open(
    execd: RunningExecd,
) -> None:
    proc = _exec(
        execd, "-i", "--", "sh", "-c", "exit 5", stdin=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stderr is not None
    try:
        # Nothing is ever written and the pipe stays open until exec is done.
        assert proc.wait(timeout=30) == 5
        assert proc.stderr.read() == ""
    finally:
        proc.stdin.close()
        proc.stderr.close()


def test_interactive_returns_when_the_command_ends_while_a_terminal_is_idle(
    execd: RunningExecd,
) -> None:
    controller, terminal = os.openpty()
    try:
        proc = _exec(
            execd,
            "-i",
            "--",
            "sh",
            "-c",
            "echo done; exit 4",
            stdin=terminal,
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert proc.wait(timeout=30) == 4
        assert proc.stdout.read() == "done\n"
        proc.stdout.close()
    finally:
        os.close(controller)
        os.close(terminal)


def test_interactive_still_forwards_piped_input(execd: RunningExecd) -> None:
    done = cli.run(
        "harnessd",
        "exec",
        "--port",
        str(execd.port),
        "-i",
        "--",
        "tr",
        "a-z",
        "A-Z",
        env={"EXECD_TOKEN": execd.token},
        stdin=b"one\ntwo\n",
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "ONE\nTWO\n", "")


def test_a_closed_stdout_ends_exec_quietly_and_stops_the_command(execd: RunningExecd) -> None:
    proc = _exec(
        execd, "--", "seq", "1", "100000000", stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert [proc.stdout.readline(), proc.stdout.readline()] == ["1\n", "2\n"]
    proc.stdout.close()  # what `| head -2` does once it has its lines
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE
    assert proc.stderr.read() == ""
    proc.stderr.close()
    assert _no_marked_left(execd.marker) == []


def test_through_head_the_pipeline_prints_two_lines_and_nothing_else(
    execd: RunningExecd,
) -> None:
    script = f"{sys.executable} -m harnessd exec --port {execd.port} -- seq 1 100000000 | head -2"
    done = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        env=dict(os.environ, EXECD_TOKEN=execd.token),
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "1\n2\n", "")


def test_a_missing_command_exits_127(execd: RunningExecd) -> None:
    done = _run(execd, "--", "no-such-command-anywhere")
    assert done.returncode == 127
    assert "no-such-command-anywhere" in cli.one_line(done.stderr, PROG)


@pytest.mark.skipif(os.geteuid() == 0, reason="root searches any directory")
def test_a_path_entry_that_cannot_be_searched_does_not_hide_not_found(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o000)
    try:
        path = f"{locked}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        with start_execd(tmp_path, env={"PATH": path}) as daemon:
            missing = _run(daemon, "--", "no-such-command-anywhere")
            found = _run(daemon, "--", "true")
    finally:
        locked.chmod(0o700)
    assert missing.returncode == 127
    assert "not found" in cli.one_line(missing.stderr, PROG)
    assert found.returncode == 0


def test_a_missing_working_directory_exits_126(execd: RunningExecd, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    done = _run(execd, "--cwd", str(missing), "--", "true")
    assert done.returncode == 126
    assert str(missing) in cli.one_line(done.stderr, PROG)


def test_a_command_that_is_not_executable_exits_126(execd: RunningExecd, tmp_path: Path) -> None:
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\necho never\n")
    script.chmod(0o644)
    done = _run(execd, "--", str(script))
    assert done.returncode == 126
    assert str(script) in cli.one_line(done.stderr, PROG)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_timeout_must_be_a_positive_number_of_seconds(execd: RunningExecd, value: str) -> None:
    done = _run(execd, "--timeout", value, "--", "echo", "hi")
    assert done.returncode == 2
    assert done.stdout == ""
    line = cli.one_line(done.stderr, PROG)
    assert "--timeout" in line and repr(value) in line


def test_a_positive_timeout_kills_the_command(execd: RunningExecd) -> None:
    done = _run(execd, "--timeout", "0.5", "--", "sleep", "30")
    assert done.returncode == 128 + signal.SIGTERM
    assert "timed out" in cli.one_line(done.stderr, PROG)


def test_limits_bound_the_command_and_the_one_it_ran_into_is_named(
    execd: RunningExecd, tmp_path: Path
) -> None:
    counted = _run(
        execd, "--limit-open-files", "77", "--limit-cpu", "30", "--", "sh", "-c", "ulimit -n"
    )
    assert (counted.returncode, counted.stdout, counted.stderr) == (0, "77\n", "")
    big = tmp_path / "big"
    written = _run(
        execd,
        "--limit-file-size",
        "1M",
        "--",
        "dd",
        "if=/dev/zero",
        f"of={big}",
        "bs=1M",
        "count=4",
    )
    assert written.returncode == 128 + signal.SIGXFSZ
    assert big.stat().st_size <= 1 << 20
    assert "ran into its file_size limit" in written.stderr.splitlines()[-1]


@pytest.mark.parametrize("value", ["2", "many", "-5"])
def test_a_limit_out_of_range_is_a_usage_error(execd: RunningExecd, value: str) -> None:
    done = _run(execd, "--limit-open-files", value, "--", "true")
    assert done.returncode == 2
    assert "--limit-open-files" in cli.one_line(done.stderr, PROG) or "open_files" in done.stderr


def test_a_limit_above_execds_own_is_refused(tmp_path: Path) -> None:
    with start_execd(tmp_path, "--limit-open-files", "64") as daemon:
        lowered = _run(daemon, "--limit-open-files", "32", "--", "sh", "-c", "ulimit -n")
        raised = _run(daemon, "--limit-open-files", "100", "--", "true")
    assert (lowered.returncode, lowered.stdout) == (0, "32\n")
    assert raised.returncode == 2
    assert "open_files" in cli.one_line(raised.stderr, PROG)


@pytest.mark.parametrize("port", ["0", "70000", "99999", "-1", "http"])
def test_a_port_outside_1_to_65535_is_refused(port: str) -> None:
    done = cli.run("harnessd", "exec", "--port", port, "--", "true", env={"EXECD_TOKEN": "x"})
    assert done.returncode == 2
    line = cli.one_line(done.stderr, PROG)
    assert "--port" in line and repr(port) in line


def test_token_file_mistakes_name_the_file(tmp_path: Path) -> None:
    for path, why in cli.token_file_mistakes(tmp_path):
        done = cli.run("harnessd", "exec", "--port", "1", "--token-file", str(path), "--", "true")
        assert done.returncode == 2, done.stderr
        line = cli.one_line(done.stderr, PROG)
        assert str(path) in line and why in line


def test_no_command_is_a_usage_error() -> None:
    done = cli.run("harnessd", "exec", "--port", "1", env={"EXECD_TOKEN": "x"})
    assert done.returncode == 2
    cli.one_line(done.stderr, PROG)


@pytest.mark.parametrize("answer", [cli.HTTP_400, b""], ids=["answers-http", "hangs-up"])
def test_something_that_is_not_execd_is_named_as_such(answer: bytes) -> None:
    with cli.foreign_server(answer) as port:
        done = cli.run(
            "harnessd", "exec", "--port", str(port), "--", "true", env={"EXECD_TOKEN": "x"}
        )
    assert done.returncode == 255
    assert f"not an execd at 127.0.0.1:{port}" in cli.one_line(done.stderr, PROG)


def test_an_http_server_is_not_an_execd(tmp_path: Path) -> None:
    server = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "http.server",
            "0",
            "--bind",
            "127.0.0.1",
            "--directory",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stdout is not None
        banner = cli.read_until(server.stdout, r"port \d+", time.monotonic() + 30)
        port = banner.split("port ")[1].split()[0]
        # The server either answers 400 (a newline in the hello) or waits for more;
        # both end in the same one line, the second after the handshake timeout.
        done = cli.run("harnessd", "exec", "--port", port, "--", "true", env={"EXECD_TOKEN": "x"})
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stdout is not None:
            server.stdout.close()
    assert done.returncode == 255
    assert f"not an execd at 127.0.0.1:{port}" in cli.one_line(done.stderr, PROG)
