"""The bench's peer sections: OpenSSH's sshd as the bench runs it, and what the report says when a peer cannot run.

Real parts throughout: the machine's sshd (the tests that need it skip, with
the reason, where it is not installed; ./check installs it as root), an
asyncssh client, the real bench in a subprocess stopped by a real SIGTERM,
and a real import failure (a package on PYTHONPATH that shadows aiohttp).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import ssh_peer, swerex_peer
from bench.agents import processes_mentioning
from bench.sshd import SshdUnavailable, descendants, find_sshd, start_sshd
from tests.support.procs import state

pytestmark = pytest.mark.anyio

WHY_NO_SSH = ssh_peer.unavailable_reason(None)
needs_sshd = pytest.mark.skipif(WHY_NO_SSH is not None, reason=f"no OpenSSH here: {WHY_NO_SSH}")


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie waiting for init to reap it has too)."""
    return state(pid) in (None, "Z", "X")


@needs_sshd
async def test_sshd_runs_commands_with_an_empty_home_and_stops_with_everything_it_started(
    tmp_path: Path,
) -> None:
    async with start_sshd(find_sshd(), str(tmp_path)) as sshd:
        conn = await sshd.connect()
        await ssh_peer.check_clean_login(conn, sshd)
        done = await conn.run("id -u; pwd", check=True)
        assert str(done.stdout).split()[0] == str(os.geteuid())
        shell = await ssh_peer.PersistentShell.start(conn)
        assert await shell.run("cd /; false") == 1
        assert await shell.run("test $PWD = /") == 0
        directory, listener = Path(sshd.directory), sshd.pid
        # The connection's processes (and the shell) are still there when sshd is stopped.
        started = [pid for pid, _ in descendants(listener)]
        assert started
        assert sorted(path.name for path in directory.iterdir()) == [
            "authorized_keys",
            "home",
            "host_key",
            "sshd.log",
            "sshd_config",
        ]
        assert oct((directory / "host_key").stat().st_mode & 0o777) == "0o600"
    conn.close()
    assert not directory.exists()
    assert gone(listener)
    assert [pid for pid in started if not gone(pid)] == []
    assert processes_mentioning(str(directory)) == []


@needs_sshd
async def test_bash_under_sshd_reads_a_bashrc_in_home_which_the_clean_login_check_refuses(
    tmp_path: Path,
) -> None:
    read = tmp_path / "bashrc-was-read"
    async with start_sshd(find_sshd(), str(tmp_path)) as sshd:
        conn = await sshd.connect()
        try:
            await ssh_peer.check_clean_login(conn, sshd)
            Path(sshd.home, ".bashrc").write_text(f"echo read >> {read}\n")
            # A command run over SSH is not interactive, yet its bash reads ~/.bashrc: the
            # startup cost the bench keeps out by the empty HOME.
            await conn.run("true", check=True)
            assert read.read_text() == "read\n"
            with pytest.raises(SshdUnavailable, match="startup files would be timed"):
                await ssh_peer.check_clean_login(conn, sshd)
        finally:
            conn.close()
            await conn.wait_closed()


def bench(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "bench", "--quick", "--out", str(out), "--tmp", str(scratch)]
    return subprocess.Popen(
        [*argv, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def finished(tmp_path: Path, proc: subprocess.Popen[str]) -> tuple[str, dict[str, Any]]:
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-4000:]
    out = tmp_path / "out"
    data: dict[str, Any] = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    return (out / "bench.md").read_text(encoding="utf-8"), data


def machine_line(report: str) -> str:
    return next(line for line in report.splitlines() if line.startswith("Machine: "))


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_sshd
def test_sigterm_during_the_openssh_section_stops_sshd_and_removes_its_directory(
    tmp_path: Path,
) -> None:
    proc = bench(tmp_path, "--only", "ssh")
    assert proc.stderr is not None
    for line in proc.stderr:
        started = ssh_peer.announced(line)
        if started is not None:
            break
    else:
        pytest.fail(f"the bench never started sshd: {proc.wait()}")
    pid, directory = started
    assert os.path.isdir(directory) and not gone(pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert gone(pid)
    assert not os.path.exists(directory)
    assert processes_mentioning(directory) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_sshd_the_report_says_why_and_names_no_openssh(tmp_path: Path) -> None:
    missing = tmp_path / "no-such" / "sshd"
    report, data = finished(tmp_path, bench(tmp_path, "--only", "ssh", "--sshd", str(missing)))
    reason = f"{missing} is not an executable file"
    assert data["skipped"] == [{"section": ssh_peer.SECTION, "reason": reason}]
    assert f"Not measured:\n\n- {ssh_peer.SECTION}: {reason}\n" in report
    assert data["rows"] == [] and data["headline"] == []
    assert "OpenSSH" not in machine_line(report)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_swerex_without_aiohttp_says_so_in_the_report_and_the_header_names_no_swerex(
    tmp_path: Path,
) -> None:
    pytest.importorskip("swerex")
    shadow = tmp_path / "shadow" / "aiohttp"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('aiohttp is hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    report, data = finished(tmp_path, bench(tmp_path, "--only", "swerex", env=env))
    assert [skip["section"] for skip in data["skipped"]] == [swerex_peer.SECTION]
    assert "aiohttp is hidden by the test" in data["skipped"][0]["reason"]
    assert f"- {swerex_peer.SECTION}: SWE-ReX's client cannot be imported" in report
    assert data["rows"] == []
    assert "SWE-ReX" not in machine_line(report)
