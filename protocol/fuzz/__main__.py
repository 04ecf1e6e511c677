"""``python -m protocol.fuzz``: see :mod:`protocol.fuzz.cli`."""

from __future__ import annotations

import sys

from protocol.fuzz.cli import cli

if __name__ == "__main__":
    sys.exit(cli())
