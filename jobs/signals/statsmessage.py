"""One vLLM periodic stats message read field by field (pure, no I/O).

:class:`StatsMessage` reads ``[Engine 000: ]Avg prompt throughput: ..., Running: N reqs,
...`` (V1, ``vllm/v1/metrics/loggers.py``) or V0's first line (``vllm/engine/metrics.py``):
every known field's value must have the shape vLLM prints (``%.1f tokens/s``, ``%d
reqs``, ``%.1f%%``, ``%d``); one that does not is absent with a note, a required field
missing or a cut last value marks the message ``truncated``. :func:`merge_v0_hit_rate`
reads V0's second line. Which physical lines make one message (glued, wrapped, Ray's
tags) is :mod:`jobs.signals.enginelog`'s part (:func:`jobs.signals.enginelog.parse_stats`).
"""

from __future__ import annotations

import math
import re
from typing import Any

ENGINE_RE = re.compile(
    r"^(?:Engine\s+(?P<idx>\d+)|(?P<n>\d+)\s+Engines?\s+Aggregated)\s*:\s*", re.IGNORECASE
)
_STATS_START_RE = re.compile(r"^Avg prompt throughput\s*:", re.IGNORECASE)
V0_HIT_RATE_RE = re.compile(r"^Prefix cache hit rate\s*:\s*(?P<rest>GPU\s*:.*)$", re.IGNORECASE)
_FIELD_RE = re.compile(r"^(?P<name>[A-Za-z][\w ()/+.#-]*?)\s*:\s*(?P<value>.*)$", re.DOTALL)
#: vLLM prints ``%.1f`` / ``%d`` / ``%.1f%%``: no sign, no exponent, no inf/nan; a value
#: with one (``-5.0``, ``1e5``, ``1e400``) fails the value shapes below: absent, noted.
_NUM = r"\d+(?:\.\d+)?(?![\d.eE])(?!,\d)"
_NUM_RE = re.compile(r"^\s*(?P<num>" + _NUM + ")", re.ASCII)
_TRAILING_BRACKETS_RE = re.compile(r"\s+\[[^\[\]]*\]\s*$")
_KV_USAGE_RE = re.compile(r"^(?:(?P<dev>.+?)\s+)?KV cache usage$", re.IGNORECASE)
_HIT_RATE_RE = re.compile(r"^(?:(?P<dev>GPU|CPU|XPU|TPU|HPU)\s+)?prefix cache hit rate$", re.I)
_KV_FETCH_RE = re.compile(
    r"^\s*(?P<a>\d+)\s+waiting to start,\s*(?P<b>\d+)\s+in progress,\s*(?P<c>\d+)\s+completed",
    re.IGNORECASE,
)
#: The value each known field must start with (vLLM's format strings): a value cut by
#: a wrap ("32 r", "62.", "310.2 tok") fails it.
_VALUE_RES = {
    "tok_s": re.compile(r"^\s*" + _NUM + r"\s*tokens/s\b", re.ASCII),
    "reqs": re.compile(r"^\s*\d+\s*reqs\b", re.ASCII),
    "count": re.compile(r"^\s*\d+(?![\d.])", re.ASCII),
    "pct": re.compile(r"^\s*" + _NUM + r"\s*%", re.ASCII),
}
#: Known fields: name as logged (lower case) -> (record key, value kind, type).
_KNOWN_FIELDS: dict[str, tuple[str, str, type]] = {
    "avg prompt throughput": ("prompt_throughput_tok_s", "tok_s", float),
    "avg generation throughput": ("generation_throughput_tok_s", "tok_s", float),
    "running": ("running", "reqs", int),
    "waiting": ("waiting", "reqs", int),
    "pending": ("waiting", "reqs", int),
    "swapped": ("swapped", "reqs", int),
    "deferred": ("deferred", "reqs", int),
    "corrupted": ("corrupted", "reqs", int),
    "preemptions": ("preemptions", "count", int),
    "external prefix cache hit rate": ("external_prefix_cache_hit_rate_pct", "pct", float),
    "mm cache hit rate": ("mm_cache_hit_rate_pct", "pct", float),
}
_V1_REQUIRED = (
    "prompt_throughput_tok_s",
    "generation_throughput_tok_s",
    "running",
    "waiting",
    "kv_cache_usage_pct",
)
_V0_REQUIRED = (*_V1_REQUIRED, "swapped", "cpu_kv_cache_usage_pct")
#: A headerless line that carries a stats field: the tail of a wrapped stats record.
FRAGMENT_RE = re.compile(
    r",\s*(?:Avg (?:prompt|generation) throughput|Running|Waiting|Pending|Swapped|Deferred|"
    r"Preemptions|Corrupted|KV fetch|(?:\w+ )?KV cache usage|(?:External |MM |GPU |CPU )?"
    r"(?:prefix )?cache hit rate)\s*:",
    re.IGNORECASE,
)
#: At most this many physical lines are joined to rejoin one wrapped record.
MAX_WRAP_LINES = 8


def _number(value: str) -> float | None:
    m = _NUM_RE.match(value)
    if m is None:
        return None
    num = float(m.group("num"))
    return num if math.isfinite(num) else None


def _pct_ok(num: float) -> bool:
    """A percentage vLLM can print: a hit rate or a usage is 0-100."""
    return 0.0 <= num <= 100.0


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


def _known(name: str, raw: str, is_v0: bool) -> tuple[str, str, type] | None:
    """``(record key, value kind, type)`` of a known field, None for an unknown one."""
    key = " ".join(name.lower().split())
    if key in _KNOWN_FIELDS:
        return _KNOWN_FIELDS[key]
    if um := _KV_USAGE_RE.match(key):
        cpu_swap = is_v0 and (um.group("dev") or "").upper() == "CPU"
        return ("cpu_kv_cache_usage_pct" if cpu_swap else "kv_cache_usage_pct", "pct", float)
    if hm := _HIT_RATE_RE.match(key):
        cpu = is_v0 and (hm.group("dev") or "").upper() == "CPU"
        return (
            "cpu_prefix_cache_hit_rate_pct" if cpu else "prefix_cache_hit_rate_pct",
            "pct",
            float,
        )
    if key == "kv fetch":
        return ("kv_fetch", "kv_fetch", int)
    return None


class StatsMessage:
    """A stats message read field by field: ``rec`` (STATS_KEYS), ``notes`` (fields
    not read) and ``truncated`` (the message looks cut: a required field missing, or
    the last field's value incomplete)."""

    def __init__(self, msg: str) -> None:
        self.rec: dict[str, Any] = {}
        self.notes: list[str] = []
        self.truncated = False
        self.is_stats = False
        #: the last field's name and where it went (a record key, "extra", None: not
        #: read), and whether its value ends in a bare digit (a wrap may have cut it)
        self.last_field: tuple[str, str | None] | None = None
        self.open_end = False
        engine: int | str = 0
        m = ENGINE_RE.match(msg)
        if m:
            engine = int(m.group("idx")) if m.group("idx") else f"aggregated:{int(m.group('n'))}"
            msg = msg[m.end() :]
        if not _STATS_START_RE.match(msg):
            return
        self.is_stats = True
        self.rec["engine"] = engine
        fields = _split_fields(msg)
        names = {" ".join(name.lower().split()) for name, _ in fields}
        usage_devices = [
            (um.group("dev") or "").upper()
            for name, _ in fields
            if (um := _KV_USAGE_RE.match(" ".join(name.split())))
        ]
        self.is_v0 = bool({"swapped", "pending"} & names) or (
            "GPU" in usage_devices and len(usage_devices) > 1
        )
        extra: dict[str, float | str] = {}
        seen: dict[str, str] = {}
        twice: set[str] = set()
        unreadable: set[str] = set()
        for i, (name, raw) in enumerate(fields):
            last = i == len(fields) - 1
            known = _known(name, raw, self.is_v0)
            if last:
                self.last_field = (name, known[0] if known else "extra")
                self.open_end = raw.rstrip()[-1:].isdigit()
            if known is None:
                num = _number(raw)
                extra[name] = num if num is not None else raw.strip().rstrip(".")
                continue
            key = known[0]
            if key in seen:
                twice.add(key)
                continue
            seen[key] = name
            if not self._read(name, raw, known, last):
                unreadable.add(key)
        for key in twice:
            self.rec.pop(key, None)
            self.notes.append(f"{seen[key]!r} logged twice in one record: not read")
        if msg.rstrip().endswith(","):
            self.truncated = True
        required = _V0_REQUIRED if self.is_v0 else _V1_REQUIRED
        missing = [k for k in required if k not in self.rec and k not in twice | unreadable]
        if missing:
            self.truncated = True
            self.notes.append("missing " + ", ".join(missing))
        if self.is_v0:
            self.rec.setdefault("prefix_cache_hit_rate_pct", None)
        if extra:
            self.rec["extra"] = extra

    def _read(self, name: str, raw: str, known: tuple[str, str, Any], last: bool) -> bool:
        """Put a known field's value into :attr:`rec`; False (noted) when it cannot be read."""
        key, kind, typ = known
        if kind == "kv_fetch":
            fm = _KV_FETCH_RE.match(raw)
            if fm is None:
                self._unreadable(name, raw, last)
                return False
            self.rec["kv_fetch_waiting_to_start"] = int(fm.group("a"))
            self.rec["kv_fetch_in_progress"] = int(fm.group("b"))
            self.rec["kv_fetch_completed_waiting"] = int(fm.group("c"))
            return True
        num = _number(raw)
        # a ", piece" without a colon appended to the value: a cut field name
        if num is None or not _VALUE_RES[kind].match(raw) or ", " in raw:
            self._unreadable(name, raw, last)
            return False
        if kind == "pct" and not _pct_ok(num):
            self.notes.append(f"{name!r} out of range ({raw.strip()[:40]!r}): absent")
            return False
        self.rec[key] = typ(num)
        return True

    def drop_last(self, why: str) -> None:
        """Leave the last field out (absent, with a note): its value may be cut."""
        if self.last_field is None:
            return
        name, key = self.last_field
        if key == "extra":
            extra = self.rec.get("extra") or {}
            extra.pop(name, None)
            if not extra:
                self.rec.pop("extra", None)
        elif key is not None:
            self.rec.pop(key, None)
        self.notes.append(f"{name!r} {why}: absent")

    def _unreadable(self, name: str, raw: str, last: bool) -> None:
        if last:
            self.truncated = True
        self.notes.append(f"{name!r} unreadable ({raw.strip()[:40]!r}): absent")

    @property
    def n_fields(self) -> int:
        return sum(1 for k in self.rec if k not in ("engine", "extra"))


def merge_v0_hit_rate(rec: dict[str, Any], rest: str) -> None:
    """Fill a V0 record from ``GPU: x%, CPU: y%`` (the second V0 line). A device named
    twice is read for neither (which is right is unknown); one missing is noted."""
    keys = {"GPU": "prefix_cache_hit_rate_pct", "CPU": "cpu_prefix_cache_hit_rate_pct"}
    fields = _split_fields(rest)
    named = [name.upper() for name, _ in fields]
    notes = rec.setdefault("notes", [])
    for name, raw in fields:
        dev = name.upper()
        if dev in keys and named.count(dev) > 1:
            continue
        num = _number(raw)
        if num is None or not _VALUE_RES["pct"].match(raw) or not _pct_ok(num):
            notes.append(f"second V0 line: {name!r} unreadable ({raw.strip()[:40]!r}): absent")
            continue
        if dev in keys:
            rec[keys[dev]] = num
    for dev, key in keys.items():
        if named.count(dev) > 1:
            if dev == "GPU":
                rec[key] = None  # a V0 record's hit rate is None when unknown
            else:
                rec.pop(key, None)
            notes.append(f"second V0 line: {dev!r} logged twice: not read")
        elif dev not in named:
            notes.append(f"second V0 line: no {dev!r} value (cut?): absent")
    if not notes:
        rec.pop("notes")
