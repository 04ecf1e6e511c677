"""``harnessd run`` as a user sees it: live progress on stderr, retries, the model flags, signals.

Each test runs the real command (which launches a real execd) against a
chat-completions endpoint on loopback (tests/support/model_endpoint.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harnessd.trace import read_trace
from tests.support import cli
from tests.support.model_endpoint import Answer, ModelEndpoint, Seen, completion, tool_call

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def endpoint() -> Iterator[ModelEndpoint]:
    with ModelEndpoint() as server:
        yield server


def run_args(endpoint: ModelEndpoint, workspace: Path, *more: str) -> list[str]:
    return [
        "run",
        "--model",
        "m",
        "--base-url",
        endpoint.base_url,
        "--task",
        "do the thing",
        "--workspace",
        str(workspace),
        *more,
    ]


def start(tmp_path: Path, args: list[str]) -> subprocess.Popen[str]:
    return cli.spawn(tmp_path, "harnessd", *args)


def finish(proc: subprocess.Popen[str], timeout: float = 90) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


def test_progress_streams_output_live_on_stderr_and_stdout_stays_the_transcript(
    tmp_path: Path, endpoint: ModelEndpoint
) -> None:
    root = workspace(tmp_path)
    command = "echo first; echo warn >&2; while [ ! -e go ]; do sleep 0.05; done; echo second"
    endpoint.answers += [
        Answer(429, b'{"error": "slow down"}', {"Retry-After": "1"}),
        Answer(200, completion("looking", [tool_call("c1", "shell", {"command": command})])),
        Answer(200, completion("all done")),
    ]
    proc = start(tmp_path, run_args(endpoint, root, "--retries", "2"))
    assert proc.stderr is not None
    head = cli.read_until(proc.stderr, r"\[c1\] \| first", time.monotonic() + 60)
    # The command is still waiting for "go": its first line was shown while it ran.
    assert "[c1] shell done" not in head and "[c1] | second" not in head
    (root / "go").write_text("")
    status, out, rest = finish(proc)
    err = head + rest
    assert status == 0, err
    assert "model: attempt 1 of 3 failed: HTTP 429; retrying in 1.0 s (as Retry-After asked)" in err
    assert "[c1] shell started: echo first; echo warn >&2;" in err
    assert "[c1] ! warn" in err
    assert "[c1] | second" in err
    assert "[c1] shell done in " in err
    assert "model: answered in " in err
    # stdout: the transcript and the answer, no progress.
    assert "final answer:\nall done" in out
    assert "  <- shell [c1]" in out and "second" in out
    assert "model: " not in out and "[c1] |" not in out
    first, second = endpoint.seen[:2]
    assert second.at - first.at >= 0.95


def test_quiet_shows_no_progress(tmp_path: Path, endpoint: ModelEndpoint) -> None:
    endpoint.answers.append(
        Answer(200, completion(None, [tool_call("c1", "shell", {"command": "echo hi"})]))
    )
    status, out, err = finish(start(tmp_path, run_args(endpoint, workspace(tmp_path), "--quiet")))
    assert status == 0, err
    assert err == ""
    assert "final answer:\ndone" in out


def _bodies(seen: list[Seen]) -> list[dict[str, Any]]:
    return [s.body for s in seen]


@pytest.mark.parametrize("in_order", [False, True])
def test_model_flags_reach_the_request_body(
    tmp_path: Path, endpoint: ModelEndpoint, in_order: bool
) -> None:
    args = ["--temperature", "0.3", "--max-tokens", "77", "--quiet"]
    if in_order:
        args.append("--in-order")
    endpoint.answers.append(
        Answer(200, completion(None, [tool_call("c1", "shell", {"command": "true"})]))
    )
    status, _, err = finish(start(tmp_path, run_args(endpoint, workspace(tmp_path), *args)))
    assert status == 0, err
    bodies = _bodies(endpoint.seen)
    assert len(bodies) == 2
    for body in bodies:
        assert body["temperature"] == 0.3
        assert body["max_tokens"] == 77
        assert body["parallel_tool_calls"] is (not in_order)
    system = bodies[0]["messages"][0]["content"]
    if in_order:
        assert "one after another, in the order given" in system
    else:
        assert "run at the same time" in system


def test_retries_zero_and_the_model_timeout(tmp_path: Path, endpoint: ModelEndpoint) -> None:
    endpoint.answers.append(Answer(500, b'{"error": "boom"}'))
    status, out, err = finish(
        start(tmp_path, run_args(endpoint, workspace(tmp_path), "--retries", "0"))
    )
    assert status == 1
    assert len(endpoint.seen) == 1
    assert "stopped: ModelHTTPError" in out and "HTTP 500" in out
    assert "model: failed: ModelHTTPError" in err
    cli.assert_no_log_kept(out)

    endpoint.answers += [Answer(200, completion("late"), delay=60)] * 2
    args = ["--retries", "1", "--model-timeout", "2"]
    status, out, err = finish(start(tmp_path, run_args(endpoint, tmp_path / "ws", *args)))
    assert status == 1
    assert len(endpoint.seen) == 3
    assert "did not answer within" in out and "gave up after 2 attempts" in out
    assert "model: attempt 1 of 2 failed: " in err and "did not answer within" in err
    cli.assert_no_log_kept(out)


def test_max_retry_wait_caps_retry_after(tmp_path: Path, endpoint: ModelEndpoint) -> None:
    endpoint.answers += [Answer(429, b"{}", {"Retry-After": "3600"})]
    args = ["--max-retry-wait", "0.5"]
    status, out, err = finish(start(tmp_path, run_args(endpoint, workspace(tmp_path), *args)))
    assert status == 0, err
    assert "retrying in 0.5 s (Retry-After asked 60 min 00 s; capped)" in err
    assert "final answer:\ndone" in out
    # A finished run removes execd's directory and the log in it.
    cli.assert_no_log_kept(out)


def test_sigterm_during_a_retry_wait_ends_the_trace_with_session_end(
    tmp_path: Path, endpoint: ModelEndpoint
) -> None:
    endpoint.answers.append(Answer(503, b"busy", {"Retry-After": "60"}))
    trace = tmp_path / "trace.jsonl"
    proc = start(tmp_path, run_args(endpoint, workspace(tmp_path), "--trace", str(trace)))
    assert proc.stderr is not None
    cli.read_until(proc.stderr, "retrying in 1 min 00 s", time.monotonic() + 60)
    proc.send_signal(signal.SIGTERM)
    status, out, err = finish(proc)
    assert status == 128 + signal.SIGTERM, err
    assert "SIGTERM received" in err
    assert "0 processes left" in out
    cli.assert_no_log_kept(out)
    records = read_trace(trace)
    kinds = [r["event"] for r in records]
    assert kinds[-2:] == ["session_end", "cleanup"], kinds
    retry = next(r for r in records if r["event"] == "model_retry")
    assert (retry["status"], retry["wait"], retry["retry_after"]) == (503, 60.0, 60.0)
    assert next(r for r in records if r["event"] == "signal")["name"] == "SIGTERM"
    end = records[-2]
    assert end["reason"] == "interrupted" and end["turns"] == 0
    assert kinds.index("signal") < kinds.index("session_end")
    assert "sync" in kinds  # the end reached execd's ledger before it closed


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--retries", "-1"], "--retries"),
        (["--temperature", "warm"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--model-timeout", "0"], "--model-timeout"),
        (["--max-retry-wait", "-2"], "--max-retry-wait"),
    ],
)
def test_bad_model_flags_are_one_line_each(args: list[str], named: str) -> None:
    done = cli.run(
        "harnessd",
        "run",
        "--model",
        "m",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--task",
        "t",
        *args,
    )
    assert done.returncode == 2
    assert named in cli.one_line(done.stderr, "harnessd run")
    assert "execd up" not in done.stdout


def test_the_trace_is_json_all_the_way(tmp_path: Path, endpoint: ModelEndpoint) -> None:
    endpoint.answers.append(
        Answer(200, completion(None, [tool_call("c1", "shell", {"command": "printf 'a\\nb\\n'"})]))
    )
    trace = tmp_path / "t.jsonl"
    status, _, err = finish(
        start(tmp_path, run_args(endpoint, workspace(tmp_path), "--trace", str(trace)))
    )
    assert status == 0, err
    lines = trace.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    kinds = [r["event"] for r in records]
    # Live output reaches the display, never the file.
    assert "tool_output" not in kinds
    assert kinds.index("tool_start") < kinds.index("tool_call")
    assert kinds[-2:] == ["session_end", "cleanup"]
