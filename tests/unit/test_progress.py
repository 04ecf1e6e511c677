"""The live progress display: its lines, its bounds, its status line on a terminal."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from harnessd.progress import Progress, elapsed, printable, summary


def feed(progress: Progress, *records: dict[str, Any]) -> None:
    for record in records:
        progress({"session": "s", "t": 0.0, **record})


def start(call_id: str, name: str = "shell", **arguments: Any) -> dict[str, Any]:
    return {
        "event": "tool_start",
        "turn": 1,
        "id": call_id,
        "name": name,
        "arguments": json.dumps(arguments),
    }


def output(call_id: str, data: bytes, stream: str = "stdout") -> dict[str, Any]:
    return {"event": "tool_output", "turn": 1, "id": call_id, "stream": stream, "data": data}


def end(call_id: str, ok: bool = True, ms: float = 1500.0, name: str = "shell") -> dict[str, Any]:
    return {
        "event": "tool_call",
        "turn": 1,
        "id": call_id,
        "name": name,
        "ms": ms,
        "ok": ok,
        "error": None if ok else "RemoteError",
    }


def test_plain_lines_for_calls_output_and_the_model() -> None:
    out = io.StringIO()
    progress = Progress(out, tty=False)
    feed(
        progress,
        {"event": "model_start", "turn": 2, "messages": 5},
        {
            "event": "model_retry",
            "turn": 2,
            "attempt": 1,
            "attempts": 3,
            "status": 429,
            "error": None,
            "wait": 7.0,
            "retry_after": 7.0,
            "capped": False,
        },
        {
            "event": "model_retry",
            "turn": 2,
            "attempt": 2,
            "attempts": 3,
            "status": None,
            "error": "127.0.0.1:9 did not answer within 30.0 s",
            "wait": 0.4,
            "retry_after": None,
            "capped": False,
        },
        {"event": "model_turn", "turn": 2, "ms": 2500.0, "tool_calls": [{}, {}]},
        start("c1", command="make   test"),
        start("c2", "read_file", path="a.txt"),
        output("c1", b"building\nwarn: x\n"),
        output("c1", b"oops\n", "stderr"),
        end("c2", name="read_file", ms=3.0),
        output("c1", b"partial without newline"),
        end("c1", ok=False, ms=125_000.0),
    )
    assert out.getvalue().splitlines() == [
        "model: asking for turn 2",
        "model: attempt 1 of 3 failed: HTTP 429; retrying in 7.0 s (as Retry-After asked)",
        "model: attempt 2 of 3 failed: 127.0.0.1:9 did not answer within 30.0 s; retrying in 0.4 s",
        "model: answered in 2.5 s, 2 tool calls",
        "[c1] shell started: make test",
        "[c2] read_file started: a.txt",
        "[c1] | building",
        "[c1] | warn: x",
        "[c1] ! oops",
        "[c2] read_file done in 0.0 s",
        "[c1] | partial without newline",
        "[c1] shell failed in 2 min 05 s (RemoteError)",
    ]
    assert "\x1b" not in out.getvalue()


def test_live_output_is_bounded_per_call() -> None:
    out = io.StringIO()
    progress = Progress(out, tty=False, live_lines=3, line_chars=20)
    feed(progress, start("c1"))
    feed(progress, *(output("c1", f"line {n}\n".encode()) for n in range(100)))
    feed(progress, output("c1", b"y" * 10_000), end("c1"))
    lines = out.getvalue().splitlines()
    assert lines == [
        "[c1] shell started: {}",
        "[c1] | line 0",
        "[c1] | line 1",
        "[c1] | line 2",
        "[c1] ... more output not shown here (the result has it)",
        "[c1] shell done in 1.5 s",
    ]


def test_a_long_line_is_cut_and_split_utf8_is_rejoined() -> None:
    out = io.StringIO()
    progress = Progress(out, tty=False, line_chars=10)
    snowman = "\u2603".encode()
    feed(
        progress, start("c1"), output("c1", b"ab" + snowman[:1]), output("c1", snowman[1:] + b"\n")
    )
    feed(progress, output("c1", b"z" * 25), end("c1"))
    lines = out.getvalue().splitlines()
    assert lines[1] == "[c1] | ab\u2603"
    assert lines[2] == "[c1] | zzzzzzz..."
    assert lines[-1] == "[c1] shell done in 1.5 s"


def test_escape_sequences_and_control_characters_are_neutralised() -> None:
    assert printable("\x1b[31mred\x1b[0m") == "red"
    assert printable("10%\r50%\r100%") == "100%"
    assert printable("bell\x07 and \x00nul") == "bell? and ?nul"
    assert printable("\x1b]0;title\x07shown") == "shown"
    assert summary("shell", json.dumps({"command": "echo \x1b[2J hi\nthere"})) == "echo  hi there"
    assert summary("write_file", json.dumps({"path": "a", "content": "b"})) == (
        '{"path":"a","content":"b"}'
    )
    assert summary("x", "not json") == "not json"


@given(st.text())
def test_printable_never_lets_a_control_character_through(text: str) -> None:
    shown = printable(text)
    assert all(ch.isprintable() or ch == "\t" for ch in shown)


def test_elapsed() -> None:
    assert elapsed(0.04) == "0.0 s"
    assert elapsed(59.94) == "59.9 s"
    assert elapsed(60) == "1 min 00 s"
    assert elapsed(141.2) == "2 min 21 s"


def test_a_terminal_gets_a_status_line_erased_before_every_record() -> None:
    out = io.StringIO()
    progress = Progress(out, tty=True, tick=0.05)

    async def main() -> None:
        feed(progress, {"event": "model_start", "turn": 1, "messages": 2})
        await asyncio.sleep(0.3)
        feed(progress, {"event": "model_turn", "turn": 1, "ms": 300.0, "tool_calls": [{}]})
        feed(progress, start("c1", command="sleep 1"))
        await asyncio.sleep(0.3)
        feed(progress, end("c1"))
        await asyncio.sleep(0.2)  # nothing in flight: no more status lines
        progress.close()

    asyncio.run(main())
    text = out.getvalue()
    assert "... waiting for the model (turn 1), " in text
    assert "... running 1: shell [c1] " in text
    # Every status line is erased before anything else is written, the last one included.
    at = text.find("... ")
    assert at >= 0
    while at >= 0:
        erase, newline = text.find("\r\x1b[K", at), text.find("\n", at)
        assert erase >= 0 and (newline < 0 or erase < newline)
        at = text.find("... ", at + 1)
    assert text.count("waiting for the model") >= 2  # rewritten in place while waiting
    lines = [line.rsplit("\r\x1b[K", 1)[-1] for line in text.split("\n")]
    assert "model: answered in 0.3 s, 1 tool call" in lines
    assert "[c1] shell done in 1.5 s" in lines


def test_plain_mode_says_still_waiting_after_a_silence() -> None:
    out = io.StringIO()
    progress = Progress(out, tty=False, plain_every=0.2)

    async def main() -> None:
        feed(progress, {"event": "model_start", "turn": 4, "messages": 9})
        feed(progress, start("c9"))
        await asyncio.sleep(1.6)
        feed(progress, end("c9"), {"event": "model_error", "turn": 4, "error": "boom"})
        progress.close()

    asyncio.run(main())
    lines = out.getvalue().splitlines()
    assert any(line.startswith("model: still waiting (turn 4), ") for line in lines)
    assert any(line.startswith("[c9] shell still running, ") for line in lines)
    assert lines[-1] == "model: failed: boom"
    assert "\r" not in out.getvalue()


def test_a_closed_stream_is_not_an_error() -> None:
    out = io.StringIO()
    progress = Progress(out, tty=False)
    out.close()
    feed(progress, start("c1"), output("c1", b"x\n"), end("c1"))
    progress.close()
