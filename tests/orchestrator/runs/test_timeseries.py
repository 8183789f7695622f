"""Downsampling of the served /metrics time series."""

from __future__ import annotations

import pytest

from orchestrator.runs.timeseries import Point, downsample, is_counter


def _series(n: int) -> list[Point]:
    pts = [Point(0.0, "before", {"prefix_cache_queries": 0.0, "kv_cache_usage": 0.0})]
    for i in range(n):
        usage = 0.9 if i == 37 else 0.1  # one short peak
        pts.append(
            Point(1.0 + i, "during", {"prefix_cache_queries": 10.0 * i, "kv_cache_usage": usage})
        )
    pts.append(Point(2.0 + n, "after", {"prefix_cache_queries": 10.0 * n, "kv_cache_usage": 0.0}))
    return pts


def test_counter_and_gauge_kinds_come_from_the_documented_keys() -> None:
    assert is_counter("prefix_cache_hits") and is_counter("generation_tokens")
    assert not is_counter("kv_cache_usage") and not is_counter("num_requests_waiting")


def test_short_series_is_returned_unchanged() -> None:
    pts = _series(10)
    assert downsample(pts, 100) == pts


def test_long_series_keeps_peaks_counters_and_ends() -> None:
    pts = _series(3600)
    out = downsample(pts, 100)
    during = [p for p in out if p.phase == "during"]
    assert len(during) <= 100
    assert out[0].phase == "before" and out[-1].phase == "after"
    # the one-sample KV peak survives (gauges keep the bin maximum)
    assert max(p.values["kv_cache_usage"] for p in during) == 0.9
    # counters keep the last value of each bin: the final one is the last stored
    assert during[-1].values["prefix_cache_queries"] == 10.0 * 3599
    times = [p.t_s for p in out]
    assert times == sorted(times)
    counters = [p.values["prefix_cache_queries"] for p in during]
    assert counters == sorted(counters)


def test_max_points_must_be_positive() -> None:
    with pytest.raises(ValueError):
        downsample(_series(3), 0)
