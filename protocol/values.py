"""What execd and harnessd both take from a person: numbers, the session marker, the token.

execd and harnessd share no code but this package, so each rule they must
agree on is written here once:

* the argparse types of their command lines (ports, seconds, counts, byte
  sizes, the ``--limit-*`` options of resource limits), each raising
  ``argparse.ArgumentTypeError`` with the message the user sees;
* the session marker and its variable: what a valid one looks like, the
  default variable name, and how a fresh marker is made (execd tags what it
  starts with them; the launcher makes and passes them);
* where a token comes from (:func:`read_token`, PROTOCOL.md 6.8).
"""

from __future__ import annotations

import math
import os
import re
from argparse import ArgumentTypeError
from collections.abc import Callable, Mapping
from typing import Final

import msgspec

from protocol.handshake import MAX_TOKEN_BYTES, EmptyToken, token_bytes
from protocol.rpc.resources import LimitName, Limits

HIGHEST_PORT: Final = 65535

# -- argparse types ------------------------------------------------------------------------


def port_number(text: str) -> int:
    """argparse type: a TCP port to connect to, 1-65535."""
    return _port(text, 1, "")


def bind_port(text: str) -> int:
    """argparse type: a TCP port to listen on, 0-65535 (0: the kernel picks)."""
    return _port(text, 0, "; 0: any")


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds above zero (a lease, a timeout)."""
    value = _finite(text)
    if not value > 0:
        raise ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def non_negative(text: str) -> float:
    """argparse type: a finite number of at least 0."""
    value = _finite(text)
    if not value >= 0:
        raise ArgumentTypeError(f"{text!r} is not a number of at least 0")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    value = int(text) if text.isascii() and text.isdigit() else 0
    if value < 1:
        raise ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def count(text: str) -> int:
    """argparse type: a whole number of at least 0."""
    if not (text.isascii() and text.isdigit()):
        raise ArgumentTypeError(f"{text!r} is not a whole number of at least 0")
    return int(text)


_SIZE_UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_count(text: str) -> int:
    """argparse type: a byte count as a person writes it: ``1048576``, ``512K``, ``2GiB``, ``1g``.

    The suffixes are binary (``K`` = 1024); ``B``/``iB`` after one is optional.
    """
    value = text.strip().lower().removesuffix("b").removesuffix("i")
    digits = value.rstrip("kmgt")
    unit = value[len(digits) :]
    if not (digits.isascii() and digits.isdigit()) or unit not in _SIZE_UNITS:
        raise ArgumentTypeError(f"not a byte count: {text!r} (e.g. 1048576, 512K, 256M, 2G)")
    return int(digits) * _SIZE_UNITS[unit]


LIMIT_OPTIONS: Final[tuple[tuple[LimitName, Callable[[str], float], str], ...]] = (
    ("memory", byte_count, "BYTES"),
    ("cpu", positive_seconds, "SECONDS"),
    ("processes", positive_int, "N"),
    ("file_size", byte_count, "BYTES"),
    ("open_files", positive_int, "N"),
)
"""Each resource limit's command-line option (:func:`option_name`), argparse type and unit.

execd takes them as its defaults, ``harnessd exec`` as the limits of its command.
"""


def option_name(limit: str) -> str:
    """The command-line option of ``limit``: ``--limit-file-size`` for ``file_size``."""
    return "--limit-" + limit.replace("_", "-")


def from_options(values: Mapping[str, float | None]) -> Limits | None:
    """The limits given on a command line (None for an option not given); None if none was.

    Raises ``msgspec.ValidationError`` for a value out of range.
    """
    given = {k: v for k, v in values.items() if v is not None}
    if not given:
        # No option given (how execd usually starts): no conversion, whose first
        # use builds msgspec's schema of Limits before execd can listen.
        return None
    limits = msgspec.convert(given, Limits)
    return None if limits.is_empty() else limits


def _finite(text: str) -> float:
    """``text`` as a float; NaN (which every bound refuses) when it is not a finite number."""
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def _port(text: str, lowest: int, hint: str) -> int:
    value = int(text) if text.isascii() and text.isdigit() else -1
    if not lowest <= value <= HIGHEST_PORT:
        raise ArgumentTypeError(f"{text!r} is not a port number ({lowest}-{HIGHEST_PORT}{hint})")
    return value


# -- the session marker -----------------------------------------------------------------------

DEFAULT_MARKER_VAR: Final = "EXECD_MARKER"
"""The environment variable that carries the marker unless another name is given."""

_MARKER: Final = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_MARKER_VAR: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")


def new_marker() -> str:
    """A fresh session marker: 128 random bits as 32 lowercase hex digits."""
    return os.urandom(16).hex()  # what secrets.token_hex does, without importing random


def validate_marker(marker: str) -> str:
    """Return ``marker`` if it is 1..128 characters of ``[A-Za-z0-9_.-]``, else raise ValueError."""
    if not isinstance(marker, str) or _MARKER.fullmatch(marker) is None:
        raise ValueError("a marker is 1 to 128 characters of A-Z, a-z, 0-9, '_', '.' and '-'")
    return marker


def validate_marker_var(name: str) -> str:
    """Return ``name`` if it is a POSIX environment variable name, else raise ValueError.

    A POSIX name is a letter or underscore followed by letters, digits and
    underscores; at most 256 characters are accepted.
    """
    if not isinstance(name, str) or _MARKER_VAR.fullmatch(name) is None:
        raise ValueError(
            "a marker variable is a letter or '_' followed by letters, digits and '_'"
            " (at most 256 characters)"
        )
    return name


# -- the token --------------------------------------------------------------------------------

TOKEN_VAR: Final = "EXECD_TOKEN"  # noqa: S105 - a variable name, not a secret
"""The environment variable a token is taken from when no token file is given."""


GONE_FILE_HINT: Final = (
    "execd removes its token file once it has read it: start execd with --keep-token-file, "
    "or give clients a copy of the token made before execd starts"
)
"""Why a token file may be gone: said when it is missing."""


class TokenFileUnreadable(ValueError):
    """The token file cannot be opened or read (missing, a directory, not permitted)."""


def read_token(path: str | None, environ: Mapping[str, str]) -> bytes:
    """The token from the file at ``path``, else from ``environ[TOKEN_VAR]``.

    The file's first :data:`~protocol.handshake.MAX_TOKEN_BYTES` bytes, or
    the variable's text, go through :func:`~protocol.handshake.token_bytes`:
    ASCII whitespace at the ends is removed and nothing else changes
    (PROTOCOL.md 6.8). Raises :class:`TokenFileUnreadable` when the file
    cannot be read (for a missing one, with the likely reason: execd removed
    it), and ValueError when it holds no token or neither source
    has one; each message names the file or the variable, never the token.
    """
    raw: bytes | str
    if path:
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_TOKEN_BYTES)
        except OSError as exc:
            message = f"cannot read the token file {path}: {exc.strerror}"
            if isinstance(exc, FileNotFoundError):
                message += f" ({GONE_FILE_HINT})"
            raise TokenFileUnreadable(message) from None
        source, missing = f"the token file {path}", f"the token file {path} is empty"
    else:
        raw = environ.get(TOKEN_VAR, "")
        source = TOKEN_VAR
        missing = f"no token: pass --token-file FILE or set {TOKEN_VAR} (never on the command line)"
    try:
        return token_bytes(raw)
    except EmptyToken:
        raise ValueError(missing) from None
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
