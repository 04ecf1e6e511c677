"""Process checks shared by the tests."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (or dead)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    # The state follows the parenthesised command name, which may contain spaces.
    return raw[raw.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")
