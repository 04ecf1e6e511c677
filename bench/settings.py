"""How much each section measures: the full run and the ``--quick`` run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

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

    @property
    def stream_label(self) -> str:
        """The streamed output size, as a label."""
        return size_label(self.stream_bytes)


def full(tmp_dir: str | None = None) -> Settings:
    """The full run: a few minutes on 2 cores."""
    return Settings(
        quick=False,
        noop_samples=6000,
        noop_samples_slow=1500,
        noop_rounds=12,
        pipelined_calls=20000,
        pipelined_reps=5,
        spawn_samples=600,
        file_sizes=(4 * KIB, MIB, 256 * MIB),
        file_samples=(600, 60, 5),
        watch_samples=400,
        cold_starts=15,
        ledger_sizes=(MIB, 64 * MIB, GIB),
        ledger_samples=300,
        idle_samples=20,
        stream_bytes=GIB,
        turns=30,
        sequential_turns=10,
        tmp_dir=tmp_dir or default_tmp(),
    )


def quick(tmp_dir: str | None = None) -> Settings:
    """The quick run: every row, small counts and sizes, seconds."""
    return Settings(
        quick=True,
        noop_samples=300,
        noop_samples_slow=100,
        noop_rounds=3,
        pipelined_calls=1000,
        pipelined_reps=2,
        spawn_samples=20,
        file_sizes=(4 * KIB, MIB, 16 * MIB),
        file_samples=(20, 5, 2),
        watch_samples=20,
        cold_starts=2,
        ledger_sizes=(MIB, 2 * MIB, 4 * MIB),
        ledger_samples=20,
        idle_samples=3,
        stream_bytes=16 * MIB,
        turns=3,
        sequential_turns=2,
        tmp_dir=tmp_dir or default_tmp(),
    )


def default_tmp() -> str:
    """Where scratch files go: $TMPDIR, else /tmp."""
    return os.environ.get("TMPDIR") or "/tmp"


def size_label(size: int) -> str:
    """``4 KiB``, ``1 MiB``, ``256 MiB``, ``1 GiB``."""
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} B"
