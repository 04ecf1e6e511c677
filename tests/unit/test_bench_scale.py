"""bench.scale: the open loop's arrivals, and what its latency rows are compared with."""

from __future__ import annotations

import itertools
import math
import os
import pathlib
import random
from collections import Counter

import pytest

from bench import scale
from bench.report import link_ratios
from bench.suite import ROW_KEYS


def test_arrivals_are_one_poisson_stream_at_the_rate_spread_over_the_sessions() -> None:
    rate, seconds, sessions = 200.0, 500.0, 10
    calls = list(scale.arrivals(rate, seconds, sessions, random.Random(7)))
    times = [at for at, _ in calls]
    assert times == sorted(times)
    assert times[0] > 0
    assert times[-1] < seconds
    expected = rate * seconds
    # A Poisson count: within four standard deviations of its mean.
    assert abs(len(calls) - expected) < 4 * math.sqrt(expected)
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.02)
    # Exponential gaps: as many below the mean as the law says (1 - 1/e of them).
    below = sum(gap < mean for gap in gaps) / len(gaps)
    assert below == pytest.approx(1 - math.exp(-1), abs=0.01)
    per_session = Counter(index for _, index in calls)
    assert set(per_session) == set(range(sessions))
    share = expected / sessions
    for count in per_session.values():
        assert abs(count - share) < 4 * math.sqrt(share)


def test_arrivals_are_the_same_for_the_same_seed_and_one_session_gets_them_all() -> None:
    first = list(scale.arrivals(100.0, 5.0, 1, random.Random(3)))
    assert first == list(scale.arrivals(100.0, 5.0, 1, random.Random(3)))
    assert {index for _, index in first} == {0}
    assert list(scale.arrivals(100.0, 0.0, 4, random.Random(3))) == []


def _rate(offered: float, p50: float) -> scale.RateFigures:
    return scale.RateFigures(
        offered=offered,
        seconds=8.0,
        calls=int(offered * 8),
        p50_us=p50,
        p99_us=p50 * 4,
        p50_by_kind={kind: p50 for kind in scale.KINDS},
        harness_cpu_us_per_call=400.0,
        cores_used=0.3,
        harness_cores=0.1,
        machine_busy_cores=0.5,
        lag_p99_us=100.0,
    )


def _figures(
    one: list[float],
    many: list[float],
    cores_used: float = 0.3,
    spread: tuple[float, float, float] = (1000.0, 1050.0, 1300.0),
) -> scale.ScaleFigures:
    rates = (100.0, 250.0, 500.0)
    many_figures = [_rate(r, p) for r, p in zip(rates, many, strict=True)]
    for figures in many_figures:
        figures.cores_used = cores_used
    return scale.ScaleFigures(
        sessions=1000,
        execds=20,
        cores=2,
        load_before=(0.5, 0.5, 0.5),
        single_calls=2000,
        single_p50_us=500.0,
        single_p99_us=2000.0,
        single_p50_by_kind={kind: 500.0 for kind in scale.KINDS},
        connect_seconds=0.5,
        reconnect_seconds=[0.5, 0.5],
        rss_before_kib=32000,
        rss_after_kib=41000,
        rss_per_session_kib=9.0,
        fds_before=20,
        fds_after=1020,
        fds_per_session=1.0,
        one=[_rate(r, p) for r, p in zip(rates, one, strict=True)],
        spread=[_rate(r, p) for r, p in zip(rates, spread, strict=True)],
        many=many_figures,
        one_cpu_us_per_call=400.0,
        spread_cpu_us_per_call=410.0,
        many_cpu_us_per_call=420.0,
        idle_cpu_percent=0.03,
        keepalive_interval=5.0,
        keepalive_seconds=25.0,
        keepalive_pings=5000,
        keepalive_cpu_percent=1.1,
        load_after=(0.5, 0.5, 0.5),
        seconds=120.0,
    )


def test_each_rate_is_compared_with_one_session_at_that_rate() -> None:
    rows = scale.rows_from(_figures(one=[800.0, 700.0, 1000.0], many=[1100.0, 1120.0, 1400.0]))
    by_key = {row.key: row for row in rows}
    link_ratios(rows)
    for key, one, many in zip(
        scale.RATE_KEYS, (800.0, 700.0, 1000.0), (1100.0, 1120.0, 1400.0), strict=True
    ):
        alone, row = by_key[f"scale.one_{key}"], by_key[f"scale.open_{key}"]
        assert alone.p50 == one and alone.target is None
        assert row.target is not None
        assert row.target.value == pytest.approx(many / one)
        assert row.target.limit == scale.LATENCY_TARGET
        # Every reference is shown: one session at that rate, one call at a time, and
        # one session per execd at that rate (no target of its own).
        assert row.ratios[f"scale.one_{key}"] == pytest.approx(many / one)
        assert row.ratios["scale.latency_single"] == pytest.approx(many / 500.0)
        apart = by_key[f"scale.spread_{key}"]
        assert apart.target is None
        assert row.ratios[f"scale.spread_{key}"] == pytest.approx(many / apart.p50)
        assert apart.ratios[f"scale.one_{key}"] == pytest.approx(apart.p50 / one)
    cpu = by_key["scale.cpu_many"]
    assert cpu.ratios == {
        "scale.cpu_one": pytest.approx(420 / 400),
        "scale.cpu_spread": pytest.approx(420 / 410),
    }
    met = [row.target.met for row in rows if row.key.startswith("scale.open_") and row.target]
    assert met == [True, False, True]
    assert [row.key for row in rows] == [key for key in ROW_KEYS if key.startswith("scale.")]


def test_no_latency_target_at_a_rate_that_took_half_the_cores() -> None:
    rows = scale.rows_from(_figures(one=[800.0] * 3, many=[900.0] * 3, cores_used=1.0))
    assert all(row.target is None for row in rows if row.key.startswith("scale.open_"))


def test_every_session_writes_over_a_file_that_is_there_before_the_open_loop(
    tmp_path: pathlib.Path,
) -> None:
    # One session's phase overwrites one file; a thousand sessions must not
    # create theirs instead (a filesystem cost, not the harness's).
    paths = [str(tmp_path / f"s{i}.dat") for i in range(5)]
    scale._write_inputs(paths)
    for path in paths:
        assert os.path.getsize(path) == scale.PAYLOAD
        assert os.path.getsize(path + scale.OUTPUT_SUFFIX) == scale.PAYLOAD
    assert sorted(os.listdir(tmp_path)) == sorted(
        name for path in paths for name in (os.path.basename(path), os.path.basename(path) + ".out")
    )
