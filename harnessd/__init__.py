"""harnessd: the harness side: client library, launcher, agent loop and ledger sync.

Every exception the library raises is importable from here as well as from
:mod:`harnessd.errors` (``except harnessd.NotFound:``).
"""

from harnessd import errors
from harnessd.api import ExecdClient, RunningCommand, connect
from harnessd.errors import *  # noqa: F403 - every error class is part of the package's API
from harnessd.launcher import Session, serve
from harnessd.opening import Opening
from harnessd.runtime import CommandPrefixRuntime, LocalRuntime, Runtime

__all__ = [
    "CommandPrefixRuntime",
    "ExecdClient",
    "LocalRuntime",
    "Opening",
    "RunningCommand",
    "Runtime",
    "Session",
    "connect",
    "serve",
]
__all__ += errors.__all__
