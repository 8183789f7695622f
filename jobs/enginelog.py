"""Parse a vLLM server log: periodic stats lines, probe noise, start-up facts.

Pure functions on text (no I/O, no database, no HTTP):

- :func:`parse_stats_lines` turns the engine's periodic stats lines into records
  (one per V1 line, one per V0 two-line pair);
- :func:`is_probe_noise` / :func:`filter_noise` drop successful ``/health``,
  ``/metrics`` and ``/ping`` access-log lines (the orchestrator's own probes);
- :func:`startup_facts` reads KV cache size, maximum concurrency, memory figures,
  vLLM version and init time from the start-up lines.
- :func:`error_lines` / :func:`scan_error_lines` keep a log's meaningful error lines
  (tracebacks, exception lines and their messages, records that say a process died),
  the lines an engine error carries (:mod:`jobs.engine`).

A vLLM log record is found *anywhere* in a line, so whatever a container runtime
(ISO timestamp), Ray or vLLM's multiprocessing (``(APIServer pid=1)``,
``(EngineCore_DP0 pid=7)``, ``(RayWorkerWrapper pid=9, ip=10.0.0.2)``) puts before
it is skipped, and numbers are read from the start of each value, so a suffix a
log aggregator appends (`` [k8s pod=x]``, a JSON tail) is ignored. The record
header is vLLM's default format ``LEVEL MM-DD HH:MM:SS [file.py:line] message``
(old versions: ``file.py:line]`` without the opening bracket).

Wordings, read from vLLM's source:

- V1 (``vllm/v1/metrics/loggers.py``, ``LoggingStatLogger.log``):
  ``[Engine 000: | 2 Engines Aggregated: ]Avg prompt throughput: 0.0 tokens/s,
  Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs,
  [Deferred: N reqs, ][KV fetch: a waiting to start, b in progress, c completed
  waiting, ][Preemptions: N, ]GPU KV cache usage: 0.0%[, Prefix cache hit rate:
  0.0%][, Corrupted: N reqs][, External prefix cache hit rate: x%][, MM cache hit
  rate: x%]``. The device word is ``GPU``, ``CPU``, ``XPU``...; the order and the
  set of optional fields change across versions (older ones put Preemptions
  last). Idle intervals are logged at DEBUG.
- V0 (``vllm/engine/metrics.py``, ``LoggingStatLogger``): ``Avg prompt
  throughput: ..., Avg generation throughput: ..., Running: N reqs, Swapped: N
  reqs, Pending: N reqs, GPU KV cache usage: x%, CPU KV cache usage: y%.`` then,
  when APC is on, a second line ``Prefix cache hit rate: GPU: x%, CPU: y%``.

These numbers are the engine's rolling window: for information and timelines
only. Run-level server-side numbers come from ``/metrics`` deltas
(:mod:`jobs.metrics`).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "STATS_KEYS",
    "STARTUP_KEYS",
    "error_lines",
    "filter_noise",
    "is_access_line",
    "is_probe_noise",
    "parse_stats_lines",
    "scan_error_lines",
    "startup_facts",
]

STATS_KEYS: dict[str, str] = {
    "timestamp": "str, vLLM's own record time 'MM-DD HH:MM:SS' (no year, server local time)",
    "engine": "int engine index (0 when the line has no 'Engine NNN:' prefix, e.g. V0), "
    "or 'aggregated:N' for an 'N Engines Aggregated:' line",
    "prompt_throughput_tok_s": "float, tokens/s of prefill over the logging interval",
    "generation_throughput_tok_s": "float, tokens/s of decode over the logging interval",
    "running": "int, requests in the running batch",
    "waiting": "int, requests queued (V1 'Waiting', V0 'Pending')",
    "swapped": "int, V0 only: requests swapped out to CPU",
    "kv_cache_usage_pct": "float 0-100, device KV cache usage (V1 any device word; V0 GPU)",
    "cpu_kv_cache_usage_pct": "float 0-100, V0 only: CPU swap-space KV cache usage",
    "prefix_cache_hit_rate_pct": "float 0-100, rolling prefix cache hit rate; V1: absent "
    "when not logged (APC off); V0: always present, None without the second line",
    "cpu_prefix_cache_hit_rate_pct": "float 0-100, V0 only, from the second line",
    "preemptions": "int, preemptions in the interval (when logged)",
    "deferred": "int, V1: waiting requests skipped this step (when logged)",
    "corrupted": "int, V1: requests with NaNs in logits (when logged)",
    "external_prefix_cache_hit_rate_pct": "float 0-100, KV connector hits (when logged)",
    "mm_cache_hit_rate_pct": "float 0-100, multimodal cache hits (when logged)",
    "kv_fetch_waiting_to_start": "int, V1 'KV fetch:' field (when logged)",
    "kv_fetch_in_progress": "int, V1 'KV fetch:' field (when logged)",
    "kv_fetch_completed_waiting": "int, V1 'KV fetch:' field (when logged)",
    "level": "str, log level of the record: 'INFO' or 'DEBUG'",
    "process": "str, the '(... pid=N ...)' tag before the record, e.g. 'APIServer pid=1' "
    "(absent when none)",
    "extra": "dict {field name as logged: float | str}, unknown 'Name: value' fields "
    "(absent when none)",
}
"""Keys a stats record may have, with types and units. Absent facts are absent keys."""

STARTUP_KEYS: dict[str, str] = {
    "vllm_version": "str, e.g. '0.32.0'",
    "kv_cache_device": "str, the device word of 'X KV cache size', e.g. 'GPU', 'CPU'",
    "kv_cache_size_tokens": "int, tokens the KV cache holds",
    "max_concurrency": "float, requests of max_concurrency_context_tokens that fit at once",
    "max_concurrency_context_tokens": "int, the per-request length max_concurrency is for",
    "available_kv_cache_memory_gib": "float GiB given to the KV cache (per worker)",
    "model_weights_gib": "float GiB taken by the model weights (per worker)",
    "model_load_time_s": "float seconds to load the model (per worker)",
    "init_engine_time_s": "float seconds of 'init engine (profile, create kv cache, warmup model)'",
    "compilation_time_s": "float seconds of torch.compile within init, when logged",
    "max_model_len": "int, 'Using max model len N'",
    "num_gpu_blocks": "int, V0 '# GPU blocks: N'",
    "num_cpu_blocks": "int, V0 '# CPU blocks: N'",
}
"""Keys :func:`startup_facts` may return. First occurrence in the log wins."""

# --- log record header ---------------------------------------------------------------

_HEADER_RE = re.compile(
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+"
    r"(?P<ts>\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2})(?:[.,]\d+)?\s+"
    r"\[?(?P<src>[^\s\[\]]+:\d+)\]\s*(?P<msg>.*)$"
)
_PROCESS_RE = re.compile(r"\(([^()]*\bpid=\d+[^()]*)\)")


def _record(line: str) -> tuple[str, str, str | None, str] | None:
    """``(level, timestamp, process, message)`` of a vLLM log record in ``line``, or None."""
    m = _HEADER_RE.search(line)
    if m is None:
        return None
    procs = _PROCESS_RE.findall(line, 0, m.start())
    process = procs[-1].strip() if procs else None
    return m.group("level"), " ".join(m.group("ts").split()), process, m.group("msg")


# --- stats lines ---------------------------------------------------------------------

_ENGINE_RE = re.compile(
    r"^(?:Engine\s+(?P<idx>\d+)|(?P<n>\d+)\s+Engines?\s+Aggregated)\s*:\s*", re.IGNORECASE
)
_STATS_START_RE = re.compile(r"^Avg prompt throughput\s*:", re.IGNORECASE)
_V0_HIT_RATE_RE = re.compile(r"^Prefix cache hit rate\s*:\s*(?P<rest>.*)$", re.IGNORECASE)
_FIELD_RE = re.compile(r"^(?P<name>[A-Za-z][\w ()/+.#-]*?)\s*:\s*(?P<value>.*)$", re.DOTALL)
_NUM_RE = re.compile(r"^\s*(?P<num>[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?)")
_TRAILING_BRACKETS_RE = re.compile(r"\s+\[[^\[\]]*\]\s*$")
_KV_USAGE_RE = re.compile(r"^(?:(?P<dev>.+?)\s+)?KV cache usage$", re.IGNORECASE)
_HIT_RATE_RE = re.compile(r"^(?:(?P<dev>GPU|CPU|XPU|TPU|HPU)\s+)?prefix cache hit rate$", re.I)
_KV_FETCH_RE = re.compile(
    r"(?P<a>\d+)\s+waiting to start,\s*(?P<b>\d+)\s+in progress,\s*(?P<c>\d+)\s+completed",
    re.IGNORECASE,
)

_FLOAT_FIELDS = {
    "avg prompt throughput": "prompt_throughput_tok_s",
    "avg generation throughput": "generation_throughput_tok_s",
    "external prefix cache hit rate": "external_prefix_cache_hit_rate_pct",
    "mm cache hit rate": "mm_cache_hit_rate_pct",
}
_INT_FIELDS = {
    "running": "running",
    "waiting": "waiting",
    "pending": "waiting",
    "swapped": "swapped",
    "preemptions": "preemptions",
    "deferred": "deferred",
    "corrupted": "corrupted",
}


def _number(value: str) -> float | None:
    m = _NUM_RE.match(value)
    return float(m.group("num").replace(",", "")) if m else None


def _split_fields(body: str) -> list[tuple[str, str]]:
    """``[(name, raw value)]`` of a ``Name: value, Name: value`` message.

    Pieces after ``, `` that do not start a ``Name:`` (e.g. ``2 in progress``) belong
    to the previous value.
    """
    body = body.strip()
    while True:  # aggregator suffixes like " [k8s pod=x]"
        stripped = _TRAILING_BRACKETS_RE.sub("", body)
        if stripped == body:
            break
        body = stripped
    fields: list[tuple[str, str]] = []
    for piece in re.split(r",\s+", body):
        m = _FIELD_RE.match(piece)
        if m and not piece[:1].isdigit():
            fields.append((m.group("name").strip(), m.group("value")))
        elif fields:
            name, value = fields[-1]
            fields[-1] = (name, f"{value}, {piece}")
    return fields


def _stats_record(level: str, ts: str, process: str | None, msg: str) -> dict[str, Any] | None:
    engine: int | str = 0
    m = _ENGINE_RE.match(msg)
    if m:
        engine = int(m.group("idx")) if m.group("idx") else f"aggregated:{int(m.group('n'))}"
        msg = msg[m.end() :]
    if not _STATS_START_RE.match(msg):
        return None
    fields = _split_fields(msg)
    names = {name.lower() for name, _ in fields}
    usage_devices = [
        (um.group("dev") or "").upper() for name, _ in fields if (um := _KV_USAGE_RE.match(name))
    ]
    is_v0 = bool({"swapped", "pending"} & names) or (
        "GPU" in usage_devices and len(usage_devices) > 1
    )

    rec: dict[str, Any] = {"timestamp": ts, "engine": engine}
    extra: dict[str, float | str] = {}
    for name, raw in fields:
        key = " ".join(name.lower().split())
        num = _number(raw)
        if key in _FLOAT_FIELDS and num is not None:
            rec[_FLOAT_FIELDS[key]] = num
        elif key in _INT_FIELDS and num is not None:
            rec[_INT_FIELDS[key]] = int(num)
        elif (um := _KV_USAGE_RE.match(key)) and num is not None:
            dev = (um.group("dev") or "").upper()
            cpu_swap = is_v0 and dev == "CPU"
            rec["cpu_kv_cache_usage_pct" if cpu_swap else "kv_cache_usage_pct"] = num
        elif (hm := _HIT_RATE_RE.match(key)) and num is not None:
            cpu = is_v0 and (hm.group("dev") or "").upper() == "CPU"
            rec["cpu_prefix_cache_hit_rate_pct" if cpu else "prefix_cache_hit_rate_pct"] = num
        elif key == "kv fetch" and (fm := _KV_FETCH_RE.search(raw)):
            rec["kv_fetch_waiting_to_start"] = int(fm.group("a"))
            rec["kv_fetch_in_progress"] = int(fm.group("b"))
            rec["kv_fetch_completed_waiting"] = int(fm.group("c"))
        else:
            extra[name] = num if num is not None else raw.strip().rstrip(".")
    if is_v0:
        rec.setdefault("prefix_cache_hit_rate_pct", None)
    rec["level"] = level
    if process is not None:
        rec["process"] = process
    if extra:
        rec["extra"] = extra
    return rec


def _merge_v0_hit_rate(rec: dict[str, Any], rest: str) -> None:
    """Fill a V0 record from ``GPU: x%, CPU: y%`` (the second V0 line)."""
    for name, raw in _split_fields(rest):
        num = _number(raw)
        if num is None:
            continue
        if name.upper() == "GPU":
            rec["prefix_cache_hit_rate_pct"] = num
        elif name.upper() == "CPU":
            rec["cpu_prefix_cache_hit_rate_pct"] = num


def parse_stats_lines(text: str) -> list[dict[str, Any]]:
    """Records of vLLM's periodic stats lines in ``text``, in log order.

    One record per V1 stats line (``Avg prompt throughput: ...``, with or without an
    ``Engine NNN:`` / ``N Engines Aggregated:`` prefix, INFO or DEBUG) and one per V0
    pair: the V0 ``Prefix cache hit rate: GPU: x%, CPU: y%`` line is merged into the
    preceding V0 stats record of the same process. Keys and units are those of
    :data:`STATS_KEYS` (e.g. ``{"timestamp": "05-12 08:01:39", "engine": 0,
    "prompt_throughput_tok_s": 5120.4, "running": 24, "waiting": 7,
    "kv_cache_usage_pct": 62.8, "level": "INFO", "process": "APIServer pid=1"}``);
    a field the line does not carry is an absent key, except V0's
    ``prefix_cache_hit_rate_pct`` (None when its second line is missing). Unknown
    ``Name: value`` fields go to ``extra``. Other lines are ignored; never raises on
    odd input.
    """
    records: list[dict[str, Any]] = []
    open_v0: dict[str | None, dict[str, Any]] = {}  # process -> V0 record awaiting line 2
    for line in text.splitlines():
        parsed = _record(line)
        if parsed is None:
            continue
        level, ts, process, msg = parsed
        hm = _V0_HIT_RATE_RE.match(msg)
        if hm and re.match(r"\s*GPU\s*:", hm.group("rest"), re.IGNORECASE):
            pending = open_v0.pop(process, None)
            if pending is not None:
                _merge_v0_hit_rate(pending, hm.group("rest"))
            continue
        rec = _stats_record(level, ts, process, msg)
        if rec is None:
            continue
        records.append(rec)
        if "swapped" in rec or "cpu_kv_cache_usage_pct" in rec:
            open_v0[process] = rec
        else:
            open_v0.pop(process, None)
    return records


# --- probe noise ---------------------------------------------------------------------

_ACCESS_RE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+"\s+(?P<status>\d{3})(?!\d)')
_PROBE_PATH_RE = re.compile(r"^/(?:health|metrics|ping)/?(?:\?\S*)?$")
_PROBE_METHODS = frozenset({"GET", "HEAD", "POST"})


def is_access_line(line: str) -> bool:
    """True if ``line`` holds an HTTP access-log entry (``"GET /path HTTP/1.1" 200``)."""
    return _ACCESS_RE.search(line) is not None


def is_probe_noise(line: str) -> bool:
    """True for a *successful* probe access line: ``/health``, ``/metrics``, ``/ping``.

    Matches the uvicorn (and common/combined) access-log shape ``"METHOD /path
    HTTP/x" status`` anywhere in the line, so any prefix or suffix is fine; the path
    may carry a trailing slash or a query string. Only 2xx is noise: a failing probe
    (e.g. ``503``) or a redirect is a signal and is kept. vLLM's own DEBUG ``Called
    check_health.`` line is not an access line and is not noise.
    """
    m = _ACCESS_RE.search(line)
    return bool(
        m
        and m.group("method") in _PROBE_METHODS
        and _PROBE_PATH_RE.match(m.group("path"))
        and m.group("status").startswith("2")
    )


def filter_noise(text: str) -> tuple[str, int]:
    """``(text without probe-noise lines, number of lines dropped)``.

    Line endings of kept lines are preserved; see :func:`is_probe_noise`.
    """
    kept: list[str] = []
    dropped = 0
    for line in text.splitlines(keepends=True):
        if is_probe_noise(line):
            dropped += 1
        else:
            kept.append(line)
    return "".join(kept), dropped


# --- start-up facts ------------------------------------------------------------------

_GIB = r"([\d.]+)\s*GiB"
_STARTUP_PATTERNS: list[tuple[re.Pattern[str], tuple[tuple[str, type], ...]]] = [
    (
        re.compile(r"LLM engine \(v(\d[\w.+-]*)\)"),
        (("vllm_version", str),),
    ),
    (
        re.compile(r"vLLM API server version v?(\d[\w.+-]*)"),
        (("vllm_version", str),),
    ),
    (
        re.compile(r"(?:█|\bvLLM\b).*?\bversion\s+v?(\d+\.\d+[\w.+-]*)"),
        (("vllm_version", str),),
    ),
    (
        re.compile(r"(?:^|\]\s*)(\S.*?)\s+KV cache size:\s*([\d,]+)\s*tokens"),
        (("kv_cache_device", str), ("kv_cache_size_tokens", int)),
    ),
    (
        re.compile(r"Maximum concurrency for\s+([\d,]+)\s+tokens per request:\s*([\d.]+)\s*x"),
        (("max_concurrency_context_tokens", int), ("max_concurrency", float)),
    ),
    (
        re.compile(r"Available KV cache memory:\s*" + _GIB),
        (("available_kv_cache_memory_gib", float),),
    ),
    (
        re.compile(r"(?:Explicitly|Auto) set \(([\d.]+)/[\d.]+\)\s*GiB for KV cache"),
        (("available_kv_cache_memory_gib", float),),
    ),
    (
        re.compile(r"reserved for KV Cache is\s*" + _GIB),
        (("available_kv_cache_memory_gib", float),),
    ),
    (re.compile(r"\bkv_cache_size=" + _GIB), (("available_kv_cache_memory_gib", float),)),
    (
        re.compile(r"Model loading took\s*" + _GIB + r"(?:\s+memory)?\s+and\s+([\d.]+)\s*s"),
        (("model_weights_gib", float), ("model_load_time_s", float)),
    ),
    (re.compile(r"model weights take\s*" + _GIB), (("model_weights_gib", float),)),
    (
        re.compile(r"init engine \([^)]*\) took\s*([\d.]+)\s*s"),
        (("init_engine_time_s", float),),
    ),
    (re.compile(r"\(compilation:\s*([\d.]+)\s*s"), (("compilation_time_s", float),)),
    (re.compile(r"Using max model len\s+(\d+)"), (("max_model_len", int),)),
    (re.compile(r"# GPU blocks:\s*(\d+)", re.IGNORECASE), (("num_gpu_blocks", int),)),
    (re.compile(r"# CPU blocks:\s*(\d+)", re.IGNORECASE), (("num_cpu_blocks", int),)),
]


def startup_facts(text: str) -> dict[str, Any]:
    """Facts vLLM logs at start-up, keyed as in :data:`STARTUP_KEYS`.

    Reads the V1 wordings (``vllm/v1/core/kv_cache_utils.py``: ``GPU KV cache size:
    2,097,152 tokens, Maximum concurrency for 2,048 tokens per request: 1024.00x``,
    on one line or, in older V1, on two; ``vllm/v1/engine/core.py``: ``init engine
    (profile, create kv cache, warmup model) took 16.13 s``; ``Available KV cache
    memory: 11.03 GiB``; ``Model loading took 14.99 GiB [memory] and 5.1 seconds``;
    CPU worker ``Explicitly set (1.0/23.54) GiB for KV cache``) and the V0 ones
    (memory profiling ``model weights take`` / ``reserved for KV Cache is``,
    ``# GPU blocks``, ``# CPU blocks``). Only vLLM log records are read (the
    ``LEVEL MM-DD HH:MM:SS [file:line]`` header), with any prefix. The first
    occurrence of each fact wins (per-worker figures are those of the first
    worker that logged). Absent facts are absent keys: ``{}`` for a log without
    start-up lines.

    Example: ``{"vllm_version": "0.32.0", "kv_cache_device": "CPU",
    "kv_cache_size_tokens": 4194304, "max_concurrency": 2048.0,
    "max_concurrency_context_tokens": 2048, "init_engine_time_s": 16.13, ...}``.
    """
    facts: dict[str, Any] = {}
    for line in text.splitlines():
        parsed = _record(line)
        if parsed is None:
            continue
        msg = parsed[3]
        for pattern, targets in _STARTUP_PATTERNS:
            if all(key in facts for key, _ in targets):
                continue
            m = pattern.search(msg)
            if m is None:
                continue
            for (key, typ), raw in zip(targets, m.groups(), strict=True):
                if key in facts:
                    continue
                value = raw.strip()
                facts[key] = typ(value.replace(",", "")) if typ is not str else value
    return facts


# --- error lines ---------------------------------------------------------------------

_ERROR_MARKERS = re.compile(
    r"Traceback|Error|ERROR|Exception|CRITICAL|FATAL|Killed|error:|Not enough|not enough"
)
#: "(EngineCore pid=12) " worker prefixes vLLM puts before child-process lines.
_LOG_PREFIX = re.compile(r"^(\(\w+(?: \w+)* pid=\d+\)\s*)+")
#: The last line of a traceback: "pkg.SomeError: message" (or bare name).
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b")
#: A log record's start: "INFO 11-29 ...", "WARNING ...", "[2026-..." or "2026-11-29 ...".
_LOG_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b|^\[|^\d{4}-\d\d-\d\d")
#: At most this many lines after an exception line are kept as its message.
_EXC_MESSAGE_LINES = 12
#: A record logged below ERROR ("WARNING ...", "INFO: ..."): an error line only if it says
#: a process died or a resource ran out (vLLM's "engine core exited unexpectedly"), never
#: for the word "error" alone (vLLM's start-up warning "Found ulimit ... failed to
#: automatically increase with error ..." is no error of the engine).
_LOW_LEVEL_RECORD = re.compile(r"^(DEBUG|INFO|WARNING)\b")
_STRONG_WORDS = re.compile(
    r"died|exited unexpectedly|[Kk]illed|[Ff]atal|FATAL|CRITICAL|out of memory|"
    r"[Ss]egmentation fault|[Nn]ot enough"
)


def scan_error_lines(text: str, n: int = 60) -> tuple[list[str], bool]:
    """The last ``n`` meaningful lines of an engine log, and whether any is an error line.

    Meaningful: every line of a traceback (from ``Traceback`` to its exception
    line, and the message lines right after it up to the next log record:
    pydantic prints the field name and its error there) and lines that mention
    an error, except records logged below ``ERROR`` (``WARNING``, ``INFO``...)
    that do not say a process died or a resource ran out; if there are none, the last ``n``
    non-empty lines. Progress bars (carriage-return rewrites) are reduced to
    their last state.
    """
    lines = [ln.rsplit("\r", 1)[-1].rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    keep: list[str] = []
    first_error: list[str] = []  # the first exception line of the log and its message
    collecting_first = False
    in_tb = False
    after_exc = 0  # lines after an exception line that still belong to its message
    for ln in lines:
        body = _LOG_PREFIX.sub("", ln)
        if after_exc and not _LOG_RECORD.match(body) and not body.startswith("Traceback"):
            keep.append(ln)
            if collecting_first:
                first_error.append(ln)
            after_exc -= 1
            continue
        after_exc = 0
        collecting_first = False
        if body.startswith("Traceback"):
            in_tb = True
        if (
            in_tb
            or (_ERROR_MARKERS.search(ln) and not _LOW_LEVEL_RECORD.match(body))
            or _STRONG_WORDS.search(body)
        ):
            keep.append(ln)
        if _EXC_LINE.match(body):
            in_tb = False
            after_exc = _EXC_MESSAGE_LINES
            if not first_error:
                first_error.append(ln)
                collecting_first = True
    tail = (keep or lines)[-n:]
    if first_error and first_error[0] not in tail:
        # the root cause (often in the engine-core process) scrolled out of the tail
        return [
            "--- first error in the log ---",
            *first_error,
            "--- last error lines ---",
            *tail,
        ], True
    return tail, bool(keep)


def error_lines(text: str, n: int = 60) -> list[str]:
    """The last ``n`` meaningful lines of an engine log; see :func:`scan_error_lines`."""
    return scan_error_lines(text, n)[0]
