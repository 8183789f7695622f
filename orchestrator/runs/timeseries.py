"""Downsampling of a run's ``/metrics`` time series for serving.

A run scrapes ``/metrics`` once per second (:mod:`jobs.run.runner`), so an hour-long
run holds 3,600 samples; charts need a few hundred points. :func:`downsample`
splits the ``during`` samples into equal-width time bins and keeps one point
per bin: for a counter the bin's last value (counters only grow, so deltas
between kept points stay exact), for a gauge the bin's maximum (a KV cache
usage or queue peak inside the bin stays visible). The ``before`` and
``after`` samples are always kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jobs.signals.enginemetrics import SAMPLE_KEYS
from jobs.signals.gpus import is_gpu_counter

__all__ = ["Point", "downsample", "is_counter"]


@dataclass(frozen=True)
class Point:
    """One served sample: ``t_s`` seconds since the run began, its phase and values."""

    t_s: float
    phase: str
    values: dict[str, float]


def is_counter(key: str) -> bool:
    """True for a sample key documented as a counter in
    :data:`jobs.signals.enginemetrics.SAMPLE_KEYS`.

    Also for the per-GPU energy counters ``gpu{k}_energy_j``
    (:func:`jobs.signals.gpus.is_gpu_counter`). Unknown keys count as gauges.
    """
    return SAMPLE_KEYS.get(key, "").startswith("counter") or is_gpu_counter(key)


def downsample(samples: Sequence[Any], max_points: int) -> list[Point]:
    """At most ``max_points`` ``during`` points of ``samples``, plus ``before``/``after``.

    Args:
        samples: objects with ``t_s`` (float, s), ``phase`` (str) and ``values``
            (``{key: float}``), in time order (ORM rows or :class:`Point`).
        max_points: the most ``during`` points returned (>= 1).

    Returns:
        Points in time order. When there are no more ``during`` samples than
        ``max_points`` they are returned unchanged; otherwise the ``during``
        span is cut into ``max_points`` equal bins and each non-empty bin
        gives one point at its last sample's time, with counters at their last
        value in the bin and gauges at their maximum.

    Raises:
        ValueError: ``max_points < 1``.
    """
    if max_points < 1:
        raise ValueError("max_points must be >= 1")
    points = [Point(float(s.t_s), str(s.phase), dict(s.values)) for s in samples]
    during = [p for p in points if p.phase == "during"]
    if len(during) <= max_points:
        return points
    t0, t1 = during[0].t_s, during[-1].t_s
    width = (t1 - t0) / max_points or 1.0
    bins: dict[int, list[Point]] = {}
    for p in during:
        bins.setdefault(min(max_points - 1, int((p.t_s - t0) / width)), []).append(p)
    merged: list[Point] = []
    for b in sorted(bins):
        group = bins[b]
        values: dict[str, float] = {}
        for p in group:
            for key, value in p.values.items():
                if is_counter(key) or key not in values:
                    values[key] = value
                else:
                    values[key] = max(values[key], value)
        merged.append(Point(group[-1].t_s, "during", values))
    before = [p for p in points if p.phase == "before"]
    after = [p for p in points if p.phase == "after"]
    return before + merged + after
