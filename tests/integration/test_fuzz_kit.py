"""The fuzz and conformance kit against a real execd, and against a deliberately broken one.

Against execd every case of the catalogue passes and the fuzzing finds
nothing. Against :mod:`tests.support.broken_execd` with its five planted bugs
the kit fails the cases that reach each bug, saves a minimized repro for
each, and the repros replay (they fail again against the broken server and
pass against execd).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import RunningExecd, start_execd

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc"),
]

KIT = [sys.executable, "-m", "protocol.fuzz"]
#: Cases in areas still being settled in execd: they may fail on execd until that lands.
PENDING: dict[str, str] = {}


def kit(*args: str, timeout: float = 500) -> subprocess.CompletedProcess[str]:
    """Run the kit's command line."""
    return subprocess.run(
        [*KIT, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).parents[2],
    )


def token_file(folder: Path, token: str) -> Path:
    path = folder / "token"
    path.write_text(token)
    path.chmod(0o600)
    return path


def report_of(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "report.json").read_text())
    return data


@pytest.fixture(scope="module")
def execd(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("kit-execd")
    with start_execd(root, "--handshake-timeout", "1") as running:
        yield running


def test_execd_passes_every_case(execd: RunningExecd, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = kit(
        f"{execd.host}:{execd.port}",
        "--token-file", str(token_file(tmp_path, execd.token)),
        "--out", str(out),
        "--fuzz-time", "8",
        "--quiet",
    )  # fmt: skip
    report = report_of(out)
    failed = {c["id"]: c["findings"] for c in report["cases"] if c["verdict"] == "fail"}
    assert set(failed) <= set(PENDING), (failed, done.stdout[-3000:])
    if not failed:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["local_pid"] == execd.pid
    assert report["summary"]["pass"] >= 250
    assert report["fuzz"]["examples"] > 0 and report["fuzz"]["failures"] == []
    for name in ("report.md", "report.html", "junit.xml"):
        assert (out / name).stat().st_size > 1000
    assert "protocol conformance of" in done.stdout


def test_without_a_token_only_preauth_cases_run(execd: RunningExecd, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = kit(
        f"{execd.host}:{execd.port}",
        "--out",
        str(out),
        "--fuzz-time",
        "2",
        "--cases",
        "2",
        "6",
        "--quiet",
    )
    report = report_of(out)
    verdicts = {c["id"]: c["verdict"] for c in report["cases"]}
    assert verdicts["2.2"] == "pass" and verdicts["6.1"] == "pass"
    assert verdicts["2.6"] == "skipped"
    assert done.returncode == 0, done.stdout[-2000:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def broken_command(root: Path, port: int, token: Path, bugs: str) -> str:
    planted = ["--bugs", bugs] if bugs else []
    args = [
        sys.executable, "-m", "tests.support.broken_execd", *planted,
        "--port", str(port), "--token-file", str(token), "--keep-token-file",
        "--marker", os.urandom(16).hex(), "--state-dir", str(root / "state"),
        "--handshake-timeout", "1",
    ]  # fmt: skip
    return " ".join(args)


#: Planted bug -> the titles of cases that must fail because of it, and what they find.
FINDS = {
    "frame-off-by-one": ("a header over the negotiated cap", "no Abort 2"),
    "no-credit-check": ("a chunk beyond the credit", "no Abort 10"),
    "replayed-nonce": ("a replayed Auth", "no Abort 7"),
    "crash-on-unknown-type": ("an unknown tag before the handshake", "healthy client"),
    "leak-fd-per-aborted-handshake": ("a wrong MAC", "a leak"),
}


def test_every_planted_bug_is_found_with_a_repro_that_replays(
    tmp_path: Path, execd: RunningExecd
) -> None:
    port = free_port()
    token = token_file(tmp_path, os.urandom(32).hex())
    launch = broken_command(tmp_path, port, token, ",".join(FINDS))
    out = tmp_path / "out"
    sections = ["2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "16"]
    done = kit(
        f"127.0.0.1:{port}", "--token-file", str(token), "--launch", launch, "--out", str(out),
        "--skip-slow", "--fuzz-time", "0", "--quiet", "--settle", "1", "--timeout", "2",
        "--cases", *sections,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    report = report_of(out)
    assert report["restarts"] >= 1  # the crash
    by_title = {c["title"]: c for c in report["cases"]}
    for bug, (title, found) in FINDS.items():
        case = by_title[title]
        assert case["verdict"] == "fail", (bug, case)
        assert any(found in text for text in case["findings"]), (bug, case["findings"])
        repro = Path(case["repro"])
        script = json.loads(repro.read_text())["script"]["steps"]
        assert len(script) <= 8, (bug, script)
        # The repro fails again against the broken server...
        again = kit(
            "--replay", str(repro), f"127.0.0.1:{port}", "--token-file", str(token),
            "--launch", launch, "--settle", "1", "--out", str(tmp_path / "replay"),
        )  # fmt: skip
        assert again.returncode == 1, (bug, again.stdout, again.stderr[-2000:])
        assert "fail" in again.stdout
        # ...and passes against execd.
        fixed = kit(
            "--replay", str(repro), f"{execd.host}:{execd.port}",
            "--token-file", str(token_file(tmp_path, execd.token)), "--out", str(tmp_path / "ok"),
        )  # fmt: skip
        assert fixed.returncode == 0, (bug, fixed.stdout, fixed.stderr[-2000:])


def test_the_broken_server_without_bugs_passes(tmp_path: Path) -> None:
    port = free_port()
    token = token_file(tmp_path, os.urandom(32).hex())
    out = tmp_path / "out"
    done = kit(
        f"127.0.0.1:{port}", "--token-file", str(token), "--out", str(out), "--quiet",
        "--launch", broken_command(tmp_path, port, token, ""), "--skip-slow", "--fuzz-time", "0",
        "--cases", "2", "3", "6", "9",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert report_of(out)["summary"]["fail"] == 0


def test_fuzzing_finds_the_crash_and_shrinks_it(tmp_path: Path) -> None:
    port = free_port()
    token = token_file(tmp_path, os.urandom(32).hex())
    out = tmp_path / "out"
    launch = broken_command(tmp_path, port, token, "crash-on-unknown-type")
    kit(
        f"127.0.0.1:{port}", "--out", str(out), "--quiet", "--settle", "1", "--seed", "7",
        "--launch", launch, "--cases", "none", "--fuzz-time", "60",
    )  # fmt: skip
    failures = report_of(out)["fuzz"]["failures"]
    assert failures, "the fuzzing did not find the crash"
    path = Path(failures[0]["repro"])
    repro = json.loads(path.read_text())
    assert repro["seed"] == failures[0]["seed"]
    steps = repro["script"]["steps"]
    assert [s["op"] for s in steps if s["op"] != "expect"] == ["connect", "send_bytes"], steps
    assert any("healthy client" in text for text in repro["findings"]), repro["findings"]
    again = kit(
        "--replay", str(path), f"127.0.0.1:{port}", "--launch", launch, "--settle", "1",
        "--out", str(tmp_path / "replay"),
    )  # fmt: skip
    assert again.returncode == 1, again.stdout
