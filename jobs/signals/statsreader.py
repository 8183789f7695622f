"""Stats records read out of a vLLM log's records, for :func:`jobs.signals.enginelog.parse_stats`.

A cut stats message rejoined with the physical lines after it, or dropped with a note;
a value that may go on on the next line; a complete message joined with the stats
fragments after it; V0's hit-rate line paired with its stats record. What the records
hold and the wordings read: :mod:`jobs.signals.enginelog`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

from jobs.signals.logrecords import (
    LogRecord,
    continuation,
    dedup_count,
    is_access_line,
    leading_tags,
    number_tail,
    process_key,
)
from jobs.signals.statsmessage import (
    ENGINE_RE,
    FRAGMENT_RE,
    MAX_WRAP_LINES,
    V0_HIT_RATE_RE,
    StatsMessage,
    merge_v0_hit_rate,
)

__all__ = ["StatsReader"]

#: V0 logs its two stats lines in one ``log()`` call (``vllm/engine/metrics.py``
#: ``LoggingStatLogger.log``), microseconds apart: the same second. A line of another
#: second is another call's (a pair that crosses a second's edge is lost: unknown,
#: never a neighbour's number).
V0_PAIR_GAP_S = 0


def _seconds(stamp: str | None) -> int | None:
    """Seconds of a ``MM-DD HH:MM:SS`` time within a (leap) year, None if unreadable."""
    m = re.fullmatch(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)", stamp or "")
    if m is None:
        return None
    mo, d, h, mi, s = (int(g) for g in m.groups())
    try:
        day = datetime(2000, mo, d).timetuple().tm_yday
    except ValueError:
        return None
    return ((day * 24 + h) * 60 + mi) * 60 + s


def _within(a: str | None, b: str | None, gap: int) -> bool:
    sa, sb = _seconds(a), _seconds(b)
    return sa is not None and sb is not None and abs(sa - sb) <= gap


def _pair_v0(
    rec: LogRecord,
    prev: tuple[LogRecord, dict[str, Any] | None] | None,
    queue: list[tuple[LogRecord, dict[str, Any]]],
    rest: str,
    note: Callable[[LogRecord, str], None],
) -> None:
    """Merge V0's second line ``rec`` into its stats record: the previous record of the
    same process, from the same file, logged within :data:`V0_PAIR_GAP_S`, and the only
    such V0 record still unpaired (two engines without tags: which is whose is unknown,
    both keep ``None`` with a note). Else the line is ignored with a note."""
    target = prev[1] if prev is not None else None
    same_file = (
        prev is not None and (prev[0].src or "").split(":")[0] == (rec.src or "").split(":")[0]
    )
    if prev is None or target is None or not same_file:
        note(rec, "a V0 'Prefix cache hit rate' line not right after its stats record: ignored")
        return
    if not _within(prev[0].time, rec.time, V0_PAIR_GAP_S):
        note(
            rec,
            "a V0 'Prefix cache hit rate' line logged at another time than the stats "
            f"record before it ({prev[0].time}): ignored",
        )
        return
    candidates = [p for p in queue if _within(p[0].time, rec.time, V0_PAIR_GAP_S)]
    if len(candidates) > 1:
        for _, out_rec in candidates:
            out_rec.setdefault("notes", []).append(
                f"a V0 'Prefix cache hit rate' line follows {len(candidates)} stats records "
                "of the same process tag: which is whose is unknown: absent"
            )
        queue.clear()
        note(
            rec,
            f"a V0 'Prefix cache hit rate' line after {len(candidates)} unpaired stats "
            "records of the same process tag: which one it belongs to is unknown: ignored",
        )
        return
    merge_v0_hit_rate(target, rest)
    if rec.repeat_count is not None:  # the second line was merged across processes
        target["repeat_count"] = max(target.get("repeat_count") or 0, rec.repeat_count)
        target["merged_across_processes"] = True
    queue[:] = [p for p in queue if p[1] is not target]


_STATS_HEAD = "avg prompt throughput:"
_CUT_ENGINE_RE = re.compile(r"(?:Engine(?:\s+\d*)?|\d+(?:\s+Engines?(?:\s+Ag\w*)?)?)", re.I)


def _cut_stats_head(msg: str) -> bool:
    """``msg`` may be the start of a stats message cut before ``Avg prompt throughput:``
    was complete (``Engine 000: Avg prompt thr``): only a join can tell."""
    m = ENGINE_RE.match(msg)
    rest = (msg[m.end() :] if m else msg).strip().lower()
    if m is not None:
        return not rest or _STATS_HEAD.startswith(rest)
    return bool(rest) and (
        _STATS_HEAD.startswith(rest) or _CUT_ENGINE_RE.fullmatch(msg.strip()) is not None
    )


def _rejoin(rec: LogRecord, lines: list[str]) -> tuple[StatsMessage, int] | None:
    """``rec``'s stats message rejoined with the physical lines after it, and how many
    were used: the first join (up to :data:`MAX_WRAP_LINES` lines) that reads as a
    complete stats message, extended by the next lines while they carry stats fields
    (``, Prefix cache hit rate: 0.0%``) and the join stays complete and gains fields.
    None when no join is complete."""
    msg = rec.message
    found: tuple[StatsMessage, int] | None = None
    for j in range(rec.line + 1, min(len(lines), rec.line + 1 + MAX_WRAP_LINES)):
        cont = continuation(rec, lines[j])
        if cont is None or not cont.strip() or is_access_line(cont):
            break
        if found is not None and not FRAGMENT_RE.search(cont):
            break
        msg += cont
        parsed = StatsMessage(msg)
        complete = parsed.is_stats and not parsed.truncated
        if complete and not any("twice" in n for n in parsed.notes):
            if found is not None and parsed.n_fields <= found[0].n_fields:
                break
            found = (parsed, j - rec.line)
        elif found is not None:
            break
    return found


def _repeat_of(rec: LogRecord, lines: list[str], n: int) -> int | None:
    """Ray's dedup count of a record joined with the ``n`` physical lines after it: the
    mark may be on any piece (each physical line is deduplicated on its own)."""
    found = [dedup_count(lines[j]) for j in range(rec.line + 1, rec.line + 1 + n)]
    counts = [c for c in (rec.repeat_count, *found) if c is not None]
    return max(counts) if counts else None


def _with_record_facts(
    rec: LogRecord, stats: StatsMessage, notes: list[str], repeat: int | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"timestamp": rec.time, **stats.rec, "level": rec.level}
    if rec.process is not None:
        out["process"] = rec.process
    for key in ("source", "pid", "node_ip"):
        if getattr(rec, key) is not None:
            out[key] = getattr(rec, key)
    if repeat is not None:
        out["repeat_count"] = repeat
        out["merged_across_processes"] = True
    if notes:
        out["notes"] = notes
    return out


_Read = tuple[StatsMessage, list[str], int | None]  # the message, its notes, Ray's repeat


class StatsReader:
    """:func:`parse_stats` over one text: records and notes so far, lines already joined."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines()
        self.out: list[dict[str, Any]] = []
        self.out_lines: list[int] = []
        self.notes: list[dict[str, Any]] = []
        self.used_lines: set[int] = set()
        self.last: dict[tuple[Any, ...], tuple[LogRecord, dict[str, Any] | None]] = {}
        # V0 stats records not yet paired with their hit-rate line, per process
        self.unpaired: dict[tuple[Any, ...], list[tuple[LogRecord, dict[str, Any]]]] = {}

    def note(self, rec: LogRecord, why: str, line_after: int = 0) -> None:
        line = rec.line + 1 + line_after
        self.notes.append({"line": line, "timestamp": rec.time, "note": why})

    def read(self, rec: LogRecord) -> None:
        """Take one record: a stats record (kept, rejoined or dropped), a V0 hit-rate line,
        or anything else (only a stray stats fragment or a quoting request log is noted)."""
        if not rec.has_header:
            if rec.line not in self.used_lines and FRAGMENT_RE.search(rec.message):
                why = "a line that continues a stats record whose start is not before it"
                self.note(rec, f"{why}: ignored")
            return
        if rec.is_request_log:  # a prompt or an output: the user's text, no stats
            if rec.absorbed:
                self.note(
                    rec,
                    f"{rec.absorbed} record header(s) inside a request logger record "
                    "(a prompt or an output quoting a log): not read as records",
                )
            return
        key = process_key(rec)
        prev = self.last.get(key)
        self.last[key] = (rec, None)
        hm = V0_HIT_RATE_RE.match(rec.message)
        if hm:
            _pair_v0(rec, prev, self.unpaired.setdefault(key, []), hm.group("rest"), self.note)
            return
        stats = StatsMessage(rec.message)
        if not stats.is_stats:
            # "Engine 000: Avg prompt thr" + a wrapped rest: only a join can tell
            if not (rec.last_on_line and _cut_stats_head(rec.message)):
                return
            read = self.cut(rec, stats)
        elif stats.truncated:
            read = self.cut(rec, stats)
        elif stats.open_end and (tail := number_tail(rec, self.lines, self.text))[0] != "whole":
            read = self.open_end(rec, stats, tail[1])
        else:
            read = self.trailing(rec, stats)
        if read is None:
            return
        stats, rec_notes, repeat = read
        out_rec = _with_record_facts(rec, stats, rec_notes, repeat)
        self.out.append(out_rec)
        self.out_lines.append(rec.line + 1)
        if stats.is_v0:
            self.last[key] = (rec, out_rec)
            queue = self.unpaired.setdefault(key, [])
            queue[:] = [p for p in queue if _within(p[0].time, rec.time, V0_PAIR_GAP_S)]
            queue.append((rec, out_rec))

    def joined(self, rec: LogRecord, stats: StatsMessage, n: int) -> _Read:
        """``stats`` read from ``rec`` and the ``n`` physical lines after it (now used)."""
        self.used_lines.update(range(rec.line + 1, rec.line + 1 + n))
        notes = [*stats.notes, f"rejoined from {n + 1} physical lines (wrapped)"]
        return stats, notes, _repeat_of(rec, self.lines, n)

    def cut(self, rec: LogRecord, stats: StatsMessage) -> _Read | None:
        """A cut stats message: rejoined with the lines after it, else dropped (noted)."""
        joined = _rejoin(rec, self.lines) if rec.last_on_line else None
        if joined is not None:
            return self.joined(rec, *joined)
        if stats.is_stats:  # else no join makes it a stats record: not one
            where = (
                "cut by another record glued on the same line"
                if not rec.last_on_line
                else "cut (wrapped?) and no line after it completes it"
            )
            self.note(rec, f"stats record dropped: {where} ({'; '.join(stats.notes)})")
        return None

    def open_end(self, rec: LogRecord, stats: StatsMessage, rest: str | None) -> _Read | None:
        """A last value without a unit that may go on on the next line (``Preemptions: 1``
        + ``2``): its last field dropped, the join kept, or the record dropped (noted)."""
        if rest is None:
            stats.drop_last(
                "may be cut: the log ends on its line without a newline"
                if rec.line + 1 >= len(self.lines)
                else "may be cut: the next line goes on with a digit"
            )
            return stats, list(stats.notes), rec.repeat_count
        joined = StatsMessage(rec.message + rest)
        if joined.is_stats and not joined.truncated and joined.n_fields >= stats.n_fields:
            return self.joined(rec, joined, 1)
        self.note(
            rec,
            "stats record dropped: its last value goes on on the next line and "
            f"the join does not read whole ({'; '.join(joined.notes)})",
        )
        return None

    def trailing(self, rec: LogRecord, stats: StatsMessage) -> _Read:
        """A complete stats message, joined with the headerless stats fragments after it
        when the join is complete and adds fields."""
        kept = stats, list(stats.notes), rec.repeat_count
        if not rec.last_on_line or rec.line + 1 >= len(self.lines):
            return kept
        cont = continuation(rec, self.lines[rec.line + 1])
        if cont is None or not FRAGMENT_RE.search(cont):
            return kept
        if rec.glued and not leading_tags(self.lines[rec.line + 1]):
            # which of the records glued on the line before it continues is unknown
            self.used_lines.add(rec.line + 1)
            self.note(
                rec,
                "a stats fragment without a process tag after a line of "
                "several glued records: which one it continues is unknown: ignored",
                line_after=1,
            )
            return kept
        joined = _rejoin(rec, self.lines)
        if joined is not None and joined[0].n_fields > stats.n_fields:
            return self.joined(rec, *joined)
        return kept
