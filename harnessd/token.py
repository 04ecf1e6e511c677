"""Where harnessd gets a token from: a file, or the EXECD_TOKEN environment variable."""

from __future__ import annotations

import os
import secrets

TOKEN_VAR = "EXECD_TOKEN"  # noqa: S105 - a variable name, not a secret


def new_token() -> str:
    """A fresh 256-bit token, hex encoded."""
    return secrets.token_hex(32)


def read_token(token_file: str | None) -> str:
    """The token from ``token_file``, else from $EXECD_TOKEN.

    Raises ValueError, naming the file, when it cannot be read or is empty,
    and when neither source has a token.
    """
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as handle:
                token = handle.read(4096).strip()
        except OSError as exc:
            raise ValueError(f"cannot read the token file {token_file}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"the token file {token_file} is not text") from None
        if not token:
            raise ValueError(f"the token file {token_file} is empty")
    else:
        token = os.environ.get(TOKEN_VAR, "").strip()
    if not token:
        raise ValueError(f"no token: pass --token-file FILE or set {TOKEN_VAR}")
    return token
