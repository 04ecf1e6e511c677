"""The verifiers integration is an optional extra: importing harnessd never imports it."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import harnessd
import harnessd.launcher, harnessd.runtime, harnessd.api, harnessd.agent
loaded = sorted(m for m in sys.modules if m == "verifiers" or m.startswith(("verifiers.", "harnessd.verifiers")))
print(",".join(loaded))
"""


def test_importing_harnessd_does_not_import_verifiers() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == ""
