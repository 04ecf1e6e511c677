"""What every section gets: the settings, a workspace directory, execd, the raw floor servers."""

from __future__ import annotations

import os
from dataclasses import dataclass

from bench.execd_proc import ExecdProcess
from bench.servers import ServerProcess
from bench.settings import Settings


@dataclass(frozen=True, slots=True)
class Env:
    """Shared by the sections of one run."""

    settings: Settings
    workdir: str
    execd: ExecdProcess
    raw: ServerProcess

    def path(self, name: str) -> str:
        """An absolute path in the workspace directory."""
        return os.path.join(self.workdir, name)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from /proc (0.0 when unavailable)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
