"""The load generator's own stalls: how late its event loop ran while it measured.

Every time the load generator takes (a request's start, each streamed chunk's arrival)
is read on its event loop. When that loop cannot run (the process stopped, starved of
CPU by the engine beside it, a long garbage collection, swapped out), the chunks that
arrive meanwhile are timed when it runs again, and no new request goes out: the
latencies of those requests and the phase's pace then measure the client, not the
server. Nothing in the records says so by itself (the same gap comes from a slow engine
step), so :class:`LoopWatch` measures it directly: a task on the same loop that wakes
every :data:`TICK_S` seconds and notes each wake-up at least :data:`STALL_S` late as a
stall ``(a, b]`` on the records' clock (``a`` when it was due, ``b`` when it ran).

Which requests a stall moved: a chunk that arrived while the loop could not run is timed
once the loop runs again, at the end of the stall or just after it (the watch's late
timer and the backlog of reads share the iterations after ``b``: a trial timed every
request in flight through a 3 s stop 0.4-6 ms after ``b``). A request is *moved* when it
was sent before the stall ended and its first token or its last chunk was timed in
``(a, b +`` :data:`CATCH_UP_S` ``]``, with the stall at least :data:`STALL_SHARE` of its
TTFT or E2EL long (chunks in between move its ITL, not its TTFT or E2EL). A stall that
only delayed a request's start moved the pace, not that request's latency (its clock
starts when it is sent).

:func:`stall_metrics` gives the run's numbers (``client_stall_s``,
``max_client_stall_ms``, ``client_stalled_requests``, ``client_stalled_request_fraction``);
:func:`stall_reason` the rule that makes them matter, applied to a capacity step here and
to a run by :func:`orchestrator.analysis.trust.client_stalled` (the same rule and
thresholds: jobs imports nothing of ours): the loop lost :data:`LOST_S` or more in all,
and the stalls took :data:`STALLED_TIME` of the measured phase (its pace), or moved
:data:`STALLED_REQUESTS` of the measured requests and at least
:data:`MIN_STALLED_REQUESTS` (a central percentile or a mean can move), or one of them
lasted :data:`LONG_STALL_S` or more and moved a request (a tail off by a second or more).
Less than :data:`LOST_S` in all is stored and shown, never flagged: a shared machine
takes a tenth of a second from a process here and there, and requests lasting
milliseconds (a stub engine's, a test's) would be "moved" by every one of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # jobs.schemas imports the capacity search, which imports this module
    from jobs.schemas import RequestRecord

__all__ = [
    "CATCH_UP_S",
    "LONG_STALL_S",
    "LOST_S",
    "MIN_STALLED_REQUESTS",
    "STALLED_REQUESTS",
    "STALLED_TIME",
    "STALL_S",
    "STALL_SHARE",
    "TICK_S",
    "LoopWatch",
    "stall_metrics",
    "stall_reason",
    "step_stall_limit",
]

#: How often the watch wakes (s).
TICK_S = 0.05
#: A wake-up at least this late (s) is a stall: the loop could not run for that long.
STALL_S = 0.1
#: A stall moves a request when it is at least this share of the TTFT (first token
#: timed in it) or the E2EL (last chunk timed in it).
STALL_SHARE = 0.1
#: How long after a stall's end (s) what arrived during it may still be timed (one tick).
CATCH_UP_S = TICK_S
#: Stalls adding up to this share of the measured phase matter (its pace).
STALLED_TIME = 0.05
#: Stalls that moved this share of the measured requests, and at least
#: :data:`MIN_STALLED_REQUESTS` of them, matter (a mean or a central percentile can move).
STALLED_REQUESTS = 0.05
MIN_STALLED_REQUESTS = 2
#: A stall this long (s) that moved a request matters (a tail off by a second or more).
LONG_STALL_S = 1.0
#: Stalls adding up to less than this (s) never matter (module docstring).
LOST_S = 1.0


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


def _moved(record: RequestRecord, stalls: Sequence[tuple[float, float]]) -> bool:
    """Whether a stall moved ``record``'s TTFT or E2EL (module docstring); a request with
    no E2EL (failed) has no latency to move."""
    if record.e2el_s is None:
        return False
    end = record.start_s + record.e2el_s
    ttft = record.ttft_s
    first = None if ttft is None else record.start_s + ttft
    for a, b in stalls:
        if record.start_s >= b:  # sent after it: its clock started after the stall
            continue
        length, until = b - a, b + CATCH_UP_S
        if a < end <= until and length >= STALL_SHARE * record.e2el_s:
            return True
        in_ttft = first is not None and ttft is not None and a < first <= until
        if in_ttft and length >= STALL_SHARE * (ttft or 0.0):
            return True
    return False


def stall_metrics(
    stalls: Sequence[tuple[float, float]], records: Sequence[RequestRecord]
) -> dict[str, float]:
    """The phase's stall numbers; ``{}`` when it had no measured request.

    - ``client_stall_s``: the stalls' summed length (s);
    - ``max_client_stall_ms``: the longest stall (ms; 0 without one);
    - ``client_stalled_requests`` / ``client_stalled_request_fraction``: the measured
      requests a stall moved (:func:`_moved`), as a count and a share of the measured.
    """
    measured = [r for r in records if not r.warmup]
    if not measured:
        return {}
    moved = sum(1 for r in measured if _moved(r, stalls))
    return {
        "client_stall_s": float(sum(b - a for a, b in stalls)),
        "max_client_stall_ms": max((b - a for a, b in stalls), default=0.0) * 1000.0,
        "client_stalled_requests": float(moved),
        "client_stalled_request_fraction": moved / len(measured),
    }


def stall_reason(
    total_s: float, longest_s: float, moved: int, measured: int, phase_s: float | None
) -> str | None:
    """Why stalls make a phase's numbers the client's (module docstring's rule), or None."""
    of_time = total_s / phase_s if phase_s else None
    share = moved / measured if measured else 0.0
    if total_s < LOST_S or not (
        (of_time is not None and of_time >= STALLED_TIME)
        or (share >= STALLED_REQUESTS and moved >= MIN_STALLED_REQUESTS)
        or (longest_s >= LONG_STALL_S and moved >= 1)
    ):
        return None
    time_part = f"; {of_time:.1%} of the measured phase" if of_time is not None else ""
    return (
        f"the load generator stalled: its event loop could not run for {total_s:.2f} s in "
        f"all (longest {longest_s:.2f} s{time_part}), and {moved} of {measured} measured "
        f"requests ({share:.1%}) had their first token or last chunk timed at the end of a "
        "stall of a tenth of that latency or more, so its timings and its pace measured "
        "the client, not the server"
    )


def step_stall_limit(
    stalls: Sequence[tuple[float, float]],
    measured: Sequence[RequestRecord],
    window: tuple[float, float],
) -> str | None:
    """Why a capacity step's load generator, not its server, set its numbers (a
    ``client_limited`` step), or None: :func:`stall_reason` over the stalls inside the
    measured part ``window`` (``(first, last)`` due time or start of the ``measured``)."""
    if not measured:
        return None
    first, last = window
    inside = [(max(a, first), min(b, last)) for a, b in stalls if a < last and b > first]
    moved = sum(1 for r in measured if _moved(r, stalls))
    return stall_reason(
        sum(b - a for a, b in inside),
        max((b - a for a, b in stalls), default=0.0),
        moved,
        len(measured),
        last - first if last > first else None,
    )
