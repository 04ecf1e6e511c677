"""Where harnessd gets a token from: a file, or the EXECD_TOKEN environment variable."""

from __future__ import annotations

import os
import secrets

from protocol.handshake import MAX_TOKEN_BYTES

TOKEN_VAR = "EXECD_TOKEN"  # noqa: S105 - a variable name, not a secret


def new_token() -> str:
    """A fresh 256-bit token, hex encoded."""
    return secrets.token_hex(32)


def read_token(
    token_file: str | None, *, variable: str = TOKEN_VAR, option: str = "--token-file"
) -> bytes:
    """The token from ``token_file``, else from $EXECD_TOKEN (or ``variable``), as execd reads it.

    The file's bytes (at most the first 4096) without ASCII whitespace at
    their ends; the variable's text without whitespace at its ends, as UTF-8
    (PROTOCOL.md 6.8). Raises ValueError, naming the file, when it cannot be
    read or is empty, and when neither source has a token (naming ``option``).
    """
    if token_file:
        try:
            with open(token_file, "rb") as handle:
                token = handle.read(MAX_TOKEN_BYTES).strip()
        except OSError as exc:
            raise ValueError(f"cannot read the token file {token_file}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"the token file {token_file} is empty")
    else:
        try:
            token = os.environ.get(variable, "").strip().encode()
        except UnicodeEncodeError:
            raise ValueError(f"{variable} is not valid UTF-8") from None
    if not token:
        raise ValueError(f"no token: pass {option} FILE or set {variable}")
    return token
