"""The values both command lines take as a person writes them: ports and seconds.

execd and harnessd share no code but this package, so their argparse types
live here beside :func:`protocol.rpc.resources.parse_bytes`. Each raises
``argparse.ArgumentTypeError`` with the message the user sees.
"""

from __future__ import annotations

import math
from argparse import ArgumentTypeError

HIGHEST_PORT = 65535


def port_number(text: str) -> int:
    """argparse type: a TCP port to connect to, 1-65535."""
    return _port(text, 1, "")


def bind_port(text: str) -> int:
    """argparse type: a TCP port to listen on, 0-65535 (0: the kernel picks)."""
    return _port(text, 0, "; 0: any")


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _port(text: str, lowest: int, hint: str) -> int:
    value = int(text) if text.isascii() and text.isdigit() else -1
    if not lowest <= value <= HIGHEST_PORT:
        raise ArgumentTypeError(f"{text!r} is not a port number ({lowest}-{HIGHEST_PORT}{hint})")
    return value
