"""What every section gets: the settings, a workspace directory, execd, the raw floor servers."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from bench.execd_proc import ExecdProcess
from bench.report import Skip
from bench.servers import ServerProcess
from bench.settings import Settings


@dataclass(frozen=True, slots=True)
class Env:
    """Shared by the sections of one run.

    ``skipped`` collects what could not run (the report lists it), ``facts``
    what a section learned about the machine (a baseline's version).
    """

    settings: Settings
    workdir: str
    execd: ExecdProcess
    raw: ServerProcess
    skipped: list[Skip] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)

    def path(self, name: str) -> str:
        """An absolute path in the workspace directory."""
        return os.path.join(self.workdir, name)

    def skip(self, section: str, reason: str) -> None:
        """Record that ``section`` (or a part of it) did not run; say so on stderr too."""
        self.skipped.append(Skip(section, reason))
        print(f"bench: {section}: {reason}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from /proc (0.0 when unavailable)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
