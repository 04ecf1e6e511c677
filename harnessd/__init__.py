"""harnessd: the harness side: client library, launcher, agent loop and ledger sync."""

from harnessd.api import ExecdClient, RunningCommand, connect
from harnessd.launcher import Session, serve
from harnessd.runtime import CommandPrefixRuntime, LocalRuntime, Runtime

__all__ = [
    "CommandPrefixRuntime",
    "ExecdClient",
    "LocalRuntime",
    "RunningCommand",
    "Runtime",
    "Session",
    "connect",
    "serve",
]
