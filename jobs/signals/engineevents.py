"""Typed events in an engine log, placed on a run's timeline. Pure functions (no I/O).

:func:`parse_events` reads the records of a vLLM server log
(:func:`jobs.signals.logrecords.split_records`: glued records split, process tags, Ray's
prefixes and dedup suffix) and turns the lines that explain a stall or a failure into
events of a small vocabulary, :data:`EVENT_TYPES`; :func:`place_events` puts them on
the run's clock (``t_s``, seconds since the run began, the clock of the run page's
charts) when their time can be mapped, and says ``"unplaced"`` when it cannot;
:func:`segment_events` is what the runner stores for one run of a batch.

Where each wording comes from (vLLM 0.32.0 source unless said otherwise):

- ``out_of_memory``: torch's ``torch.OutOfMemoryError: CUDA out of memory. Tried to
  allocate ...`` (also ``torch.cuda.OutOfMemoryError``, ``CUDA error: out of
  memory``); ``vllm/v1/core/kv_cache_utils.py``: ``No available memory for the cache
  blocks.`` and ``... KV cache is needed, which is larger than the available KV cache
  memory``; Ray's memory monitor (raylet): ``... which exceeds the memory usage
  threshold ... Ray killed this worker`` and ``ray.exceptions.OutOfMemoryError``.
- ``nccl_error``: torch's ProcessGroupNCCL watchdog ``Watchdog caught collective
  operation timeout: WorkNCCL(...)`` (vllm-project/vllm#6042, #2734), ``NCCL error in:
  ...`` / ``ncclUnhandledCudaError`` / ``ncclSystemError``... (vllm-project/vllm#10626,
  #5828), ``NCCL WARN`` lines of ``NCCL_DEBUG``; not ``NCCL INFO`` chatter.
- ``gloo_error``: ``Gloo connectFullMesh failed with [.../gloo/transport/tcp/pair.cc:144]``
  (vllm-project/vllm#6775, gpustack/gpustack#2125), gloo transport errors.
- ``engine_dead``: ``EngineDeadError`` / ``EngineCore encountered an issue``
  (``vllm/v1/engine/exceptions.py``), ``EngineCore encountered a fatal error.`` /
  ``EngineCore failed to start.`` (``v1/engine/core.py``), ``AsyncLLM output_handler
  failed.`` (``v1/engine/async_llm.py``), ``Engine core proc EngineCore_0 died
  unexpectedly, shutting down client.`` (vllm-project/vllm#21728), ``engine core exited
  unexpectedly`` (``v1/engine/core_client.py``), ``Engine core process ... died
  unexpectedly.`` (``v1/utils.py``), ``Engine core initialization failed``
  (``v1/engine/utils.py``), ``[FT] Engine N status -> DEAD``
  (``v1/fault_tolerance/engine_core_sentinel.py``), V0's ``AsyncEngineDeadError``.
  Not once vlab's stop reached the engine: vlab stops the engine (SIGTERM) when it is
  done with the server, and vLLM's orderly shutdown then logs ``[shutdown] EngineCore:
  trigger received signal=SIGTERM`` (``v1/engine/core.py``) followed by ``AsyncLLM
  output_handler failed.`` and the ``EngineDeadError`` traceback: those lines (and a
  ``worker_died`` among them) are no events (:func:`parse_events`' ``stop_line``).
- ``worker_died``: ``Worker proc VllmWorker-1 died unexpectedly (exit code: -9)``
  (``v1/executor/multiproc_executor.py``), ``RayWorkerProc rank=[1] died unexpectedly``
  (``v1/executor/ray_executor_v2.py``), V0 ``Worker VllmWorkerProcess pid 1159 died,
  exit code: -6`` (vllm-project/vllm#6042); Ray's ``The actor died unexpectedly before
  finishing this task`` (``ray/exceptions.py``), ``A worker died or was killed while
  executing a task``, ``ActorDiedError``; Ray Serve's ``Replica(...) died before
  controller could recover it`` (``ray/serve/_private/deployment_state.py``).
- ``unhealthy``: Ray Serve (``deployment_state.py``): ``Replica(...) failed the health
  check 3 times in a row, marking it unhealthy.``, ``Didn't receive health check
  response for replica ... marking it unhealthy.``, ``Actor for Replica(...) crashed,
  marking it unhealthy immediately.``; vLLM ``[FT] Engine 0 status -> UNHEALTHY``,
  ``DPSupervisor probe found 1 unhealthy DP Servers.``
  (``entrypoints/launchers/dp_supervisor.py``).
- ``health_check_failed``: Ray Serve ``Health check for Replica(...) failed: ...``; a
  ``/health`` access line answered 5xx (vLLM answers 503 once the engine is dead,
  ``vllm/entrypoints/serve/instrumentator/health.py``).
- ``preemption``: V0's ``Sequence group 221 is preempted by PreemptionMode.RECOMPUTE
  mode because there is not enough KV cache space. ...
  total_num_cumulative_preemption=101`` (``vllm/core/scheduler.py``,
  GAIR-NLP/LIMO#29); V1 logs no such line: a stats line with ``Preemptions: N``, N > 0
  (``v1/metrics/loggers.py``) is an event with ``details.preemptions`` = N.
- ``restart``: vLLM's fault tolerance ``[FT] Engine 0 status -> HEALTHY`` (recovered);
  lines that say a replica, engine, worker or actor is being restarted.

**Times.** vLLM's record time (and torch's glog time) is local ``MM-DD HH:MM:SS``
without a year, in whole seconds: it is mapped with the wall clock at which the run
began (the engine is the runner's child process: same host clock and time zone), the
year being the one that puts it nearest the run's start; ``t_s`` is then the start of
the logged second minus the run's start (up to 1 s early). A Ray record's full local
time and a container's ISO (UTC) timestamp map exactly. A line without a time (a raw
traceback, an access line) is ``"unplaced"``, with ``after_t_s``: the time of the last
timed record before it, a lower bound. A time more than
:data:`MAX_CLOCK_GAP_S` away from the run's start is not mapped (another host's clock,
another time zone): ``"unplaced"`` with a note, never a guessed offset; so is a
zone-less time of a record Ray tags with ``ip=`` (another node: its clock and zone are
not the runner's), placed after this host's record before it (``after_t_s``). A record
of vLLM's request logger (a prompt, a model output) is never an event, and a phrase that
harmless hints also say (``out of memory``, ``NCCL error``, ``health check failed``,
``restarting``) counts only in a line without a level, at ERROR/CRITICAL, or as an
exception line.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, tzinfo
from typing import Any

from jobs.signals.enginelog import parse_stats
from jobs.signals.eventparse import parse_events

__all__ = [
    "EVENT_KEYS",
    "EVENT_TYPES",
    "CLOCK_SLACK_S",
    "MAX_CLOCK_GAP_S",
    "MAX_EVENTS",
    "parse_events",
    "place_events",
    "segment_events",
    "segment_info",
    "to_epoch",
]

EVENT_TYPES: dict[str, str] = {
    "out_of_memory": "device or host memory ran out: CUDA/torch OOM, no memory left for "
    "the KV cache blocks, Ray's memory monitor killed a worker",
    "nccl_error": "an NCCL collective failed or timed out (torch's NCCL watchdog, NCCL errors)",
    "gloo_error": "a Gloo (CPU collective) connection or operation failed",
    "engine_dead": "vLLM's engine died or stopped serving (EngineDeadError, engine core "
    "process died, output handler failed, fatal error, failed to start); not the shutdown "
    "of an engine vlab stopped after measuring",
    "worker_died": "a worker process, Ray actor or Ray Serve replica died",
    "unhealthy": "a replica, worker or engine was marked unhealthy",
    "health_check_failed": "a health check failed (Ray Serve replica check, /health 5xx)",
    "preemption": "requests were preempted for lack of KV cache space (recomputed or swapped)",
    "restart": "an engine or replica recovered or is being restarted",
}
"""The event types, a stable vocabulary: what each means."""

EVENT_KEYS: dict[str, str] = {
    "type": "str, one of EVENT_TYPES",
    "time": "str, the record's time as logged: 'MM-DD HH:MM:SS' (vLLM, torch: local, no "
    "year), 'YYYY-MM-DD HH:MM:SS,mmm' (Ray: local), ISO with zone (container); None "
    "when the line has none",
    "t_s": "float seconds since the run began (the run page's chart clock; vLLM's whole "
    "seconds: up to 1 s early), None when unplaced (after place_events)",
    "placement": "'placed' or 'unplaced' (after place_events)",
    "after_t_s": "float, unplaced events: t_s of the last timed record before the line "
    "(a lower bound of its time), when that one is placed",
    "placement_note": "str, why a timed event is unplaced",
    "level": "str, the record's log level when it has one",
    "source": "str, the process or Ray actor name of the record's tag",
    "pid": "int, the pid of the record's tag",
    "node_ip": "str, the 'ip=' of a Ray tag",
    "message": "str, the record's message (at most 500 characters)",
    "line": "int, 1-based physical line in the log the event was read from",
    "count": "int, the same event (type, process, time, message) logged this many times",
    "repeat_count": "int, Ray's '[repeated Nx across cluster]' on the line",
    "merged_across_processes": "True with repeat_count: Ray merged N processes' lines",
    "details": "dict of figures the line states, e.g. preemptions, "
    "cumulative_preemptions, preemption_mode, exit_code (a figure a wrap may have cut "
    "is absent, with a note)",
    "notes": "list of str: a line rejoined after a wrap, a figure left out as maybe cut",
}
"""Keys of an event. Unknown facts are absent keys."""

#: A time farther than this from the run's start is not mapped onto its timeline.
MAX_CLOCK_GAP_S = 2 * 86400.0
#: An event placed this much after the log was read is on another clock.
CLOCK_SLACK_S = 60.0
#: Most events kept per run (every non-preemption event first).
MAX_EVENTS = 1000

# --- time ------------------------------------------------------------------------------

_MMDD_RE = re.compile(r"^(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)$")
_FULL_LOCAL_RE = re.compile(r"^(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:,(\d+))?$")
_ISO_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[.,](\d+))?(Z|[+-]\d\d:?\d\d)?$")


def _local_tz(tz: tzinfo | None, t0_epoch: float) -> tzinfo:
    return tz if tz is not None else datetime.fromtimestamp(t0_epoch).astimezone().tzinfo or UTC


def to_epoch(time_text: str, t0_epoch: float, tz: tzinfo | None = None) -> float | None:
    """Epoch seconds of a logged time, or None when it cannot be read.

    ``"MM-DD HH:MM:SS"`` (vLLM, torch: local time without a year) takes the year that
    puts it nearest ``t0_epoch``; ``"YYYY-MM-DD HH:MM:SS[,mmm]"`` (Ray) is local time;
    ISO with ``T`` and a zone (``Z``, ``+02:00``) is absolute (without a zone: local).
    ``tz``: the local time zone of the log's writer (default: this process's).
    """
    text = time_text.strip()
    try:
        if m := _MMDD_RE.match(text):
            mo, d, h, mi, s = (int(g) for g in m.groups())
            zone = _local_tz(tz, t0_epoch)
            year = datetime.fromtimestamp(t0_epoch, zone).year
            best: float | None = None
            for y in (year - 1, year, year + 1):
                try:
                    ts = datetime(y, mo, d, h, mi, s, tzinfo=zone).timestamp()
                except ValueError:  # 02-29 in a year without it
                    continue
                if best is None or abs(ts - t0_epoch) < abs(best - t0_epoch):
                    best = ts
            return best
        if m := _FULL_LOCAL_RE.match(text):
            y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
            frac = float("0." + m.group(7)) if m.group(7) else 0.0
            zone = _local_tz(tz, t0_epoch)
            return datetime(y, mo, d, h, mi, s, tzinfo=zone).timestamp() + frac
        if m := _ISO_RE.match(text):
            base = datetime.fromisoformat(m.group(1))
            frac = float("0." + m.group(2)) if m.group(2) else 0.0
            zone_text = m.group(3)
            if zone_text is None:
                return base.replace(tzinfo=_local_tz(tz, t0_epoch)).timestamp() + frac
            if zone_text == "Z":
                return base.replace(tzinfo=UTC).timestamp() + frac
            sign = 1 if zone_text[0] == "+" else -1
            hh, mm = int(zone_text[1:3]), int(zone_text[-2:])
            offset = sign * (hh * 3600 + mm * 60)
            return base.replace(tzinfo=UTC).timestamp() - offset + frac
    except (ValueError, OverflowError, OSError):
        return None
    return None


def _zone_less(time_text: str) -> bool:
    """A local time without a zone (vLLM's, torch's, Ray's record time)."""
    text = time_text.strip()
    return bool(_MMDD_RE.match(text) or _FULL_LOCAL_RE.match(text))


def place_events(
    events: list[dict[str, Any]],
    t0_epoch: float,
    tz: tzinfo | None = None,
    local_ips: frozenset[str] | set[str] | None = None,
) -> list[dict[str, Any]]:
    """``events`` with ``t_s`` (seconds since ``t0_epoch``, the run's start) and
    ``placement``: ``"placed"`` when the time maps (:func:`to_epoch`) within
    :data:`MAX_CLOCK_GAP_S` of the start, else ``"unplaced"`` (``t_s`` None,
    ``placement_note`` why, ``after_t_s`` from ``after_time`` when that maps).

    A zone-less local time of a record tagged with a Ray ``ip=`` (Ray's driver prefix
    names the ip only for *another* node than the driver's, ``print_worker_logs`` in
    ``ray/_private/worker.py``) is written by another host's clock in its time zone:
    unplaced with a note, unless the ip is one of ``local_ips`` (this host's). An ISO
    time with a zone maps from any node. New dicts; the input is not changed.
    """
    out: list[dict[str, Any]] = []
    for ev in events:
        new = {k: v for k, v in ev.items() if k != "after_time"}
        new["t_s"] = None
        new["placement"] = "unplaced"
        ip = ev.get("node_ip")
        remote = ip is not None and (local_ips is None or ip not in local_ips)
        if ev.get("time") and remote and _zone_less(str(ev["time"])):
            new["placement_note"] = (
                f"time {ev['time']!r} is the local time of node {ip} (another host: its "
                "clock and time zone are unknown here): not placed"
            )
        elif ev.get("time"):
            epoch = to_epoch(str(ev["time"]), t0_epoch, tz)
            if epoch is None:
                new["placement_note"] = f"time {ev['time']!r} not understood"
            elif abs(epoch - t0_epoch) > MAX_CLOCK_GAP_S:
                new["placement_note"] = (
                    f"time {ev['time']!r} is {abs(epoch - t0_epoch) / 3600:.0f} h from the "
                    "run's start (another clock or time zone): not placed"
                )
            else:
                new["t_s"] = round(epoch - t0_epoch, 3)
                new["placement"] = "placed"
        if new["placement"] == "unplaced" and ev.get("after_time"):
            epoch = to_epoch(str(ev["after_time"]), t0_epoch, tz)
            if epoch is not None and abs(epoch - t0_epoch) <= MAX_CLOCK_GAP_S:
                new["after_t_s"] = round(epoch - t0_epoch, 3)
        out.append(new)
    return out


def _cap(events: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most ``limit`` events: all that are not preemptions first, then preemptions
    evenly spaced (first and last kept), in log order."""
    if len(events) <= limit:
        return events
    others = [e for e in events if e["type"] != "preemption"][:limit]
    room = limit - len(others)
    pre = [e for e in events if e["type"] == "preemption"]
    if room > 0 and pre:
        step = (len(pre) - 1) / max(room - 1, 1)
        keep = {round(i * step) for i in range(room)} if room > 1 else {0}
        others += [p for i, p in enumerate(pre) if i in keep]
    return sorted(others, key=lambda e: e["line"])


def segment_events(
    log: str,
    t0_epoch: float,
    duration_s: float,
    *,
    first: bool,
    tz: tzinfo | None = None,
    limit: int = MAX_EVENTS,
    local_ips: frozenset[str] | set[str] | None = None,
    log_end_s: float | None = None,
    stop_line: int | None = None,
) -> dict[str, Any]:
    """The events of one run (segment) of a server's log, for its ``engine_info``.

    ``log``: the server's whole log up to the segment's end; ``t0_epoch``: the wall
    clock when the segment began; ``duration_s``: its length; ``first``: the segment
    started the server (start-up lines belong to it). An event belongs to the segment
    when its logged second overlaps it (``-1 < t_s <= duration_s``: an event in the
    second two segments share is in both); an unplaced one by ``after_t_s`` the same
    way, or, with none (or a time that does not map), to the first segment only.
    No event is silently lost to a wrong clock: the first segment also keeps what is
    placed before its start (the server's start-up: no earlier run exists), and, with
    ``log_end_s`` (seconds since ``t0_epoch`` when ``log`` was read), an event placed
    more than :data:`CLOCK_SLACK_S` after it cannot be on this host's clock: it is kept
    here as ``"unplaced"`` with a note. ``local_ips``: see :func:`place_events`;
    ``stop_line`` (where vlab's stop of the engine begins in ``log``): see
    :func:`parse_events`.

    Returns ``{"events": [...] (at most ``limit``, :data:`EVENT_KEYS`), "summary":
    {"total": n, "kept": k, "by_type": {type: n}, "unplaced": n}, "stats_notes":
    [...]}``: ``stats_notes`` are :func:`jobs.signals.enginelog.parse_stats`'s notes (stats
    records dropped, fragments ignored) of the segment's seconds.
    """
    stats = parse_stats(log)
    placed = place_events(parse_events(log, stats, stop_line), t0_epoch, tz, local_ips)
    mine: list[dict[str, Any]] = []
    for ev in placed:
        at = ev["t_s"] if ev["placement"] == "placed" else ev.get("after_t_s")
        if at is None:  # nothing says when: the server's first run keeps it
            if first:
                mine.append(ev)
        elif log_end_s is not None and at > log_end_s + CLOCK_SLACK_S:
            flagged = {**ev, "t_s": None, "placement": "unplaced"}
            flagged.pop("after_t_s", None)
            flagged["placement_note"] = (
                f"time {ev.get('time')!r} maps to {at:.0f} s after the run's start, later "
                "than the log was read: another clock or time zone: not placed"
            )
            mine.append(flagged)
        elif -1.0 < at <= duration_s or (first and at <= -1.0):
            mine.append(ev)
    by_type: dict[str, int] = {}
    for ev in mine:
        by_type[ev["type"]] = by_type.get(ev["type"], 0) + 1
    kept = _cap(mine, limit)
    notes = []
    for note in stats.notes:
        epoch = to_epoch(note["timestamp"], t0_epoch, tz) if note.get("timestamp") else None
        if (epoch is None and first) or (
            epoch is not None and -1.0 < epoch - t0_epoch <= duration_s
        ):
            notes.append(note)
    return {
        "stats_notes": notes,
        "events": kept,
        "summary": {
            "total": len(mine),
            "kept": len(kept),
            "by_type": by_type,
            "unplaced": sum(1 for e in mine if e["placement"] == "unplaced"),
        },
    }


def segment_info(
    log: str,
    t0_epoch: float,
    duration_s: float,
    first: bool,
    read_at_end: bool = False,
    stop_line: int | None = None,
) -> dict[str, Any]:
    """The ``engine_info`` entries of one run (segment): ``engine_events``,
    ``engine_events_summary`` and, when any, ``stats_notes``; see :func:`segment_events`
    (the local time zone is this process's: the engine is its child; ``read_at_end``:
    ``log`` was read when the segment ended, so it holds nothing later; ``stop_line``:
    the line of ``log`` from which vlab was stopping the engine, see
    :func:`parse_events`)."""
    end = duration_s if read_at_end else None
    found = segment_events(
        log, t0_epoch, duration_s, first=first, log_end_s=end, stop_line=stop_line
    )
    info: dict[str, Any] = {
        "engine_events": found["events"],
        "engine_events_summary": found["summary"],
    }
    if found["stats_notes"]:
        info["stats_notes"] = found["stats_notes"]
    return info
