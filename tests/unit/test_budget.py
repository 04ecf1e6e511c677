"""execd.budget: what peers can make execd hold, in total and per connection, within its rlimits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from execd import budget
from execd.config import Limits
from execd.errors import LimitExceeded, ProcessLimit

SPEC = Path(__file__).resolve().parents[2] / "protocol" / "PROTOCOL.md"
LIMITS = Limits(
    max_processes=5,
    max_processes_per_connection=2,
    max_open_files=6,
    max_open_files_per_connection=4,
)


def test_processes_are_held_to_the_total_and_to_each_connections_share() -> None:
    processes = budget.processes(LIMITS)
    first = [processes.take(1), processes.take(1)]
    with pytest.raises(ProcessLimit) as caught:
        processes.take(1)
    assert caught.value.data == {"limit": 2, "scope": "connection"}
    more = [processes.take(2), processes.take(None), processes.take(None)]
    assert processes.used == 5
    with pytest.raises(ProcessLimit) as caught:
        processes.take(3)  # a connection that holds nothing meets the total
    assert caught.value.data == {"limit": 5}
    first[0]()
    first[0]()  # giving back twice gives back once
    assert processes.used == 4 and processes.held_by(1) == 1
    processes.take(3)
    for give_back in (first[1], *more):
        give_back()
    assert processes.used == 1 and processes.held_by(1) == 0


def test_open_files_count_descriptors_and_refuse_with_limit_exceeded() -> None:
    files = budget.open_files(LIMITS)
    write = files.take(7, 2)
    files.take(7, 2)
    with pytest.raises(LimitExceeded) as caught:
        files.take(7, 1)
    assert caught.value.data == {"limit": 4, "scope": "connection"}
    files.take(8, 2)
    with pytest.raises(LimitExceeded):
        files.take(9, 1)
    write()
    files.take(9, 2)
    assert files.used == 6


def test_the_spec_states_the_defaults_and_the_descriptor_bound_they_give() -> None:
    text = SPEC.read_text(encoding="utf-8").split("### 18.1", 1)[1]
    defaults = Limits()
    for option, field in (
        ("--max-processes", "max_processes"),
        ("--max-processes-per-connection", "max_processes_per_connection"),
        ("--max-open-files", "max_open_files"),
        ("--max-open-files-per-connection", "max_open_files_per_connection"),
        ("--max-connections", "max_connections"),
        ("--max-inflight", "max_inflight_calls"),
    ):
        assert re.search(rf"`{option}` \({getattr(defaults, field)}\)", text), option
    assert f"({budget.descriptor_bound(defaults)} with the defaults)" in text
    assert f"`--idle-timeout` ({defaults.idle_timeout:g} s" in text


def _fitted_under(nofile: int) -> dict[str, int]:
    """The bounds execd starts with when its hard RLIMIT_NOFILE is ``nofile`` (a subprocess)."""
    code = (
        "import resource, msgspec\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))\n"
        "from execd.budget import descriptor_bound, fit_process_limits\n"
        "from execd.config import Limits\n"
        "limits = fit_process_limits(Limits())\n"
        "soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "print(descriptor_bound(limits), soft, limits.max_connections, limits.max_processes,\n"
        "      limits.max_open_files, limits.max_processes_per_connection)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    names = ("bound", "soft", "connections", "processes", "open_files", "per_connection")
    return dict(zip(names, map(int, done.stdout.split()), strict=True))


def test_bounds_shrink_to_a_low_descriptor_limit_and_the_soft_limit_rises_to_them() -> None:
    low = _fitted_under(1024)
    assert low["bound"] <= low["soft"] <= 1024
    assert 0 < low["processes"] < Limits().max_processes
    assert low["per_connection"] <= low["processes"]
    high = _fitted_under(budget.descriptor_bound(Limits()) + 100)
    assert high["soft"] >= high["bound"] == budget.descriptor_bound(Limits())
    assert high["processes"] == Limits().max_processes
