"""bench.codec runs end to end and reports every workload in every mode."""

from __future__ import annotations

import pytest

from bench import codec


def test_quick_run_returns_a_row_per_workload(capsys: pytest.CaptureFixture[str]) -> None:
    rows = codec.main(["--quick"])
    assert [row.workload for row in rows] == [w.name for w in codec.workloads()]
    for row in rows:
        assert set(row.values) == set(codec.MODES)
        assert all(value > 0 for value in row.values.values())
        assert row.ratio(codec.BASELINE) == pytest.approx(1.0)
    assert {row.unit for row in rows} == {"µs/msg", "MB/s"}
    out = capsys.readouterr().out
    assert "| workload | unit |" in out
    for row in rows:
        assert f"| {row.workload} | {row.unit} |" in out


@pytest.mark.parametrize("workload", codec.workloads(), ids=lambda w: w.name)
@pytest.mark.parametrize("mode", codec.MODES)
def test_every_path_round_trips(workload: codec.Workload, mode: str) -> None:
    path = codec.make_path(workload, mode)
    path()
