"""The load generator's own stalls: how late its event loop ran while it measured.

Every time the load generator takes (a request's start, each streamed chunk's arrival)
is read on its event loop. When that loop cannot run (the process stopped, starved of
CPU by the engine beside it, a long garbage collection, swapped out), the requests in
flight keep their clocks running and no new request goes out: the latencies of those
requests and the phase's throughput then measure the client, not the server. Nothing
in the records says so by itself (the same gap comes from a slow engine step), so
:class:`LoopWatch` measures it directly: a task on the same loop that wakes every
:data:`TICK_S` seconds and notes each wake-up at least :data:`STALL_S` late as a stall
``(start_s, end_s)`` on the records' clock.

:func:`stall_metrics` turns the stalls and the phase's records into the run's numbers
(``client_stall_s``, ``max_client_stall_ms``, ``client_stalled_request_fraction``);
which of them make a run's numbers untrustworthy is
:func:`orchestrator.analysis.trust.run_trust`'s to say (flag ``client_stalled``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # jobs.schemas imports the capacity search, which imports this module
    from jobs.schemas import RequestRecord

__all__ = [
    "STALLED_REQUESTS",
    "STALLED_TIME",
    "STALL_S",
    "STALL_SHARE",
    "TICK_S",
    "LoopWatch",
    "stall_metrics",
    "step_stall_limit",
]

#: How often the watch wakes (s).
TICK_S = 0.05
#: A wake-up at least this late (s) is a stall: the loop could not run for that long.
STALL_S = 0.1
#: A stall moves a request's numbers when it is at least this share of its E2EL (or,
#: overlapping its wait for the first token, of its TTFT).
STALL_SHARE = 0.1
#: A capacity step is ``client_limited`` when its stalls moved this share of its measured
#: requests or took this share of its measured part (:func:`step_stall_limit`): the rule
#: ``orchestrator.analysis.trust.client_stalled`` applies to a run (its
#: ``STALLED_REQUESTS`` and ``STALLED_TIME``; jobs imports nothing of ours).
STALLED_REQUESTS = 0.01
STALLED_TIME = 0.05


class LoopWatch:
    """Stalls of the running event loop, on the clock ``perf_counter() - origin`` (the
    records' ``start_s`` clock when ``origin`` is their ``clock_origin``).

    Start :meth:`run` as a task on the loop that runs the load; cancel it when the load
    ends; read :attr:`stalls`."""

    def __init__(self, origin: float, tick_s: float = TICK_S, stall_s: float = STALL_S) -> None:
        self.origin = origin
        self.tick_s = tick_s
        self.stall_s = stall_s
        self.stalls: list[tuple[float, float]] = []

    async def run(self) -> None:
        due = time.perf_counter() + self.tick_s
        while True:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            now = time.perf_counter()
            if now - due >= self.stall_s:
                self.stalls.append((due - self.origin, now - self.origin))
            due = now + self.tick_s


def _stalled_upon(record: RequestRecord, stalls: Sequence[tuple[float, float]]) -> bool:
    """Whether a stall may have moved ``record``'s numbers by at least
    :data:`STALL_SHARE`: one overlapping its span (its due time in an open loop, else its
    start, to its last chunk) at least that share of its E2EL, or overlapping its TTFT
    (start to first token) at least that share of its TTFT. A request with no E2EL
    (failed) is never: it has no latency to move."""
    if record.e2el_s is None:
        return False
    due = record.scheduled_s
    begin = record.start_s if due is None else min(due, record.start_s)
    end = record.start_s + record.e2el_s
    first = None if record.ttft_s is None else record.start_s + record.ttft_s
    for a, b in stalls:
        if a >= end or b <= begin:
            continue
        length = b - a
        if length >= STALL_SHARE * record.e2el_s:
            return True
        if first is not None and a < first and length >= STALL_SHARE * (record.ttft_s or 0.0):
            return True
    return False


def stall_metrics(
    stalls: Sequence[tuple[float, float]], records: Sequence[RequestRecord]
) -> dict[str, float]:
    """The phase's stall numbers; ``{}`` when it had no measured request.

    - ``client_stall_s``: the stalls' summed length (s);
    - ``max_client_stall_ms``: the longest stall (ms; 0 without one);
    - ``client_stalled_request_fraction``: the share of the measured requests a stall may
      have moved by :data:`STALL_SHARE` of their E2EL or TTFT (:func:`_stalled_upon`).
    """
    measured = [r for r in records if not r.warmup]
    if not measured:
        return {}
    hit = sum(1 for r in measured if _stalled_upon(r, stalls))
    return {
        "client_stall_s": float(sum(end - begin for begin, end in stalls)),
        "max_client_stall_ms": max((end - begin for begin, end in stalls), default=0.0) * 1000.0,
        "client_stalled_request_fraction": hit / len(measured),
    }


def step_stall_limit(
    stalls: Sequence[tuple[float, float]],
    measured: Sequence[RequestRecord],
    window: tuple[float, float],
) -> str | None:
    """Why a capacity step's load generator, not its server, set its numbers (a
    ``client_limited`` step), or None: its stalls inside the measured part ``window``
    (``(first, last)`` due time or start of the ``measured`` requests) moved
    :data:`STALLED_REQUESTS` of them or took :data:`STALLED_TIME` of the window."""
    if not measured:
        return None
    first, last = window
    inside = [(max(a, first), min(b, last)) for a, b in stalls if a < last and b > first]
    total = sum(b - a for a, b in inside)
    share = sum(1 for r in measured if _stalled_upon(r, stalls)) / len(measured)
    of_time = total / (last - first) if last > first else 0.0
    if share < STALLED_REQUESTS and of_time < STALLED_TIME:
        return None
    longest = max((b - a for a, b in stalls), default=0.0)
    return (
        f"the load generator stalled: its event loop could not run for {total:.2f} s of the "
        f"measured part ({of_time:.0%}; longest stall {longest:.2f} s), long enough to move "
        f"{share:.0%} of the measured requests' latencies by a tenth or more"
    )
