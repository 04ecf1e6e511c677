"""harnessd reads a token from a file or EXECD_TOKEN into the very bytes execd does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harnessd.token import TOKEN_VAR, read_token

# execd reads in a child: reading scrubs the variable from the reader's environment.
_EXECD_READS = (
    "import argparse, sys\n"
    "from execd.__main__ import _read_token\n"
    "args = argparse.Namespace(token_file=sys.argv[1] or None, keep_token_file=True)\n"
    "sys.stdout.buffer.write(_read_token(args))\n"
)


def execd_reads(token_file: str, env: dict[str, str]) -> bytes:
    done = subprocess.run(
        [sys.executable, "-c", _EXECD_READS, token_file],
        capture_output=True,
        env=env,
        timeout=60,
        check=True,
    )
    return done.stdout


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
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR}
    assert read_token(str(path)) == execd_reads(str(path), env) == content.strip()


@pytest.mark.parametrize("value", ["0123abcd" * 8, "  spaced token \n", "\u00a0t\u00e9 \u00a0"])
def test_the_variable_gives_the_same_bytes(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_VAR, value)
    assert read_token(None) == execd_reads("", dict(os.environ)) == value.strip().encode()


def test_an_empty_file_is_refused_by_both(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b" \n")
    with pytest.raises(ValueError, match="empty"):
        read_token(str(path))
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR}
    with pytest.raises(subprocess.CalledProcessError):
        execd_reads(str(path), env)
