"""``python -m bench``: the whole bench in one run (see :mod:`bench.suite`)."""

from __future__ import annotations

import sys

from bench.suite import main

if __name__ == "__main__":
    sys.exit(main())
