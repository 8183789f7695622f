"""Split an engine log into log records: vLLM's record headers, process tags, Ray's
prefixes and suffixes, record times. Pure functions on text (no I/O).

A **record** is one vLLM log record (``LEVEL MM-DD HH:MM:SS [file.py:line] message``,
or the old ``file.py:line]`` form), or, for a physical line without such a header,
the line itself (a uvicorn access line, a traceback line of a process that died, a
Ray Serve or Ray core record, NCCL's debug output...). :func:`split_records` finds
every header of a physical line, so **two records glued on one line** (two processes
writing to one stream without a newline between them) become two records, each with
its own message, tags and time: a record never takes anything from another one.

What is read around a record:

- **process tags** before the header: vLLM's own ``(EngineCore_DP0 pid=7)`` /
  ``(APIServer pid=1)`` (``vllm/logger.py`` ``_FORMAT``: ``(%(vllm_process_name)s
  pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s``)
  and Ray's driver prefix ``(RayWorkerWrapper pid=9, ip=10.0.0.2)`` (Ray
  ``python/ray/_private/worker.py`` ``print_worker_logs``: ``({actor or task name }
  pid={pid}{, ip={ip} when not the driver's node})``; ``(raylet, ip=...)`` for the
  raylet). ``source`` is the name of the innermost tag (the process that logged),
  ``pid`` its pid, ``node_ip`` the ``ip=`` of any tag.
- **Ray's log deduplication** (``python/ray/_private/ray_logging/__init__.py``,
  ``DedupState.formatted``): ``<line> [repeated Nx across cluster]``, coloured, the
  first time followed by the hint ``(Ray deduplicates logs by default. Set
  RAY_DEDUP_LOGS=0 ...)``. Ray keys the dedup on the line with every word that holds
  a digit removed, and prints the *latest* instance: the numbers of such a line are
  one process's of N, not an engine's. ``repeat_count`` = N; the hint is noise.
- ANSI colour codes (Ray colours its prefixes and the dedup suffix) are removed first.
- **times**: vLLM's record time (``_DATE_FORMAT = "%m-%d %H:%M:%S"``: local time, no
  year, whole seconds); without a vLLM header, a Ray Serve record
  (``LEVEL YYYY-MM-DD HH:MM:SS,mmm component id -- message``,
  ``ray/serve/_private/logging_utils.py`` ``COMPONENT_LOG_FMT``) or Ray core record
  (``YYYY-MM-DD HH:MM:SS,mmm LEVEL file.py:N -- message``) gives a full local time,
  and a container runtime's ISO timestamp before the line
  (``2026-05-12T08:01:39.331Z``) a full UTC one.
- **container log files**: a Docker json-file line (``{"log": "...\\n", "stream":
  "stdout", "time": "..."}``) is decoded to its text first (:func:`decode_line`); CRI's
  ``<ISO time> stdout F <text>`` is read as a prefix.
- **quoted text is no record**: a header right after a quote, or anywhere after the
  start of a request logger record (``Request cmpl-1 details: prompt: '...'``,
  ``Generated response ...: output: '...'``: the user's text, repr'd onto one line), is
  part of that record's message (``absorbed`` counts them), never a record of its own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

__all__ = [
    "ACCESS_RE",
    "LogRecord",
    "continuation",
    "decode_line",
    "dedup_count",
    "is_access_line",
    "leading_tags",
    "number_tail",
    "process_key",
    "split_records",
    "strip_ansi",
]

#: vLLM's record header (new ``[file.py:N]`` and old ``file.py:N]`` forms).
HEADER_RE = re.compile(
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+"
    r"(?P<ts>\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2})(?:[.,]\d+)?\s+"
    r"\[?(?P<src>[^\s\[\]]+:\d+)\]\s*"
)
#: ANSI colour codes, also with the escape byte lost (a log pasted from a terminal keeps
#: ``[36m(RayWorkerVllm pid=5085) [0m``: vllm-project/vllm#2734).
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\[(?:0|1|22|39|3[0-7]|9[0-7])m")
#: Ray's dedup suffix and the one-time hint after it.
_DEDUP_RE = re.compile(
    r"\s*\[repeated (?P<n>\d+)x across cluster\]"
    r"(?:\s*\(Ray deduplicates logs by default\.[^)]*\))?"
)
_HINT_RE = re.compile(r"\s*\(Ray deduplicates logs by default\.[^)]*\)")
#: A process tag: ``(Name pid=N)``, ``(pid=N, ip=A)``, ``(Name pid=N, ip=A)``. Ray's
#: name is the actor's repr, which may hold parentheses (``(my actor (x) pid=5)``): the
#: tag is read by its last ``pid=N[, ip=A])`` part, the name by balanced parentheses.
_PID_TAG = r"\((?:[^()]|\([^()]*\))*?\bpid=\d+(?:,[^()]*)?\)"
_PID_TAG_RE = re.compile(r"\((?P<body>(?:[^()]|\([^()]*\))*?\bpid=(?P<pid>\d+)(?:,[^()]*)?)\)")
#: Ray's tags without a pid: the raylet and the autoscaler.
_RAY_TAG_RE = re.compile(
    r"\((?P<body>(?P<name>raylet|autoscaler(?: \+[\w.]+)?)(?:,\s*ip=[^\s,()]+)?)\)"
)
_IP_RE = re.compile(r"\bip=(?P<ip>[^\s,()]+)")
_ISO_TS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
_CONTAINER_TS_RE = re.compile(_ISO_TS + r"(?:\s+(?:stdout|stderr)\s+[FP])?")
#: What may stand between one glued record's message and the next record's header:
#: container timestamps and process tags (they belong to the next record).
_PREFIX_TAIL_RE = re.compile(
    r"(?:(?:" + _ISO_TS + r")(?:\s+(?:stdout|stderr)\s+[FP])?\s*"
    r"|" + _PID_TAG + r"\s*)+$"
)
#: A headerless line's leading prefixes: container timestamps and process tags.
_LEADING_PREFIX_RE = re.compile(
    r"^(?:\s*(?:" + _ISO_TS + r"(?:\s+(?:stdout|stderr)\s+[FP])?"
    r"|" + _PID_TAG + r"|\((?:raylet|autoscaler(?: \+[\w.]+)?)(?:,\s*ip=[^\s,()]+)?\)))+"
    r"\s*"
)
#: A record of vLLM's request logger (``vllm/entrypoints/serve/utils/request_logger.py``,
#: 0.32: ``Request %s details: prompt: %r, ...`` and ``Request %s JSON body: %s`` at
#: DEBUG, ``Received request %s: params: ...`` and, with ``--enable-log-outputs``,
#: ``Generated response %s%s: output: %r, finish_reason: %s`` at INFO; older
#: ``vllm/entrypoints/logger.py``: ``Received request %s: prompt: %r, ...`` at INFO). Its
#: body is a user's text (repr'd: one physical line): what looks like a record header in
#: it is the user's text, never a record.
_REQUEST_LOG_RE = re.compile(
    r"^(?:Received request \S+?: (?:prompt|params): |Request \S+ (?:details: prompt: |JSON body: )"
    r"|Generated response \S+?(?: \(streaming (?:delta|complete)\))?(?: details)?: output)"
)
#: Docker's json-file log driver: one JSON object per line, the text under ``"log"``.
_JSON_LOG_RE = re.compile(r'^\s*\{.*"log"\s*:', re.DOTALL)
_LEVEL = r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)"
_FULL_TS = r"(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:,\d+)?)"
#: Ray Serve: ``INFO 2025-06-13 15:17:03,182 controller 89848 -- message``.
_RAY_SERVE_RE = re.compile(r"^" + _LEVEL + r"\s+" + _FULL_TS + r"\s+[^\n]*?\s--\s(?P<msg>.*)$")
#: torch / glog (c10): ``[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] msg``:
#: level letter, month (c10 does not pad it: ``E528`` is 05-28), day, local time (no
#: year), as vLLM's record time.
_GLOG_RE = re.compile(
    r"^(?:\[rank\d+\]:)?\[(?P<lvl>[IWEF])(?P<mm>\d{1,2})(?P<dd>\d\d) "
    r"(?P<t>\d\d:\d\d:\d\d)(?:\.\d+)?\s+[^\s\]]+:\d+\]\s?(?P<msg>.*)$"
)
_GLOG_LEVELS = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
#: Ray core: ``2023-07-04 08:55:35,247 INFO utils.py:573 -- message``.
_RAY_CORE_RE = re.compile(r"^" + _FULL_TS + r"\s+" + _LEVEL + r"\s+\S+:\d+\s+--\s(?P<msg>.*)$")


@dataclass
class LogRecord:
    """One record of an engine log.

    ``line``: 0-based index of the physical line it starts on; ``level``: its log
    level (None for a line without any record header); ``time``: the time as logged
    (``"MM-DD HH:MM:SS"`` local, no year, for ``time_kind`` ``"vllm"`` and ``"glog"``;
    ``"YYYY-MM-DD HH:MM:SS,mmm"`` local for ``"ray"``; ISO with zone for
    ``"container"``; None when the line has none); ``src``: vLLM's ``file.py:N``;
    ``message``: the record's text (for a headerless line: the line without its
    leading tags and timestamps);
    ``tags``: the process tags before it (outermost first); ``source``/``pid``/
    ``node_ip``: from the tags; ``repeat_count``: Ray's ``[repeated Nx across
    cluster]`` of its physical line; ``glued``: it shares its physical line with
    another record; ``last_on_line``: nothing follows it on its physical line;
    ``absorbed``: record headers inside its message that were not read as records
    (a request logger's prompt or output quoting a log).
    """

    line: int
    level: str | None
    time: str | None
    time_kind: str | None
    message: str
    src: str | None = None
    tags: list[str] = field(default_factory=list)
    source: str | None = None
    pid: int | None = None
    node_ip: str | None = None
    repeat_count: int | None = None
    glued: bool = False
    last_on_line: bool = True
    absorbed: int = 0

    @property
    def is_request_log(self) -> bool:
        """A record of vLLM's request logger: its message holds a prompt or an output."""
        return self.time_kind == "vllm" and _REQUEST_LOG_RE.match(self.message) is not None

    @property
    def process(self) -> str | None:
        """The innermost ``pid=`` tag as written (``"APIServer pid=1"``), or None."""
        for tag in reversed(self.tags):
            if "pid=" in tag:
                return tag
        return None

    @property
    def has_header(self) -> bool:
        return self.time_kind == "vllm"


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (colours)."""
    return _ANSI_RE.sub("", text) if "[" in text else text


def process_key(rec: LogRecord) -> tuple[str | None, int | None, str | None]:
    """What identifies the process that wrote ``rec``: ``(source, pid, node_ip)``."""
    return rec.source, rec.pid, rec.node_ip


def _tags(prefix: str) -> list[str]:
    """The process tags in ``prefix``, in order (``pid=`` tags and Ray's raylet tags)."""
    found: list[tuple[int, str]] = [
        (m.start(), m.group("body").strip()) for m in _PID_TAG_RE.finditer(prefix)
    ]
    found += [(m.start(), m.group("body").strip()) for m in _RAY_TAG_RE.finditer(prefix)]
    return [body for _, body in sorted(found)]


def _fill_tag_fields(rec: LogRecord) -> None:
    for tag in reversed(rec.tags):
        pids = list(re.finditer(r"\bpid=(\d+)", tag))
        m = pids[-1] if pids else None
        if m is not None and rec.pid is None:
            rec.pid = int(m.group(1))
            name = tag[: m.start()].strip().rstrip(",").strip()
            if name:
                rec.source = name
            break
        if m is None and rec.source is None:  # (raylet, ip=...)
            rec.source = tag.split(",")[0].strip()
            break
    for tag in reversed(rec.tags):
        if ip := _IP_RE.search(tag):
            rec.node_ip = ip.group("ip")
            break


def _container_time(prefix: str) -> str | None:
    m = _CONTAINER_TS_RE.search(prefix)
    return m.group(0).split()[0] if m else None


def _headerless(index: int, line: str, repeat: int | None) -> LogRecord:
    m = _LEADING_PREFIX_RE.match(line)
    prefix = m.group(0) if m else ""
    body = line[len(prefix) :]
    level: str | None = None
    time: str | None = None
    kind: str | None = None
    message = body
    if sm := _RAY_SERVE_RE.match(body) or _RAY_CORE_RE.match(body):
        level, time, kind, message = sm.group("level"), sm.group("ts"), "ray", sm.group("msg")
    elif gm := _GLOG_RE.match(body.strip()):
        level = _GLOG_LEVELS[gm.group("lvl")]
        time, kind = f"{int(gm.group('mm')):02d}-{gm.group('dd')} {gm.group('t')}", "glog"
    elif ct := _container_time(prefix):
        time, kind = ct, "container"
    rec = LogRecord(
        line=index,
        level=level,
        time=time,
        time_kind=kind,
        message=message.rstrip(),
        tags=_tags(prefix),
        repeat_count=repeat,
    )
    _fill_tag_fields(rec)
    return rec


def decode_line(raw: str) -> str:
    """The log line a container runtime's line carries: Docker's json-file driver
    writes ``{"log":"INFO ... \\n","stream":"stdout","time":"2026-05-12T08:01:39.33Z"}``
    (the text under ``log``, the time put in front as a container timestamp); any other
    line is returned as is (CRI's ``<ISO time> stdout F <text>`` is read as a prefix)."""
    if not _JSON_LOG_RE.match(raw):
        return raw
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(obj, dict) or not isinstance(obj.get("log"), str):
        return raw
    text = obj["log"].rstrip("\r\n").replace("\r\n", " ").replace("\n", " ")
    stamp = obj.get("time")
    if isinstance(stamp, str) and re.fullmatch(_ISO_TS, stamp):
        return f"{stamp} {text}"
    return text


#: An opening quote right before a header (``prompt: 'ERROR ...``); a closing one
#: (``model='x'`` then a glued record) is no quote of the header.
_OPEN_QUOTE_RE = re.compile(r"(?:^|[\s:=(\[{,])['\"`]$")


def _headers(line: str) -> tuple[list[re.Match[str]], int]:
    """The record headers of ``line`` that start records, and how many were skipped: a
    header right after an opening quote (``prompt: 'ERROR 01-02 ...``) is quoted text, and every
    header after the start of a request logger record is inside its body."""
    kept: list[re.Match[str]] = []
    skipped = 0
    for h in HEADER_RE.finditer(line):
        if _OPEN_QUOTE_RE.search(line, 0, h.start()):
            skipped += 1
            continue
        if kept and _REQUEST_LOG_RE.match(line[kept[-1].end() :]):
            skipped += 1
            continue
        kept.append(h)
    return kept, skipped


def _split_dedup(line: str) -> tuple[str, int | None]:
    """``line`` (decoded, without ANSI codes) without Ray's ``[repeated Nx across
    cluster]`` suffix, and N (None when it has none)."""
    if "across cluster]" not in line:
        return line, None
    dm = _DEDUP_RE.search(line)
    if dm is None:
        return line, None
    return line[: dm.start()] + line[dm.end() :], int(dm.group("n"))


def split_line(index: int, raw: str) -> list[LogRecord]:
    """The records of one physical line (see :func:`split_records`)."""
    line, repeat = _split_dedup(strip_ansi(decode_line(raw)))
    if "Ray deduplicates logs by default" in line:
        line = _HINT_RE.sub("", line)
    headers, skipped = _headers(line)
    if not headers:
        return [_headerless(index, line, repeat)] if line.strip() else []
    records: list[LogRecord] = []
    prefix = line[: headers[0].start()]
    for k, h in enumerate(headers):
        end = headers[k + 1].start() if k + 1 < len(headers) else len(line)
        message = line[h.end() : end]
        next_prefix = ""
        if k + 1 < len(headers):
            tail = _PREFIX_TAIL_RE.search(message)
            if tail is not None:
                next_prefix = message[tail.start() :]
                message = message[: tail.start()]
        rec = LogRecord(
            line=index,
            level=h.group("level"),
            time=" ".join(h.group("ts").split()),
            time_kind="vllm",
            message=message,
            src=h.group("src"),
            tags=_tags(prefix),
            repeat_count=repeat,
            glued=len(headers) > 1,
            last_on_line=k + 1 == len(headers),
        )
        if rec.is_request_log:
            rec.absorbed = skipped
        _fill_tag_fields(rec)
        records.append(rec)
        prefix = next_prefix
    return records


def split_records(text: str) -> list[LogRecord]:
    """Every record of ``text``, in log order (see the module docstring).

    A physical line with ``k`` vLLM record headers gives ``k`` records (the text a
    glued record's message ends with, when it is a container timestamp or a process
    tag, is the next record's prefix); a non-empty line without one gives one
    headerless record. Never raises on odd input.
    """
    out: list[LogRecord] = []
    for index, raw in enumerate(text.splitlines()):
        out.extend(split_line(index, raw))
    return out


def leading_tags(raw: str) -> list[str]:
    """The process tags at the start of physical line ``raw`` (after any timestamp)."""
    m = _LEADING_PREFIX_RE.match(strip_ansi(decode_line(raw)))
    return _tags(m.group(0)) if m else []


def dedup_count(raw: str) -> int | None:
    """N of Ray's ``[repeated Nx across cluster]`` on physical line ``raw``, or None."""
    if "across cluster]" not in raw:
        return None
    return _split_dedup(strip_ansi(decode_line(raw)))[1]


#: The start of a line that can only be the rest of a number cut by a wrap: digits
#: (and a unit or a closing parenthesis) up to a field separator, a bracket or the end.
_VALUE_TAIL_RE = re.compile(r"^\d[\d.]*(?:\s*(?:%|reqs|tokens/s))?\)?(?=\s*(?:,\s|\[|$))")


def number_tail(rec: LogRecord, lines: list[str], text: str) -> tuple[str, str | None]:
    """How a record whose message ends in a digit (a number a wrap may have cut) ends.

    ``("joined", rest)``: the next physical line continues ``rec`` (see
    :func:`continuation`) and starts with only a number's tail (``2``, ``5.0%``,
    ``1)``): the caller joins ``rest``; ``("cut", None)``: the value may be cut and no
    line says how it goes on: the next line continues ``rec`` with a digit but not as a
    number's tail, or the log ends on this line without a newline (read while it was
    written); ``("whole", None)`` otherwise.
    """
    if not rec.last_on_line:
        return "whole", None
    if rec.line + 1 >= len(lines):
        return ("whole", None) if text.endswith(("\n", "\r")) else ("cut", None)
    rest = continuation(rec, lines[rec.line + 1])
    if rest is None or not rest[:1].isdigit():
        return "whole", None
    return ("joined", rest) if _VALUE_TAIL_RE.match(rest) else ("cut", None)


def continuation(rec: LogRecord, raw: str) -> str | None:
    """The text of physical line ``raw`` as a continuation of ``rec``, or None.

    A wrapped line continues a record when it has no vLLM record header and carries
    no process tag other than ``rec``'s (a log shipper or Ray may repeat the tag or add
    a container timestamp in front of each piece: they are removed, and so is Ray's
    dedup suffix: :func:`dedup_count` reads it).
    """
    line, _ = _split_dedup(strip_ansi(decode_line(raw)))
    if _headers(line)[0]:
        return None
    m = _LEADING_PREFIX_RE.match(line)
    prefix = m.group(0) if m else ""
    tags = _tags(prefix)
    if tags and tags not in (rec.tags[: len(tags)], rec.tags[-len(tags) :]):
        return None
    return line[len(prefix) :]


#: An HTTP access-log entry anywhere in a line (uvicorn, common/combined formats).
ACCESS_RE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+"\s+(?P<status>\d{3})(?!\d)')


def is_access_line(line: str) -> bool:
    """True if ``line`` holds an HTTP access-log entry (``"GET /path HTTP/1.1" 200``)."""
    return ACCESS_RE.search(line) is not None
