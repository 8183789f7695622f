"""Typed events read out of an engine log, for :mod:`jobs.signals.engineevents`.

The patterns (:data:`_PATTERNS`, in priority order: vLLM's, torch's and Ray's wordings)
and the reading of each record into an event (:func:`parse_events`); what the events
mean, and how they are placed on a run's clock: :mod:`jobs.signals.engineevents`.
"""

from __future__ import annotations

import re
from typing import Any

from jobs.signals.enginelog import StatsParse, parse_stats
from jobs.signals.logrecords import LogRecord, number_tail, split_records

__all__ = ["parse_events"]

_MESSAGE_CHARS = 500
_I = re.IGNORECASE
#: (type, pattern, loose) in priority order: the first that matches a record gives its
#: type. A *loose* pattern is a phrase that harmless records also say ("If you see CUDA
#: out of memory, reduce max_model_len", "no NCCL error reported", a health check
#: counter, "will be restarted on failure by k8s"): it counts only where such failures
#: are written: a line without a log level (a traceback line, Ray's raylet, NCCL's own
#: output), a record logged at ERROR or CRITICAL, or an exception line
#: (``torch.OutOfMemoryError: ...``) at any level. The others are the exact wordings of
#: vLLM, torch and Ray (at whatever level those log them).
_PATTERNS: list[tuple[str, re.Pattern[str], bool]] = [
    (
        "out_of_memory",
        re.compile(r"\b(?:torch\.(?:cuda\.)?|ray\.exceptions\.)?OutOfMemoryError\b"),
        True,
    ),
    (
        "out_of_memory",
        re.compile(r"(?i:\b(?:CUDA|HIP|XPU|NPU|CPU)?\s*(?:error: )?out of memory\b)"),
        True,
    ),
    ("out_of_memory", re.compile(r"No available memory for the cache blocks"), False),
    ("out_of_memory", re.compile(r"larger than the available KV cache memory"), False),
    ("out_of_memory", re.compile(r"exceeds the memory usage threshold"), False),
    ("out_of_memory", re.compile(r"Ray killed this worker"), True),
    ("nccl_error", re.compile(r"Watchdog caught collective operation timeout"), False),
    ("nccl_error", re.compile(r"\bNCCL (?:error|WARN)\b|\bnccl[A-Z]\w*Error\b"), True),
    (
        "nccl_error",
        re.compile(
            r"ProcessGroupNCCL.*(?:[Tt]imeout|[Tt]imed out|[Ee]xception|[Ee]rror|terminated)"
            r"|NCCL operations have failed|NCCL communicator.*(?:abort|error)",
        ),
        True,
    ),
    (
        "gloo_error",
        re.compile(r"Gloo connectFullMesh failed|gloo::(?:EnforceNotMet|IoException)"),
        False,
    ),
    (
        "gloo_error",
        re.compile(
            r"gloo/transport/\w+/\w+\.cc:\d+\].*(?:[Cc]onnection|[Tt]imed out|[Tt]imeout|error)"
            r"|ProcessGroupGloo.*(?:[Ee]rror|[Tt]imed out|fail)"
        ),
        True,
    ),
    ("worker_died", re.compile(r"\bWorker proc \S+ died unexpectedly"), False),
    ("worker_died", re.compile(r"\bRayWorkerProc rank=\S+ died unexpectedly"), False),
    ("worker_died", re.compile(r"\bWorker \S+ pid \d+ died\b"), False),
    ("worker_died", re.compile(r"The actor died unexpectedly|A worker died or was killed"), False),
    (
        "worker_died",
        re.compile(r"\bActorDiedError\b|\bReplica\(.*\) died\b|\bRayActorError\b"),
        False,
    ),
    (
        "engine_dead",
        re.compile(
            r"\b(?:Async|MQLLM)?EngineDeadError\b|EngineCore encountered an issue"
            r"|EngineCore encountered a fatal error|EngineCore failed to start"
            r"|AsyncLLM output_handler failed|Engine core proc \S+ died unexpectedly"
            r"|engine core exited unexpectedly|Engine core process \S+ died unexpectedly"
            r"|Engine core initialization failed|Background loop has errored already"
            r"|\[FT\] Engine \d+ status -> DEAD"
        ),
        False,
    ),
    (
        "unhealthy",
        re.compile(
            r"marking (?:it )?unhealthy|\[FT\] Engine \d+ status -> UNHEALTHY"
            r"|probe found [1-9]\d* unhealthy"
        ),
        False,
    ),
    ("health_check_failed", re.compile(r"Health check for Replica\(.*\) failed"), False),
    ("health_check_failed", re.compile(r"[Hh]ealth check (?:for \S.* )?failed"), True),
    (
        "health_check_failed",
        re.compile(r'"(?:GET|HEAD|POST) /health/?(?:\?\S*)? HTTP/[\d.]+"\s+5\d\d\b'),
        False,
    ),
    ("preemption", re.compile(r"is preempted by PreemptionMode\.(?P<mode>\w+)"), False),
    ("restart", re.compile(r"\[FT\] Engine \d+ status -> HEALTHY"), False),
    (
        "restart",
        re.compile(
            r"\b(?:[Rr]estarting|will be restarted)\b.*\b(?:replica|engine|worker|actor)"
            r"|\b(?:replica|engine|worker|actor)\b.*\b(?:[Rr]estarting|will be restarted)\b"
        ),
        True,
    ),
]
#: Levels at which a loose pattern counts (None: a line without a level).
_LOOSE_LEVELS = frozenset({None, "ERROR", "CRITICAL"})
#: An exception line: ``torch.OutOfMemoryError: CUDA out of memory. ...``.
_EXCEPTION_LINE_RE = re.compile(r"^\s*[A-Za-z_][\w.]*(?:Error|Exception)\b:?")
#: A record that only mentions a word of a pattern while saying all is well.
_NOT_EVENTS = re.compile(
    r"\bNCCL INFO\b|passed the health check|Waiting for pending NCCL work"
    r"|to avoid (?:CUDA )?out of memory|may cause out of memory|\bpossible out of memory",
    _I,
)
#: vLLM's engine core received a stop signal (``v1/engine/core.py``, ``signal_handler``):
#: ``[shutdown] EngineCore: trigger received signal=SIGTERM``.
_STOP_TRIGGER_RE = re.compile(r"\[shutdown\] EngineCore: trigger received signal=SIG(?:TERM|INT)\b")
#: What a stop makes happen on purpose: the engine and its workers going away
#: (``AsyncLLM output_handler failed.``, ``EngineDeadError``, ``engine core exited
#: unexpectedly``, a worker that died) is no event once vlab's stop reached the engine.
_STOPPED_TYPES = frozenset({"engine_dead", "worker_died"})
_EXIT_CODE_RE = re.compile(r"exit code:?\s*(-?\d+)")
_CUMULATIVE_RE = re.compile(r"total_num_cumulative_preemption=(\d+)")


#: A word every pattern needs: one cheap search rejects the lines that are no event.
_ANY_RE = re.compile(
    r"OutOfMemory|(?i:out of memory)|memory for the cache|KV cache memory|memory usage thr"
    r"|Ray killed|NCCL|nccl|Gloo|gloo|died|Dead|DEAD|fatal error|failed to start"
    r"|output_handler|exited unexpectedly|initialization failed|errored|unhealthy|UNHEALTHY"
    r"|ealth check|/health|preempted|HEALTHY|estart|Watchdog caught|Died|RayActorError"
    r"|encountered an issue"
)


def _event_type(rec: LogRecord) -> tuple[str, re.Match[str]] | None:
    msg = rec.message
    # a request logger's record holds a user's prompt or a model's output: no event
    if rec.is_request_log or not _ANY_RE.search(msg) or _NOT_EVENTS.search(msg):
        return None
    loose_ok = rec.level in _LOOSE_LEVELS or _EXCEPTION_LINE_RE.match(msg) is not None
    for kind, pattern, loose in _PATTERNS:
        if loose and not loose_ok:
            continue
        if m := pattern.search(msg):
            return kind, m
    return None


def _remote_local_time(rec: LogRecord) -> bool:
    """``rec``'s time is another node's zone-less local time (a Ray ``ip=`` tag)."""
    return rec.node_ip is not None and rec.time_kind in ("vllm", "glog", "ray")


def _event(rec: LogRecord, kind: str, message: str) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": kind, "time": rec.time}
    if rec.level is not None:
        ev["level"] = rec.level
    for key in ("source", "pid", "node_ip"):
        if getattr(rec, key) is not None:
            ev[key] = getattr(rec, key)
    ev["message"] = message.strip()[:_MESSAGE_CHARS]
    ev["line"] = rec.line + 1
    if rec.repeat_count is not None:
        ev["repeat_count"] = rec.repeat_count
        ev["merged_across_processes"] = True
    return ev


def _whole_message(rec: LogRecord, lines: list[str], text: str) -> tuple[str, bool, list[str]]:
    """``rec``'s message with a number a wrap cut at its end joined again (``exit code:
    -1`` + ``1)``), whether its last number may still be cut, and notes on either."""
    msg = rec.message
    if not msg.rstrip().rstrip(")")[-1:].isdigit():
        return msg, False, []
    state, rest = number_tail(rec, lines, text)
    if state == "joined" and rest is not None:
        return msg + rest, False, ["rejoined from 2 physical lines (wrapped)"]
    return msg, state == "cut", []


def _details(kind: str, m: re.Match[str], msg: str, cut: bool, notes: list[str]) -> dict[str, Any]:
    """The figures an event's message states (``details``); a number that ends a line a
    wrap may have cut is left out with a note added to ``notes``."""
    details: dict[str, Any] = {}
    wanted: list[tuple[str, re.Match[str] | None]] = []
    if kind == "preemption":
        details["preemption_mode"] = m.group("mode")
        wanted.append(("cumulative_preemptions", _CUMULATIVE_RE.search(msg)))
    if kind in ("worker_died", "engine_dead"):
        wanted.append(("exit_code", _EXIT_CODE_RE.search(msg)))
    for figure, found_number in wanted:
        if found_number is None:
            continue
        if cut and not msg[found_number.end() :].strip(" )"):
            notes.append(f"{figure}: the number ends the line and may be cut: absent")
            continue
        details[figure] = int(found_number.group(1))
    return details


def parse_events(
    text: str, stats: StatsParse | None = None, stop_line: int | None = None
) -> list[dict[str, Any]]:
    """The events of an engine log, in log order, keyed as in
    :data:`jobs.signals.engineevents.EVENT_KEYS` (before placement: no ``t_s``).

    One event per record that matches a pattern (the first type in the priority
    order of the module docstring: ``out_of_memory``, ``nccl_error``, ``gloo_error``,
    ``worker_died``, ``engine_dead``, ``unhealthy``, ``health_check_failed``,
    ``preemption``, ``restart``), plus one ``preemption`` per stats record with
    ``Preemptions: N`` > 0 (:func:`jobs.signals.enginelog.parse_stats`, or ``stats`` when given:
    a cut record gives none).
    The same event of the same process at the same time with the same message (a
    traceback printed twice, chained exceptions) is one event with ``count``. An event
    without a time carries the time of the last timed record before it as
    ``after_time`` (for :func:`place_events`), and so does an event with another
    node's local time (a Ray ``ip=`` tag): ``after_time`` is then the last time of this
    host's records before it. Never raises on odd input.

    ``stop_line``: the 1-based physical line from which the log was written after vlab
    asked the engine to stop (SIGTERM to its process group when vlab is done with the
    server: after its last run, or once a run failed or was cancelled); None when
    ``text`` holds no such stop. Once the engine core logs that it received that signal
    (``[shutdown] EngineCore: trigger received signal=SIGTERM``, at or after
    ``stop_line``), what its orderly shutdown logs next (``AsyncLLM output_handler
    failed.`` and the ``EngineDeadError`` traceback, a worker gone) is no
    ``engine_dead`` or ``worker_died`` event: vlab stopped the engine, it did not die.
    Events stay events when vlab was not stopping the engine (``stop_line`` None, or a
    trigger before it: someone else's signal during the run, which lost its engine) and
    when vlab's stop found the engine core gone (no trigger after ``stop_line``).

    Example: ``{"type": "out_of_memory", "time": "05-12 08:01:39", "level": "ERROR",
    "source": "EngineCore_DP0", "pid": 7, "message": "torch.OutOfMemoryError: CUDA out
    of memory. Tried to allocate 2.00 GiB ...", "line": 812}``.
    """
    events: list[dict[str, Any]] = []
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    last_time: str | None = None
    lines = text.splitlines()
    stopping = False  # vlab's stop reached the engine core: it is shutting down
    for rec in split_records(text):
        if (
            stop_line is not None
            and not stopping
            and rec.line + 1 >= stop_line
            and _STOP_TRIGGER_RE.search(rec.message)
        ):
            stopping = True
        found = _event_type(rec)
        if found is not None and stopping and found[0] in _STOPPED_TYPES:
            found = None
        if found is not None:
            kind, m = found
            msg, cut, notes = _whole_message(rec, lines, text)
            ev = _event(rec, kind, msg)
            details = _details(kind, m, msg, cut, notes)
            if details:
                ev["details"] = details
            if notes:
                ev["notes"] = notes
            if (rec.time is None or _remote_local_time(rec)) and last_time is not None:
                ev["after_time"] = last_time
            key = (kind, rec.source, rec.pid, rec.node_ip, rec.time, ev["message"][:200])
            prev = seen.get(key)
            if prev is not None and (rec.time is not None or events[-1] is prev):
                prev["count"] = prev.get("count", 1) + 1
            else:
                seen[key] = ev
                events.append(ev)
        if rec.time is not None and not _remote_local_time(rec):
            last_time = rec.time
    stats_events = _stats_preemptions(stats if stats is not None else parse_stats(text))
    if stats_events:
        events = sorted([*events, *stats_events], key=lambda e: e["line"])
    return events


def _stats_preemptions(stats: StatsParse) -> list[dict[str, Any]]:
    """A ``preemption`` event per stats record that counted preemptions in its interval."""
    stats_events: list[dict[str, Any]] = []
    for srec, line in zip(stats.records, stats.lines, strict=True):
        n = srec.get("preemptions")
        if not n:
            continue
        ev: dict[str, Any] = {
            "type": "preemption",
            "time": srec.get("timestamp"),
            "level": srec.get("level"),
            **{k: srec[k] for k in ("source", "pid", "node_ip") if k in srec},
            "message": f"{n} preemption{'s' if n != 1 else ''} in the stats interval "
            f"(engine {srec.get('engine')})",
            "line": line,
            "details": {"preemptions": n},
        }
        if "repeat_count" in srec:
            ev["repeat_count"] = srec["repeat_count"]
            ev["merged_across_processes"] = True
        stats_events.append(ev)
    return stats_events
