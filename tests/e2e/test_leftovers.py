"""What ordinary use leaves behind: nothing, beyond what docs/housekeeping.md says is kept.

Each test runs real commands (the demo, ``harnessd run``, a sample of this
suite) in a mount namespace of their own with an empty ``/tmp`` and a
``HOME`` inside it, then lists what is left there. Making the namespace
needs root.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.model_endpoint import Answer, ModelEndpoint, completion, tool_call

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the commands a private /tmp"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare (util-linux) is missing"),
    pytest.mark.slow,
    pytest.mark.timeout(300),
]

REPO = Path(__file__).resolve().parents[2]
HOME = "/tmp/home"
_SEPARATOR = "=== "
_NO_MOUNT = 99

# Runs as: sh -c SCRIPT sh COMMAND...  Each COMMAND is a shell command line.
_SCRIPT = f"""\
mount -t tmpfs -o mode=1777 tmpfs /tmp || exit {_NO_MOUNT}
mkdir -m 700 {HOME}
for command in "$@"; do
    echo "{_SEPARATOR}run"
    sh -c "$command" 2>&1
    echo "{_SEPARATOR}status $?"
done
echo "{_SEPARATOR}left"
find /tmp -mindepth 1
"""


@dataclass
class Outcome:
    """What each command printed and its exit status, and every path left in /tmp."""

    outputs: list[str]
    statuses: list[int]
    left: list[str]


def in_private_tmp(*commands: Sequence[str], stdin: str = "", timeout: float = 240) -> Outcome:
    """Run ``commands`` one after another with a private, empty /tmp; list what they left.

    ``stdin`` is what the commands read on their standard input.
    """
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("PYTEST_") and name not in ("TMPDIR", "XDG_STATE_HOME")
    }
    env["HOME"] = HOME
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            _SCRIPT,
            "sh",
            *(shlex.join(command) for command in commands),
        ],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )
    if done.returncode == _NO_MOUNT or "unshare failed" in done.stderr:
        pytest.skip(f"cannot make a private /tmp here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr
    outcome = Outcome([], [], [])
    section: list[str] = []
    for line in done.stdout.splitlines():
        if line.startswith(_SEPARATOR + "status "):
            outcome.outputs.append("\n".join(section))
            outcome.statuses.append(int(line.split()[-1]))
        elif line.startswith(_SEPARATOR):
            section = []
        else:
            section.append(line)
    outcome.left = [path for path in section if path != HOME]
    return outcome


def harnessd(*args: str) -> list[str]:
    return [sys.executable, "-m", "harnessd", *args]


def run_args(endpoint: ModelEndpoint, *more: str) -> list[str]:
    return harnessd(
        "run", "--model", "m", "--base-url", endpoint.base_url, "--task", "t", "--quiet", *more
    )


def test_the_demo_and_runs_leave_nothing_behind() -> None:
    with ModelEndpoint() as endpoint:
        command = {"command": "echo made > made.txt && pwd"}
        endpoint.answers += [
            # A run that finishes: one tool call, then the answer.
            Answer(200, completion(None, [tool_call("c1", "shell", command)])),
            Answer(200, completion("done")),
            # A run the model stops: execd was fine, so nothing of it is kept either.
            Answer(400, b'{"error": "bad request"}'),
        ]
        outcome = in_private_tmp(
            harnessd("demo"), run_args(endpoint), run_args(endpoint, "--retries", "0")
        )
    demo, finished, stopped = outcome.outputs
    assert outcome.statuses == [0, 0, 1], outcome.outputs
    assert "demo succeeded" in demo
    assert "final answer:\ndone" in finished
    assert "stopped: " in stopped
    for output in outcome.outputs:
        assert "log kept" not in output
    assert outcome.left == []


# The demo's model kills execd with its first tool call: the close is not clean.
_KILLER = {
    "task": "stop execd",
    "turns": [
        {
            "content": "execd goes",
            "tool_calls": [{"name": "shell", "arguments": {"command": "kill -9 $PPID"}}],
        },
        {"content": "gone"},
    ],
}


def test_a_failed_session_keeps_its_log_alone_and_says_where() -> None:
    outcome = in_private_tmp(harnessd("demo", "--script", "/dev/stdin"), stdin=json.dumps(_KILLER))
    (demo,) = outcome.outputs
    assert outcome.statuses == [1], demo
    kept = [line for line in demo.splitlines() if line.startswith("execd's log kept: ")]
    assert len(kept) == 1, demo
    log = kept[0].removeprefix("execd's log kept: ")
    assert outcome.left == [os.path.dirname(log), log]


SAMPLE = (
    "tests/integration/test_launcher.py",
    "tests/integration/test_cli_agent.py",
    "tests/e2e/test_demo.py",
)
"""Test files that launch execd, run harnessd's commands and use tmp_path."""


def test_a_sample_of_the_suite_cleans_up_after_itself() -> None:
    pytest_args = ["-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile", *SAMPLE]
    outcome = in_private_tmp([sys.executable, "-m", "pytest", *pytest_args], timeout=280)
    (output,) = outcome.outputs
    assert outcome.statuses == [0], output
    # A passing run removes its temporary directories; pytest's own (empty) stays.
    assert outcome.left == ["/tmp/pytest-of-root"], outcome.left


# Runs as: sh -c SCRIPT sh HARNESSD_RUN_ARGV...  Starts the run, SIGKILLs it once its
# session is up, waits for execd to end by its lease, then runs harnessd gc.
_KILLED_RUN = f"""\
out={HOME}/run.out
"$@" >"$out" 2>&1 &
run=$!
tries=0
until grep -q "ledger session" "$out"; do
    tries=$((tries + 1)); [ $tries -lt 600 ] || exit 90; sleep 0.1
done
kill -9 $run
tries=0
until grep -qs '"source": "supervisor"' /tmp/execd-*/execd-*.log; do
    tries=$((tries + 1)); [ $tries -lt 600 ] || exit 91; sleep 0.1
done
ls -d /tmp/harnessd-run-* /tmp/execd-*
rm "$out"
{shlex.join(harnessd("gc", "--older-than", "0"))}
"""


def test_gc_removes_what_a_killed_run_left() -> None:
    with ModelEndpoint() as endpoint:
        endpoint.answers.append(Answer(200, completion("late"), delay=60))
        outcome = in_private_tmp(
            ["sh", "-c", _KILLED_RUN, "sh", *run_args(endpoint, "--lease", "1")]
        )
    (output,) = outcome.outputs
    assert outcome.statuses == [0], output
    lines = output.splitlines()
    assert any(line.startswith("removed /tmp/harnessd-run-") for line in lines), output
    assert any(line.startswith("removed /tmp/execd-") for line in lines), output
    assert outcome.left == []
