"""Where a campaign's wall time went (issue 25, cost): engine start-ups, warm-ups,
measurement, waiting for devices, from its runs' timestamps and timings.

Per kind, summed over the campaign's runs, in seconds (``timings`` of
:class:`jobs.schemas.RunResult`, written by :func:`orchestrator.runs.service.record_result`):

- ``startup_s``: engine start-ups (``timings["startup_s"]``: start to ``/health``; only a
  run that started its server has one);
- ``warmup_s``, ``measure_s``, ``stop_s``: warm-up requests, the measured phase (or a
  capacity search's steps), stopping the server;
- ``other_s``: the rest of the runs' time on their devices (``timings["total_s"]`` minus
  the above: building request lists, cache resets, an engine start that failed);
- ``lost_s``: runs lost to the infrastructure, claim to end (they have no timings);
- ``queue_wait_s``: waiting for devices: the wall time during which a run of the campaign
  was queued (``created_at`` to ``claimed_at``) while none of its runs held devices
  (claimed and not ended): the wait for devices others held, not for the campaign's own
  runs before it (that is their time, counted in the phases); the runs of a cycle wait
  together, so this is the union of those spans, not their sum;
- ``between_s``: the wall time during which no run of the campaign was queued or going:
  deciding a cycle and queuing the next (the campaigns loop's interval), before the first
  cycle and after the last; with ``queue_wait_s`` and the runs' time on their devices it
  makes up ``elapsed_s`` when the runs go one after another;
- ``elapsed_s``: the campaign's own wall time, from its creation to ``now`` (when the
  result is written: to its end once it ended).

``server_starts`` counts the runs that started a vLLM server
(``engine_info["server_reused"]`` false), ``servers_reused`` those that ran on a server an
earlier run of their batch started.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from orchestrator.core.models import Campaign, Run
from orchestrator.core.states import RunStatus, is_terminal
from orchestrator.tuning.run_loss import lost_to_infrastructure

#: Timed phases of a run, by their ``timings`` key.
PHASES = ("startup_s", "warmup_s", "measure_s", "stop_s")


def wall_time(campaign: Campaign, runs: list[Run], now: datetime | None = None) -> dict[str, Any]:
    """The campaign's wall time by kind (see the module docstring), rounded to 0.1 ms."""
    now = now or datetime.now(UTC)
    sums = dict.fromkeys((*PHASES, "other_s", "lost_s"), 0.0)
    for run in runs:
        timings = run.timings or {}
        parts = [_seconds(timings.get(key)) for key in PHASES]
        for key, value in zip(PHASES, parts, strict=True):
            sums[key] += value
        sums["other_s"] += max(0.0, _seconds(timings.get("total_s")) - sum(parts))
        if lost_to_infrastructure(run) and run.claimed_at and run.finished_at:
            sums["lost_s"] += max(0.0, (run.finished_at - run.claimed_at).total_seconds())
    reused = [(run.engine_info or {}).get("server_reused") for run in runs]
    created = campaign.created_at
    elapsed = max(0.0, (now - created).total_seconds()) if created else 0.0
    waits, held = _waits(runs, now), _held(runs, now)
    busy = [(max(a, created), b) for a, b in waits + held if created and b > created]
    return {
        "elapsed_s": round(elapsed, 4),
        "between_s": round(max(0.0, elapsed - _union(busy)), 4),
        "queue_wait_s": round(_union(_minus(waits, held)), 4),
        **{key: round(value, 4) for key, value in sums.items()},
        "server_starts": sum(1 for r in reused if r is False),
        "servers_reused": sum(1 for r in reused if r is True),
    }


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return 0.0
    return max(0.0, float(value))


def _waits(runs: Iterable[Run], now: datetime) -> list[tuple[datetime, datetime]]:
    """Each run's wait for devices: queued at ``created_at`` until claimed (until now
    while it waits; until it ended when it ended unclaimed, e.g. cancelled)."""
    spans: list[tuple[datetime, datetime]] = []
    for run in runs:
        if run.created_at is None:
            continue
        end = run.claimed_at
        if end is None:
            queued = run.status == RunStatus.QUEUED.value or not is_terminal(run.status)
            end = now if queued else run.finished_at
        if end is not None and end > run.created_at:
            spans.append((run.created_at, end))
    return spans


def _held(runs: Iterable[Run], now: datetime) -> list[tuple[datetime, datetime]]:
    """Each run's time on its devices: claimed until it ended (until now while it runs)."""
    return [
        (run.claimed_at, run.finished_at or now)
        for run in runs
        if run.claimed_at is not None and (run.finished_at or now) > run.claimed_at
    ]


def _minus(
    spans: list[tuple[datetime, datetime]], cut: list[tuple[datetime, datetime]]
) -> list[tuple[datetime, datetime]]:
    """The parts of ``spans`` that no span of ``cut`` covers."""
    out = list(spans)
    for c0, c1 in cut:
        kept: list[tuple[datetime, datetime]] = []
        for s0, s1 in out:
            if c1 <= s0 or c0 >= s1:
                kept.append((s0, s1))
                continue
            if s0 < c0:
                kept.append((s0, c0))
            if c1 < s1:
                kept.append((c1, s1))
        out = kept
    return out


def _union(spans: list[tuple[datetime, datetime]]) -> float:
    """Seconds covered by at least one of ``spans``."""
    total = 0.0
    current: tuple[datetime, datetime] | None = None
    for start, end in sorted(spans):
        if current is None or start > current[1]:
            if current is not None:
                total += (current[1] - current[0]).total_seconds()
            current = (start, end)
        else:
            current = (current[0], max(current[1], end))
    if current is not None:
        total += (current[1] - current[0]).total_seconds()
    return total
