"""Agent sessions at scale, the suite's size: 20 scripted agents in one process, one execd each.

The same code as ``python -m bench.agents --sessions 200``: every session
launches, runs its turns concurrently with the others, closes (the marker
cleanup kills the process each one left in the background), and afterwards no
process carrying the run's marker prefix is left on the machine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.agents import AgentsConfig, processes_mentioning, run_agents

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SESSIONS = 20


def test_twenty_concurrent_agent_sessions_complete_and_leave_nothing(tmp_path: Path) -> None:
    config = AgentsConfig(sessions=SESSIONS, think=0.05, lease=30.0, start_timeout=180.0)
    report = asyncio.run(run_agents(config, str(tmp_path)))
    assert report.problems == []
    assert report.ok
    assert len(report.launch_s) == len(report.run_s) == len(report.close_s) == SESSIONS
    assert report.tool_calls == SESSIONS * 6
    assert report.killed_at_close == SESSIONS  # each session's background sleep
    assert report.leftover == []
    assert processes_mentioning(report.tag) == []
    assert list(tmp_path.iterdir()) == []
