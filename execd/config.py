"""execd's configuration: identity (marker) and every limit a peer can push on."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_MARKER_VAR = "EXECD_MARKER"
LEDGER_PATH_VAR = "EXECD_LEDGER_DIR"


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on everything an authenticated or unauthenticated peer can grow."""

    max_connections: int = 256
    max_unauthenticated: int = 64
    handshake_timeout: float = 5.0
    max_inflight_calls: int = 1024
    max_processes: int = 512
    max_frame: int = 16 * 1024 * 1024
    stream_window: int = 4 * 1024 * 1024
    output_cap: int = 8 * 1024 * 1024
    detached_ring: int = 1024 * 1024
    detached_retention: float = 3600.0
    max_detached: int = 256
    kill_grace: float = 2.0
    drain_grace: float = 0.2
    max_list_entries: int = 100_000
    max_watches: int = 256
    watch_queue: int = 4096
    max_services: int = 64
    max_sessions: int = 64


@dataclass(frozen=True, slots=True)
class Config:
    """Everything execd needs to know about itself."""

    host: str = "127.0.0.1"
    port: int = 0
    marker: str = ""
    marker_var: str = DEFAULT_MARKER_VAR
    lease: float | None = None
    state_dir: str = ""
    limits: Limits = field(default_factory=Limits)

    @property
    def ledger_dir(self) -> str:
        """Where the session ledgers live (documented; exported to children)."""
        return os.path.join(self.state_dir, "ledger")
