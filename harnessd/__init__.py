"""harnessd: the harness side: client library, launcher, agent loop and ledger sync."""

from harnessd.api import ExecdClient, RunningCommand, connect

__all__ = ["ExecdClient", "RunningCommand", "connect"]
