"""How much each section measures: the full run and the ``--quick`` run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Final

KIB: Final = 1024
MIB: Final = 1024 * KIB
GIB: Final = 1024 * MIB

HOST: Final = "127.0.0.1"
IN_FLIGHT: Final = 64
LAN_DELAY: Final = 0.0125
TURN_CALLS: Final = 8


@dataclass(frozen=True, slots=True)
class Settings:
    """Counts and sizes of one run."""

    quick: bool
    noop_samples: int
    noop_samples_slow: int
    noop_rounds: int
    pipelined_calls: int
    pipelined_reps: int
    spawn_samples: int
    file_sizes: tuple[int, int, int]
    file_samples: tuple[int, int, int]
    watch_samples: int
    cold_starts: int
    ledger_sizes: tuple[int, int, int]
    ledger_samples: int
    idle_samples: int
    stream_bytes: int
    turns: int
    sequential_turns: int
    tmp_dir: str
    sshd: str | None = None
    """The sshd of the OpenSSH section; None: sshd on PATH, else where Debian puts it."""

    @property
    def stream_label(self) -> str:
        """The streamed output size, as a label."""
        return size_label(self.stream_bytes)


RUNS: Final[dict[str, tuple[Any, Any]]] = {
    # field of Settings: (the full run, the quick run)
    "noop_samples": (6000, 300),
    "noop_samples_slow": (1500, 100),
    "noop_rounds": (12, 3),
    "pipelined_calls": (20000, 1000),
    "pipelined_reps": (5, 2),
    "spawn_samples": (600, 20),
    "file_sizes": ((4 * KIB, MIB, 256 * MIB), (4 * KIB, MIB, 16 * MIB)),
    "file_samples": ((600, 60, 5), (20, 5, 2)),
    "watch_samples": (400, 20),
    "cold_starts": (15, 2),
    "ledger_sizes": ((MIB, 64 * MIB, GIB), (MIB, 2 * MIB, 4 * MIB)),
    "ledger_samples": (300, 20),
    "idle_samples": (20, 3),
    "stream_bytes": (GIB, 16 * MIB),
    "turns": (30, 3),
    "sequential_turns": (10, 2),
}
"""Each count and size of the full run (a few minutes on 2 cores) beside the quick one's
(every row, small counts and sizes, seconds)."""


def full(tmp_dir: str | None = None, sshd: str | None = None) -> Settings:
    """The full run: a few minutes on 2 cores."""
    return _run(False, tmp_dir, sshd)


def quick(tmp_dir: str | None = None, sshd: str | None = None) -> Settings:
    """The quick run: every row, small counts and sizes, seconds."""
    return _run(True, tmp_dir, sshd)


def _run(is_quick: bool, tmp_dir: str | None, sshd: str | None) -> Settings:
    values = {name: pair[is_quick] for name, pair in RUNS.items()}
    return Settings(quick=is_quick, tmp_dir=tmp_dir or default_tmp(), sshd=sshd, **values)


def default_tmp() -> str:
    """Where scratch files go: $TMPDIR, else /tmp."""
    return os.environ.get("TMPDIR") or "/tmp"


def size_label(size: int) -> str:
    """``4 KiB``, ``1 MiB``, ``256 MiB``, ``1 GiB``."""
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} B"
