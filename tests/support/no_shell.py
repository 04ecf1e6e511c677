"""Run a command where no shell can run: ``python no_shell.py BLANK -- ARGV...``.

Meant to run in a mount namespace of its own (``unshare --mount
--propagation private``, as root): every shell ``/etc/shells`` lists, and
``/bin/sh``, gets the file ``BLANK`` (empty, not executable) bind-mounted over
it, so starting one fails as it would in an image that has none. Then it
checks that ``/bin/sh`` indeed cannot run and execs ``ARGV``. Only the
standard library, and no shell, is used.
"""

from __future__ import annotations

import os
import subprocess
import sys

SHELLS = "/etc/shells"


def shells() -> set[str]:
    """Every shell binary here, by its real path (``/bin/sh`` and what /etc/shells lists)."""
    named = {"/bin/sh"}
    try:
        with open(SHELLS) as listing:
            named |= {line.strip() for line in listing if line.startswith("/")}
    except FileNotFoundError:
        pass
    return {os.path.realpath(path) for path in named if os.path.exists(path)}


def main(argv: list[str]) -> int:
    """Mask the shells with ``argv[0]``, then exec what follows ``--``."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: no_shell.py BLANK -- ARGV...", file=sys.stderr)
        return 2
    blank, command = argv[0], argv[2:]
    for shell in sorted(shells()):
        subprocess.run(["mount", "--bind", blank, shell], check=True)
    if os.access("/bin/sh", os.X_OK):
        print("no_shell.py: /bin/sh can still run", file=sys.stderr)
        return 1
    os.execv(command[0], command)  # noqa: S606 - no shell is the point


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
