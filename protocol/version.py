"""The installed version, and the ``--version`` option both command lines take."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from protocol.limits import PROTOCOL_VERSION

DISTRIBUTION = "splitexec"
"""The name the package is installed by."""


def installed_version() -> str:
    """The version of the installed distribution, or ``unknown`` when it is not installed."""
    from importlib import metadata  # on --version only: execd's cold start skips it

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


class VersionAction(argparse.Action):
    """``--version``: print ``PROG VERSION (protocol N)`` on stdout and exit 0."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="print the version and exit",
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> NoReturn:
        print(f"{parser.prog} {installed_version()} (protocol {PROTOCOL_VERSION})")
        sys.stdout.flush()
        parser.exit()
