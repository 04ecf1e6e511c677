"""Where a token comes from: one rule (protocol.values.read_token) for harnessd and execd.

execd reads through its own wrapper, which also removes the token file and
scrubs EXECD_TOKEN from its environment; these tests run it in a child (the
scrub changes the reader's environment) and hold it to the shared rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.handshake import MAX_TOKEN_BYTES, token_bytes
from protocol.values import TOKEN_VAR, TokenFileUnreadable, read_token

# execd reads in a child: reading scrubs the variable from the reader's environment.
_EXECD_READS = (
    "import argparse, json, os, sys\n"
    "from execd.app import StartupError\n"
    "from execd.__main__ import _read_token\n"
    "args = argparse.Namespace(token_file=sys.argv[1] or None, keep_token_file=sys.argv[2] == 'keep')\n"
    "try:\n"
    "    token, error = _read_token(args).hex(), None\n"
    "except StartupError as exc:\n"
    "    token, error = None, str(exc)\n"
    "print(json.dumps({'token': token, 'error': error, 'left': os.environ.get('EXECD_TOKEN')}))\n"
)


class ExecdRead:
    """What execd's reader did in a child: the token (or the error), and the variable left."""

    def __init__(self, token_file: str, env: dict[str, str], *, keep: bool = True) -> None:
        done = subprocess.run(
            [sys.executable, "-c", _EXECD_READS, token_file, "keep" if keep else "remove"],
            capture_output=True,
            env=env,
            timeout=60,
            check=True,
            text=True,
        )
        outcome = json.loads(done.stdout)
        self.token = bytes.fromhex(outcome["token"]) if outcome["token"] is not None else None
        self.error: str | None = outcome["error"]
        self.left: str | None = outcome["left"]


def without_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != TOKEN_VAR}


@pytest.mark.parametrize(
    "content",
    [
        b"0123abcd" * 8 + b"\n",
        b" \t\r\n\x0b\x0cinner space kept\r\n",
        b"\xff\xfe not UTF-8 \xc3\xa9 \xa0\n",
    ],
)
def test_a_token_file_gives_the_same_bytes(content: bytes, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(content)
    assert read_token(str(path), {}) == content.strip()
    assert ExecdRead(str(path), without_token()).token == content.strip()


@pytest.mark.parametrize(
    "value", ["0123abcd" * 8, "  spaced token \n", "\u00a0t\u00e9 \u00a0", "caf\udce9"]
)
def test_the_variable_gives_the_bytes_a_parameter_gives(value: str) -> None:
    # The same rule as a token passed to connect(): UTF-8 (an undecodable byte os.environ
    # escaped comes back as it was), then only ASCII whitespace off the ends.
    expected = token_bytes(value)
    assert expected == value.encode("utf-8", "surrogateescape").strip()
    assert read_token(None, {TOKEN_VAR: value}) == expected
    read = ExecdRead("", {**without_token(), TOKEN_VAR: value})
    assert read.token == expected
    assert read.left is None, "execd scrubs the variable from its environment"


def test_a_file_comes_before_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"from-the-file\n")
    assert read_token(str(path), {TOKEN_VAR: "from-the-variable"}) == b"from-the-file"
    read = ExecdRead(str(path), {**without_token(), TOKEN_VAR: "from-the-variable"})
    assert read.token == b"from-the-file"
    assert read.left is None


def test_execd_removes_a_file_it_read_and_keeps_one_it_could_not(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"secret\n")
    assert ExecdRead(str(path), without_token(), keep=False).token == b"secret"
    assert not path.exists()
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    assert ExecdRead(str(empty), without_token(), keep=False).error is not None
    assert not empty.exists(), "an empty token file was read: it goes too"
    unreadable = tmp_path / "a-directory"
    unreadable.mkdir()
    read = ExecdRead(str(unreadable), without_token(), keep=False)
    assert read.error is not None and "cannot read the token file" in read.error
    assert unreadable.is_dir()


def test_an_empty_file_is_refused_by_both(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b" \n")
    with pytest.raises(ValueError, match=f"the token file {path} is empty"):
        read_token(str(path), {})
    assert ExecdRead(str(path), without_token()).error == f"the token file {path} is empty"


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(TokenFileUnreadable, match=f"cannot read the token file {missing}"):
        read_token(str(missing), {TOKEN_VAR: "ignored"})


@pytest.mark.parametrize("value", ["", " \t\n"])
def test_no_token_says_where_one_comes_from(value: str) -> None:
    with pytest.raises(ValueError, match=f"pass --token-file FILE or set {TOKEN_VAR}"):
        read_token(None, {TOKEN_VAR: value})
    read = ExecdRead("", {**without_token(), TOKEN_VAR: value})
    assert read.error is not None and f"set {TOKEN_VAR}" in read.error


def test_an_overlong_variable_is_named_but_not_shown() -> None:
    value = "k" * (MAX_TOKEN_BYTES + 1)
    with pytest.raises(ValueError) as caught:
        read_token(None, {TOKEN_VAR: value})
    message = str(caught.value)
    assert message.startswith(f"{TOKEN_VAR}: ") and "longer than" in message
    assert "kkkk" not in message
