"""The bench's command-line options, light to import (``harnessd`` registers them)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Final

DEFAULT_OUT: Final = Path("bench-results")
"""Relative, so under the directory the bench runs in (never inside an installed package)."""
SECTION_NAMES: Final = (
    "roundtrip",
    "shell",
    "files",
    "watch",
    "start",
    "ledger",
    "memory",
    "turn",
    "scale",
    "model",
    "swerex",
    "ssh",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``python -m bench`` and ``harnessd bench``."""
    parser.add_argument(
        "--quick", action="store_true", help="small counts and sizes: every row in seconds"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output directory (default ./{DEFAULT_OUT}, under the current directory)",
    )
    parser.add_argument("--tmp", default=None, help="scratch directory (default $TMPDIR or /tmp)")
    parser.add_argument(
        "--no-plot", action="store_true", help="do not write bench.png and bench-targets.png"
    )
    parser.add_argument(
        "--sshd",
        default=None,
        metavar="PATH",
        help="the sshd of the OpenSSH section (default: sshd on PATH, else /usr/sbin/sshd)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=SECTION_NAMES,
        help="run only this section (repeatable; the table then has only its rows)",
    )
