"""Parse a vLLM server log: periodic stats lines, probe noise, start-up facts.

Pure functions on text (no I/O, no database, no HTTP):

- :func:`parse_stats_lines` turns the engine's periodic stats lines into records
  (one per V1 line, one per V0 two-line pair); :func:`parse_stats` also says which
  stats records it dropped and why;
- :func:`is_probe_noise` / :func:`filter_noise` drop successful ``/health``,
  ``/metrics`` and ``/ping`` access-log lines (the orchestrator's own probes);
- :func:`startup_facts` reads KV cache size, maximum concurrency, memory figures,
  vLLM version and init time from the start-up lines.
- :func:`error_lines` / :func:`scan_error_lines` (from :mod:`jobs.signals.errorlines`) keep a
  log's meaningful error lines (tracebacks, exception lines and their messages, records
  that say a process died), the lines an engine error carries (:mod:`jobs.engine.server`).

A vLLM log record is found *anywhere* in a line, so whatever a container runtime
(ISO timestamp), Ray or vLLM's multiprocessing (``(APIServer pid=1)``,
``(EngineCore_DP0 pid=7)``, ``(RayWorkerWrapper pid=9, ip=10.0.0.2)``) puts before
it is skipped (the tag gives ``source``, ``pid``, ``node_ip``), and numbers are read
from the start of each value, so a suffix a log aggregator appends (`` [k8s
pod=x]``) is ignored; a Docker json-file line (``{"log": "INFO ...\\n", "stream":
"stdout", "time": "..."}``) is decoded to its ``log`` text first
(:func:`jobs.signals.logrecords.decode_line`). A request logger's record (a prompt or a model
output, ``vllm/entrypoints/serve/utils/request_logger.py``) is never read as stats,
nor is anything quoted inside it. The record header is vLLM's default format
``LEVEL MM-DD HH:MM:SS [file.py:line] message`` (old versions: ``file.py:line]``
without the opening bracket). Records are split by :mod:`jobs.signals.logrecords`: two
records glued on one physical line are read each on its own; a record wrapped over
several lines is rejoined when that is unambiguous, else dropped with a note; Ray's
``[repeated Nx across cluster]`` marks a record's values as merged across processes.
Every known field's value must have the shape vLLM prints (``N reqs``, ``x.y
tokens/s``, ``x.y%``): a value that does not is absent with a note, never guessed.

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
(:mod:`jobs.signals.enginemetrics`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from jobs.signals.errorlines import error_lines, scan_error_lines
from jobs.signals.logrecords import ACCESS_RE, is_access_line, split_records
from jobs.signals.statsreader import StatsReader

__all__ = [
    "STATS_KEYS",
    "STARTUP_KEYS",
    "error_lines",
    "filter_noise",
    "is_access_line",
    "is_probe_noise",
    "StatsParse",
    "parse_stats",
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
    "process": "str, the innermost '(... pid=N ...)' tag before the record, e.g. "
    "'APIServer pid=1' (absent when none)",
    "source": "str, the process or Ray actor name of that tag, e.g. 'APIServer', "
    "'RayWorkerWrapper' (absent when the tag has none)",
    "pid": "int, the pid of that tag",
    "node_ip": "str, the 'ip=' of a Ray tag '(Name pid=N, ip=A.B.C.D)' (absent when none)",
    "repeat_count": "int N of Ray's '[repeated Nx across cluster]' suffix: Ray printed this "
    "line for N other lines of other processes that differ only in their numbers",
    "merged_across_processes": "True with repeat_count: the values are one process's of "
    "several (Ray's dedup keeps the latest), not one engine's figures",
    "notes": "list[str], why a field is absent (unreadable, logged twice) or that the "
    "record was rejoined from wrapped lines (absent when none)",
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

# --- stats records ----------------------------------------------------------------


@dataclass
class StatsParse:
    """:func:`parse_stats`'s answer: ``records`` (as :func:`parse_stats_lines`),
    ``notes``, one per stats record dropped or fragment ignored (``{"line": 1-based
    line, "timestamp": "MM-DD HH:MM:SS" | None, "note": text}``), and ``lines``: the
    1-based physical line each record starts on."""

    records: list[dict[str, Any]]
    notes: list[dict[str, Any]]
    lines: list[int]


def parse_stats(text: str) -> StatsParse:
    """The stats records of ``text`` and notes on what could not be read.

    Records are split with :func:`jobs.signals.logrecords.split_records` (records glued on
    one line are read each on its own). A stats record whose message is cut (a
    required field missing, or its last field incomplete, e.g. ``Running: 32 r``) is
    **rejoined** with the physical lines after it when they carry no record header and
    no other process's tag and the join reads as a complete stats message; otherwise
    it is **dropped** with a note (never kept with half its fields). A complete record
    followed by a headerless line that carries stats fields (``, Prefix cache hit
    rate: 0.0%``) is joined with it the same way when the join is complete and adds
    fields. A known field whose value cannot be read, or that is logged twice, is
    absent with a note in the record's ``notes``. V0's second line ``Prefix cache hit
    rate: GPU: x%, CPU: y%`` is merged only into the V0 stats record that is the
    previous vLLM record of the same process (``source``, ``pid``, ``node_ip``) from
    the same source file.
    """
    reader = StatsReader(text)
    for rec in split_records(text):
        reader.read(rec)
    return StatsParse(reader.out, reader.notes, reader.out_lines)


def parse_stats_lines(text: str) -> list[dict[str, Any]]:
    """Records of vLLM's periodic stats lines in ``text``, in log order.

    One record per V1 stats line (``Avg prompt throughput: ...``, with or without an
    ``Engine NNN:`` / ``N Engines Aggregated:`` prefix, INFO or DEBUG) and one per V0
    pair: the V0 ``Prefix cache hit rate: GPU: x%, CPU: y%`` line is merged into the
    V0 stats record that is the previous record of the same process. Keys and units
    are those of :data:`STATS_KEYS` (e.g. ``{"timestamp": "05-12 08:01:39", "engine":
    0, "prompt_throughput_tok_s": 5120.4, "running": 24, "waiting": 7,
    "kv_cache_usage_pct": 62.8, "level": "INFO", "process": "APIServer pid=1",
    "source": "APIServer", "pid": 1}``); a field the line does not carry is an absent
    key, except V0's ``prefix_cache_hit_rate_pct`` (None when its second line is
    missing). Unknown ``Name: value`` fields go to ``extra``. Glued, wrapped and
    Ray-deduplicated lines: see :func:`parse_stats` (whose notes this drops). Other
    lines are ignored; never raises on odd input.
    """
    return parse_stats(text).records


# --- probe noise ---------------------------------------------------------------------

_PROBE_PATH_RE = re.compile(r"^/(?:health|metrics|ping)/?(?:\?\S*)?$")
_PROBE_METHODS = frozenset({"GET", "HEAD", "POST"})


def is_probe_noise(line: str) -> bool:
    """True for a *successful* probe access line: ``/health``, ``/metrics``, ``/ping``.

    Matches the uvicorn (and common/combined) access-log shape ``"METHOD /path
    HTTP/x" status`` anywhere in the line, so any prefix or suffix is fine; the path
    may carry a trailing slash or a query string. Only 2xx is noise: a failing probe
    (e.g. ``503``) or a redirect is a signal and is kept. vLLM's own DEBUG ``Called
    check_health.`` line is not an access line and is not noise.
    """
    m = ACCESS_RE.search(line)
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
    for rec in split_records(text):
        if not rec.has_header:
            continue
        msg = rec.message
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
