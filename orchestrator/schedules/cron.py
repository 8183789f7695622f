"""Cron maths of scheduled sweeps: expressions, time zones and fire times.

A schedule's ``cron`` (5 fields, :mod:`croniter`) is evaluated in its
``timezone`` (IANA, :mod:`zoneinfo`), so fire times follow the wall clock
across DST changes. In a fall-back repeated hour, an expression with a fixed
hour fires once (the first occurrence); with a wildcard hour it fires in both
hours (each is a real hour).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

#: next fire times shown with a schedule
NEXT_FIRES = 5


def check_cron(expr: str) -> str:
    """``expr`` stripped, if it is a valid 5-field cron expression that fires at least
    once; else ValueError."""
    expr = " ".join(expr.split())
    if len(expr.split(" ")) != 5 or not croniter.is_valid(expr):
        raise ValueError(f"invalid cron expression {expr!r}: expected 5 valid fields")
    try:  # valid fields can still name a date that never exists ("0 0 31 2 *")
        croniter(expr, datetime(2026, 1, 1)).get_next(datetime)
    except CroniterBadDateError:
        raise ValueError(f"cron expression {expr!r} never fires (no such date)") from None
    return expr


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; ValueError when unknown."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"unknown time zone {name!r}: use an IANA name") from exc


def _fixed_hour(expr: str) -> bool:
    return "*" not in expr.split(" ")[1]


def _repeat(t: datetime) -> bool:
    """Whether local ``t`` is the second occurrence of an ambiguous (fall-back) wall time."""
    naive = t.replace(tzinfo=None)
    first = naive.replace(tzinfo=t.tzinfo, fold=0)
    return first.utcoffset() != t.utcoffset()


def fire_times(expr: str, tz: ZoneInfo, start: datetime, *, forward: bool) -> Iterator[datetime]:
    """Fire times strictly after (or before) ``start``, tz-aware in ``tz``."""
    it = croniter(expr, start.astimezone(tz))
    skip_repeats = _fixed_hour(expr)
    while True:
        t: datetime = it.get_next(datetime) if forward else it.get_prev(datetime)
        if skip_repeats and _repeat(t):
            continue
        yield t


def next_fire_times(
    expr: str,
    tz_name: str,
    after: datetime,
    count: int = NEXT_FIRES,
    end_at: datetime | None = None,
) -> list[datetime]:
    """The next ``count`` fire times strictly after ``after``, in the zone (offset-aware).

    Times after ``end_at`` are left out (so the list may be shorter).
    """
    out: list[datetime] = []
    for t in fire_times(expr, zone(tz_name), after, forward=True):
        if end_at is not None and t > end_at or len(out) >= count:
            break
        out.append(t)
    return out


def next_fire_at(
    expr: str, tz_name: str, after: datetime, end_at: datetime | None
) -> datetime | None:
    """The first fire time after ``after`` (UTC), or None past ``end_at``."""
    times = next_fire_times(expr, tz_name, after, 1, end_at)
    return times[0].astimezone(UTC) if times else None
