"""The tokens harnessd makes for the execds it launches.

Reading a token (from a file or ``EXECD_TOKEN``) follows the rule execd
follows too: :func:`protocol.values.read_token`.
"""

from __future__ import annotations

import secrets


def new_token() -> str:
    """A fresh 256-bit token, hex encoded."""
    return secrets.token_hex(32)
