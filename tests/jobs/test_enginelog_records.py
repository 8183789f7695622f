"""Stats records from logs whose lines are not one record each: records glued on one
line, lines wrapped mid-field, Ray's prefixes and dedup suffix, V0's two-line pair
(:func:`jobs.signals.enginelog.parse_stats`, :mod:`jobs.signals.logrecords`).

The stats wording is vLLM 0.32.0's ``vllm/v1/metrics/loggers.py`` (``LoggingStatLogger.log``,
lines 282-336: ``", ".join(log_parts)`` of ``Avg prompt throughput: %.1f tokens/s``,
``Running: %d reqs``, ``Preemptions: %d`` only when > 0 (line 310), ``%s KV cache
usage: %.1f%%``...) behind ``vllm/logger.py``'s ``_FORMAT`` ``(%(vllm_process_name)s
pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s``.
Ray's shapes are Ray 2.60's source: ``print_worker_logs``
(``ray/_private/worker.py``: ``({name }pid={pid}{, ip={ip}}) {line}``) and
``DedupState.formatted`` (``ray/_private/ray_logging/__init__.py``:
``{line} [repeated {count}x across cluster]`` plus, once, ``(Ray deduplicates logs by
default. Set RAY_DEDUP_LOGS=0 ...)``, both coloured).
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from jobs.signals.enginelog import STATS_KEYS, parse_stats, parse_stats_lines, startup_facts
from jobs.signals.logrecords import split_records

DATA = Path(__file__).parent / "data" / "enginelog"

HDR_A = "(APIServer pid=1) INFO 05-12 08:01:39 [loggers.py:336] "
HDR_B = "(APIServer pid=1) INFO 05-12 08:01:49 [loggers.py:336] "
MSG_A = (
    "Engine 000: Avg prompt throughput: 5120.4 tokens/s, Avg generation throughput: "
    "310.2 tokens/s, Running: 24 reqs, Waiting: 7 reqs, Preemptions: 3, "
    "GPU KV cache usage: 62.8%, Prefix cache hit rate: 40.0%"
)
MSG_B = (
    "Engine 001: Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 2.0 "
    "tokens/s, Running: 5 reqs, Waiting: 0 reqs, GPU KV cache usage: 9.5%, "
    "Prefix cache hit rate: 6.0%"
)
A = {
    "timestamp": "05-12 08:01:39",
    "engine": 0,
    "prompt_throughput_tok_s": 5120.4,
    "generation_throughput_tok_s": 310.2,
    "running": 24,
    "waiting": 7,
    "preemptions": 3,
    "kv_cache_usage_pct": 62.8,
    "prefix_cache_hit_rate_pct": 40.0,
    "level": "INFO",
    "process": "APIServer pid=1",
    "source": "APIServer",
    "pid": 1,
}
B = {
    **A,
    "timestamp": "05-12 08:01:49",
    "engine": 1,
    "prompt_throughput_tok_s": 1.0,
    "generation_throughput_tok_s": 2.0,
    "running": 5,
    "waiting": 0,
    "kv_cache_usage_pct": 9.5,
    "prefix_cache_hit_rate_pct": 6.0,
}
del B["preemptions"]


def _without_notes(recs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [{k: v for k, v in r.items() if k != "notes"} for r in recs]


# --- two records on one physical line ----------------------------------------------------


@pytest.mark.parametrize(
    "glue",
    [
        "",  # the second process's line starts right after the first's last character
        " ",
        "2026-05-12T08:01:49.000000001Z ",  # a container runtime's timestamp per record
        "2026-05-12T08:01:49Z stdout F ",  # CRI format
    ],
)
def test_glued_records_are_split_and_keep_their_own_fields(glue: str) -> None:
    """Two processes writing to one stream: A's record is followed on the same physical
    line by B's (with whatever prefix B's writer put). Each record has exactly its own
    fields: today's parser took Running from A and the throughputs from B."""
    parsed = parse_stats(HDR_A + MSG_A + glue + HDR_B + MSG_B)
    assert parsed.records == [A, B]
    assert parsed.notes == []


def test_glued_record_cut_by_the_next_is_dropped_not_completed() -> None:
    """A is cut mid-field by B's record (two writers interleaved): A cannot be read, so it
    is dropped with a note; its tail on the next line is another record's fragment and
    never completes B (B is whole), nor A (not adjacent)."""
    cut = MSG_A.index("Running: 24 r") + len("Running: 24 r")
    text = HDR_A + MSG_A[:cut] + HDR_B + MSG_B + "\n" + MSG_A[cut:]
    parsed = parse_stats(text)
    assert parsed.records == [B]
    assert [n["line"] for n in parsed.notes] == [1, 2]
    assert parsed.notes[0]["timestamp"] == "05-12 08:01:39"
    assert "glued" in parsed.notes[0]["note"] and "'Running' unreadable" in parsed.notes[0]["note"]


def test_glued_records_of_other_kinds_keep_their_facts() -> None:
    """A start-up fact glued after a stats line is still read (and only from its record)."""
    text = (
        HDR_A + MSG_A + "(EngineCore_DP0 pid=7) INFO 05-12 08:01:39 [kv_cache_utils.py:1] "
        "GPU KV cache size: 448,512 tokens"
    )
    assert startup_facts(text) == {"kv_cache_device": "GPU", "kv_cache_size_tokens": 448_512}
    records = split_records(text)
    assert [(r.source, r.pid, r.glued, r.last_on_line) for r in records] == [
        ("APIServer", 1, True, False),
        ("EngineCore_DP0", 7, True, True),
    ]


# --- lines wrapped mid-field -----------------------------------------------------------


def _wrap(line: str, at: str, continuation_prefix: str = "") -> str:
    cut = line.index(at) + len(at)
    return line[:cut] + "\n" + continuation_prefix + line[cut:]


@pytest.mark.parametrize(
    ("at", "prefix"),
    [
        ("Running: 24 r", ""),  # the example: "Running: 32 r" / "eqs, Waiting: ..."
        ("Avg generation throughput: 31", ""),
        ("GPU KV cac", ""),
        ("GPU KV cache usage: 62.", ""),
        ("Preemptions: 3, ", ""),  # cut right after a comma
        ("Waiting: 7 reqs", ""),  # at a field boundary: the comma starts the next line
        ("Running: 24 r", "(APIServer pid=1) "),  # the writer's tag repeated on the piece
        ("Running: 24 r", "2026-05-12T08:01:39.5Z "),  # a shipper's timestamp on the piece
    ],
)
def test_wrapped_record_is_rejoined(at: str, prefix: str) -> None:
    """A terminal or a log shipper broke the record; the next line has no header and
    the join reads as a complete stats message: one record, every field, a note."""
    (got,) = parse_stats_lines(_wrap(HDR_A + MSG_A, at, prefix))
    assert got.pop("notes") == ["rejoined from 2 physical lines (wrapped)"]
    assert got == A


def test_record_wrapped_over_many_lines_is_rejoined() -> None:
    line = HDR_A + MSG_A
    pieces = [line[i : i + 80] for i in range(0, len(line), 80)]  # an 80-column terminal
    (got,) = parse_stats_lines("\n".join(pieces))
    assert got.pop("notes") == [f"rejoined from {len(pieces)} physical lines (wrapped)"]
    assert got == A


@pytest.mark.parametrize(
    "after",
    [
        "",  # the log ends: the rest was lost
        'INFO:     127.0.0.1:5 - "GET /health HTTP/1.1" 200 OK',  # another line, no header
        "(EngineCore_DP0 pid=7) eqs, Waiting: 7 reqs, GPU KV cache usage: 62.8%",  # other tag
        HDR_B + MSG_B,  # the next record
    ],
)
def test_wrapped_record_without_its_continuation_is_dropped(after: str) -> None:
    """The continuation is missing or ambiguous: the record is dropped with a note,
    never kept with half its fields (Running absent, Waiting from nowhere)."""
    first = HDR_A + MSG_A[: MSG_A.index("Running: 24 r") + len("Running: 24 r")]
    parsed = parse_stats(first + "\n" + after)
    assert all(r["timestamp"] != "05-12 08:01:39" for r in parsed.records)
    assert parsed.notes[0]["line"] == 1
    assert "dropped" in parsed.notes[0]["note"]


def test_unreadable_middle_field_is_absent_with_a_note() -> None:
    """A complete record whose one known field has an odd value keeps its other fields;
    that field is absent with a note (never a number read from somewhere else)."""
    msg = MSG_A.replace("Running: 24 reqs", "Running: n/a reqs")
    (got,) = parse_stats_lines(HDR_A + msg)
    assert "running" not in got
    assert got["waiting"] == 7 and got["kv_cache_usage_pct"] == 62.8
    assert got["notes"] == ["'Running' unreadable ('n/a reqs'): absent"]


def test_field_logged_twice_in_one_record_is_not_read() -> None:
    msg = MSG_A.replace("Waiting: 7 reqs", "Waiting: 7 reqs, Running: 9 reqs")
    (got,) = parse_stats_lines(HDR_A + msg)
    assert "running" not in got and got["waiting"] == 7
    assert got["notes"] == ["'Running' logged twice in one record: not read"]


# --- Ray's prefixes and suffixes -----------------------------------------------------------

RAY_PREFIX = "\x1b[36m(RayWorkerWrapper pid=9, ip=10.0.0.2)\x1b[0m "
DEDUP = "\x1b[32m [repeated 3x across cluster]\x1b[0m"
HINT = (
    " (Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0 to disable log "
    "deduplication, or see https://docs.ray.io/en/master/ray-observability/user-guides/"
    "configure-logging.html#log-deduplication for more options.)"
)


@pytest.mark.parametrize("suffix", [DEDUP, DEDUP.replace("]\x1b[0m", "]" + HINT + "\x1b[0m")])
def test_ray_tag_and_dedup_suffix(suffix: str) -> None:
    """Ray's tag gives source, pid and node_ip; its dedup suffix gives repeat_count and
    marks the values as one of several processes' (Ray keys the dedup on the line with
    every word holding a digit removed and prints the latest: not one engine's)."""
    (got,) = parse_stats_lines(
        RAY_PREFIX + "INFO 05-12 08:01:39 [loggers.py:336] " + MSG_A + suffix
    )
    assert got == {
        **A,
        "process": "RayWorkerWrapper pid=9, ip=10.0.0.2",
        "source": "RayWorkerWrapper",
        "pid": 9,
        "node_ip": "10.0.0.2",
        "repeat_count": 3,
        "merged_across_processes": True,
    }
    assert set(got) <= set(STATS_KEYS)


def test_ray_tag_around_vllm_tag() -> None:
    """Ray's tag outside vLLM's: the process is vLLM's (innermost), the node Ray's."""
    line = "(RayWorkerWrapper pid=9, ip=10.0.0.3) (EngineCore_DP1 pid=9) " + HDR_A[18:] + MSG_A
    (got,) = parse_stats_lines(line)
    assert (got["source"], got["pid"], got["node_ip"]) == ("EngineCore_DP1", 9, "10.0.0.3")
    assert "repeat_count" not in got and "merged_across_processes" not in got


def test_real_ray_log_of_vllm_2734() -> None:
    """vllm-project/vllm#2734 pasted: Ray's colour codes without their escape byte."""
    text = (DATA / "ray_nccl_watchdog.log").read_text()
    assert [r["timestamp"] for r in parse_stats_lines(text)] == ["02-03 13:14:04", "02-03 13:18:39"]
    records = split_records(text)
    assert [(r.source, r.pid, r.repeat_count) for r in records[2:]] == [
        ("RayWorkerVllm", 5085, None),
        ("RayWorkerVllm", 5310, 6),
    ]
    assert records[3].message.endswith("(function operator())")


# --- V0's two-line pair ------------------------------------------------------------------

V0 = (
    "Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
    "Running: 3 reqs, Swapped: 1 reqs, Pending: 4 reqs, GPU KV cache usage: 5.0%, "
    "CPU KV cache usage: 6.0%."
)
HIT = "Prefix cache hit rate: GPU: 12.50%, CPU: 1.00%"


def test_v0_pair_only_when_consecutive_records_of_one_process() -> None:
    """vllm/engine/metrics.py (V0) logs the stats line then, at once, the hit-rate line:
    they pair only as consecutive records of the same process (source, pid, node) from
    the same file. A record of that process in between, or the hit-rate line of another
    node with the same pid, leaves the hit rate unknown (None), never borrowed."""
    p1 = "(RayWorkerWrapper pid=5, ip=10.0.0.1) INFO 01-01 00:00:00 metrics.py:449] "
    p1_hit = p1.replace("metrics.py:449", "metrics.py:465")
    p2 = "(RayWorkerWrapper pid=5, ip=10.0.0.2) INFO 01-01 00:00:00 metrics.py:449] "
    p2_hit = p2.replace("metrics.py:449", "metrics.py:465")
    text = "\n".join(
        [
            p1 + V0,
            p2 + V0,
            p2 + "Running a scheduler step",  # p2's next record is not its hit rate
            p2_hit + HIT,
            p1_hit + HIT,  # p1's next record: pairs (other processes' lines in between)
        ]
    )
    first, second = parse_stats_lines(text)
    assert first["node_ip"] == "10.0.0.1" and first["prefix_cache_hit_rate_pct"] == 12.5
    assert first["cpu_prefix_cache_hit_rate_pct"] == 1.0
    assert second["node_ip"] == "10.0.0.2" and second["prefix_cache_hit_rate_pct"] is None
    assert "cpu_prefix_cache_hit_rate_pct" not in second


def test_v0_pair_glued_on_one_line_and_from_another_file() -> None:
    hdr = "INFO 01-01 00:00:00 metrics.py:449] "
    (glued,) = parse_stats_lines(hdr + V0 + "INFO 01-01 00:00:00 metrics.py:465] " + HIT)
    assert glued["prefix_cache_hit_rate_pct"] == 12.5
    # a hit-rate line logged by another file is not the V0 logger's second line
    (other,) = parse_stats_lines(hdr + V0 + "\nINFO 01-01 00:00:00 spec_decode.py:1] " + HIT)
    assert other["prefix_cache_hit_rate_pct"] is None


def test_records_are_in_log_order_with_lines() -> None:
    text = "\n".join([HDR_A + MSG_A, "noise", HDR_B + MSG_B])
    parsed = parse_stats(text)
    assert parsed.lines == [1, 3]
    assert all(a < b for a, b in pairwise(parsed.lines))
    assert _without_notes(parsed.records) == [A, B]


# --- defects found by a fresh-user trial (issue #16) -----------------------------------

#: vLLM 0.32.0 ``vllm/entrypoints/serve/utils/request_logger.py``: line 55 logs a
#: request's prompt at DEBUG (``Request %s details: prompt: %r, prompt_token_ids: %s,
#: prompt_embeds shape: %s.``); line 108 logs the output at INFO with
#: ``--enable-log-outputs`` (``Generated response %s%s: output: %r, finish_reason: %s``).
REQ_HDR = "(APIServer pid=1) DEBUG 05-12 08:01:39 [request_logger.py:55] "
OUT_HDR = "(APIServer pid=1) INFO 05-12 08:01:39 [request_logger.py:108] "
QUOTED_STATS = (
    "INFO 01-02 03:04:05 [loggers.py:1] Engine 000: Avg prompt throughput: 99999.0 "
    "tokens/s, Avg generation throughput: 1.0 tokens/s, Running: 999 reqs, Waiting: 0 "
    "reqs, GPU KV cache usage: 100.0%"
)


@pytest.mark.parametrize(
    "line",
    [
        REQ_HDR + f"Request cmpl-1 details: prompt: 'why does my log say {QUOTED_STATS}', "
        "prompt_token_ids: None, prompt_embeds shape: None.",
        # the header right after the quote, and a %r repr that chose double quotes
        REQ_HDR + f"Request cmpl-2 details: prompt: '{QUOTED_STATS}', prompt_token_ids: None.",
        OUT_HDR + f'Generated response chatcmpl-abc: output: "it\'s {QUOTED_STATS}", '
        "finish_reason: stop",
        OUT_HDR + "Generated response chatcmpl-abc (streaming complete): output: 'see "
        f"{QUOTED_STATS}', finish_reason: stop",
    ],
)
def test_text_inside_a_request_logger_record_is_no_record(line: str) -> None:
    """A prompt or an output quoting a vLLM log is the user's text: no stats record, one
    record (the request logger's), and a note that headers were not read."""
    found = parse_stats(line)
    assert found.records == []
    srcs = [r.src for r in split_records(line)]
    assert srcs in (["request_logger.py:55"], ["request_logger.py:108"])
    assert any("request logger" in n["note"] for n in found.notes)


def test_untagged_fragment_after_glued_records_of_two_processes_is_not_joined() -> None:
    """Two engine cores glued on one line (the shape of vllm-project/vllm#2734's
    interleaved worker output), then an untagged ``, Prefix cache hit rate: 6.0%``: which
    record it continues is unknown, so neither borrows it."""
    b = "(EngineCore_DP1 pid=8) INFO 05-12 08:01:40 [loggers.py:336] " + MSG_B.rsplit(",", 1)[0]
    a = "(EngineCore_DP0 pid=7) " + HDR_A.split(") ", 1)[1] + MSG_A.rsplit(",", 1)[0]
    found = parse_stats(b + a + "\n, Prefix cache hit rate: 6.0%")
    assert [r.get("prefix_cache_hit_rate_pct") for r in found.records] == [None, None]
    assert [r["pid"] for r in found.records] == [8, 7]
    assert any("which one it continues is unknown" in n["note"] for n in found.notes)
    # one record on the line before: the fragment is its wrapped tail, as before
    alone = parse_stats(a + "\n, Prefix cache hit rate: 6.0%")
    assert alone.records[0]["prefix_cache_hit_rate_pct"] == 6.0


#: V0 ``vllm/engine/metrics.py`` ``LoggingStatLogger.log`` logs both lines in one call
#: (vllm-project/vllm#6042 logs show the pair in the same second).
V0_STATS = (
    "INFO 05-12 08:01:39 metrics.py:351] Avg prompt throughput: 0.0 tokens/s, Avg "
    "generation throughput: {g} tokens/s, Running: 1 reqs, Swapped: 0 reqs, Pending: 0 "
    "reqs, GPU KV cache usage: 0.3%, CPU KV cache usage: 0.0%."
)
V0_HIT = "INFO 05-12 08:01:{s} metrics.py:367] Prefix cache hit rate: GPU: {h}%, CPU: 0.0%"


def test_v0_hit_rate_lines_of_two_untagged_engines_are_unknown() -> None:
    text = "\n".join(
        [
            V0_STATS.format(g="14.2"),
            V0_STATS.format(g="99.9"),
            V0_HIT.format(s="39", h="53.2"),
            V0_HIT.format(s="39", h="11.1"),
        ]
    )
    found = parse_stats(text)
    assert [r["prefix_cache_hit_rate_pct"] for r in found.records] == [None, None]
    assert all("which is whose is unknown" in r["notes"][0] for r in found.records)
    assert len(found.notes) == 2  # neither hit-rate line dropped silently


def test_v0_hit_rate_line_of_another_second_is_not_merged() -> None:
    found = parse_stats(V0_STATS.format(g="14.2") + "\n" + V0_HIT.format(s="40", h="11.1"))
    assert found.records[0]["prefix_cache_hit_rate_pct"] is None
    assert "another time" in found.notes[0]["note"]
    same = parse_stats(V0_STATS.format(g="14.2") + "\n" + V0_HIT.format(s="39", h="11.1"))
    assert same.records[0]["prefix_cache_hit_rate_pct"] == 11.1


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ("62.8%", "628.0%", "kv_cache_usage_pct"),
        ("40.0%", "140.0%", "prefix_cache_hit_rate_pct"),
        ("62.8%", "1e400%", "kv_cache_usage_pct"),
        ("310.2", "-310.2", "generation_throughput_tok_s"),
        ("310.2", "1e5", "generation_throughput_tok_s"),
        ("310.2", "inf", "generation_throughput_tok_s"),
        ("5120.4", "nan", "prompt_throughput_tok_s"),
        ("24 reqs", "+24 reqs", "running"),
        ("24 reqs", "\uff12\uff14 reqs", "running"),  # fullwidth digits
        # %.1f has no thousands separator: a comma is another field's start or noise
        ("5120.4", "5,120.4", "prompt_throughput_tok_s"),
        ("310.2", "3,10.2", "generation_throughput_tok_s"),
    ],
)
def test_values_outside_what_vllm_prints_are_absent(old: str, new: str, key: str) -> None:
    """vLLM prints ``%.1f tokens/s``, ``%d reqs``, ``%.1f%%`` (``v1/metrics/loggers.py``):
    no sign, no exponent, no inf/nan, a percentage of 0-100. Anything else is absent
    with a note (JSONB rejects Infinity), the other fields kept."""
    (rec,) = parse_stats_lines(HDR_A + MSG_A.replace(old, new, 1))
    assert key not in rec
    assert any("unreadable" in n or "out of range" in n for n in rec["notes"])
    assert rec["waiting"] == 7


def test_docker_json_file_lines_are_decoded() -> None:
    """Docker's json-file driver (``docker logs`` raw files under
    /var/lib/docker/containers/*/*-json.log): ``{"log":"<line>\\n","stream":"stdout",
    "time":"<RFC3339Nano>"}``, one object per line; a line over 16 KiB is split into
    several objects, the text continuing in the next one."""
    line = HDR_A + MSG_A
    text = "\n".join(
        json.dumps({"log": piece, "stream": "stdout", "time": "2026-05-12T08:01:39.331Z"})
        for piece in (line[:150], line[150:] + "\n")
    )
    found = parse_stats(text)
    (rec,) = found.records
    assert rec["prefix_cache_hit_rate_pct"] == 40.0 and rec["running"] == 24
    assert rec["pid"] == 1
    whole = json.dumps({"log": line + "\n", "stream": "stdout", "time": "2026-05-12T08:01:39Z"})
    assert parse_stats_lines(whole)[0]["kv_cache_usage_pct"] == 62.8


def test_ray_actor_name_with_parentheses_keeps_its_tag() -> None:
    """Ray's prefix is ``({actor repr} pid={pid}{, ip={ip}})`` (``print_worker_logs``): a
    repr may hold parentheses; the tag is read by its last ``pid=N[, ip=A])``."""
    (rec,) = parse_stats_lines(
        "(my actor (x) pid=5, ip=10.0.0.3) " + HDR_A.split(") ", 1)[1] + MSG_A
    )
    assert (rec["source"], rec["pid"], rec["node_ip"]) == ("my actor (x)", 5, "10.0.0.3")


def test_header_after_an_opening_quote_is_text_after_a_closing_one_a_record() -> None:
    """``say 'INFO ...`` quotes a header (text); ``model='x'`` then a glued record (two
    processes writing one stream, vllm-project/vllm#2734) is two records."""
    quoted = split_records("INFO 05-12 08:01:39 [a.py:1] say 'INFO 05-12 08:01:39 [b.py:2] hi'")
    assert [r.src for r in quoted] == ["a.py:1"]
    glued = split_records("INFO 05-12 08:01:39 [a.py:1] model='x'INFO 05-12 08:01:39 [b.py:2] hi")
    assert [(r.src, r.message) for r in glued] == [("a.py:1", "model='x'"), ("b.py:2", "hi")]


# --- a last value without a unit (trial of 2026-12-04) -----------------------------------

#: vLLM 0.32 ``v1/metrics/loggers.py`` appends ``Preemptions: %d`` last when the scheduler
#: preempted (no unit: a cut ``1`` of ``12`` reads as a whole number)
HDR_P = "(APIServer pid=1) INFO 05-12 08:01:39 [loggers.py:336] "
MSG_P = (
    "Engine 000: Avg prompt throughput: 880.0 tokens/s, Avg generation throughput: 95.5 "
    "tokens/s, Running: 9 reqs, Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache "
    "hit rate: 71.3%, Preemptions: 12"
)


@pytest.mark.parametrize("prefix", ["", "(APIServer pid=1) "])
def test_a_unitless_last_value_cut_by_a_wrap_is_rejoined(prefix: str) -> None:
    line = HDR_P + MSG_P
    cut = line.index("Preemptions: 1") + len("Preemptions: 1")
    text = line[:cut] + "\n" + prefix + line[cut:] + "\n" + HDR_B + MSG_B + "\n"
    first, second = parse_stats_lines(text)
    assert first["preemptions"] == 12
    assert first["notes"] == ["rejoined from 2 physical lines (wrapped)"]
    assert "notes" not in second and "preemptions" not in second


def test_a_unitless_last_value_that_may_be_cut_is_absent_with_a_note() -> None:
    line = HDR_P + MSG_P
    cut = line.index("Preemptions: 1") + len("Preemptions: 1")
    # the log read while the engine was writing the line: no newline after it
    (rec,) = parse_stats_lines(line[:cut])
    assert "preemptions" not in rec and rec["running"] == 9
    assert rec["notes"] == [
        "'Preemptions' may be cut: the log ends on its line without a newline: absent"
    ]
    # the next line goes on with a digit, but not as a number's tail: unknown
    (rec,) = parse_stats_lines(line[:cut] + "\n2 workers restarted\n")
    assert "preemptions" not in rec
    assert any("may be cut" in n for n in rec["notes"])
    # the same for a field the parser does not know (kept under extra)
    unknown = HDR_A + MSG_B + ", Spec accept rate: 4"
    (rec,) = parse_stats_lines(unknown)
    assert "extra" not in rec and any("'Spec accept rate' may be cut" in n for n in rec["notes"])
    (rec,) = parse_stats_lines(unknown + "\n5.0%\n")
    assert rec["extra"] == {"Spec accept rate": 45.0}
    # a whole line (newline, then another record) keeps its value and gets no note
    (rec, _) = parse_stats_lines(line + "\n" + HDR_B + MSG_B + "\n")
    assert rec["preemptions"] == 12 and "notes" not in rec


def test_ray_dedup_mark_on_a_wrapped_piece_marks_the_record() -> None:
    """Ray deduplicates each physical line: the mark may be on the wrapped piece only."""
    line = RAY_PREFIX + "INFO 05-12 08:01:39 [loggers.py:336] " + MSG_A
    cut = line.index("Running: 24 r") + len("Running: 24 r")
    (rec,) = parse_stats_lines(line[:cut] + "\n" + RAY_PREFIX + line[cut:] + DEDUP + "\n")
    assert rec["running"] == 24 and rec["waiting"] == 7
    assert rec["repeat_count"] == 3 and rec["merged_across_processes"] is True


def test_v0_second_line_repeated_cut_or_doubled() -> None:
    hdr = RAY_PREFIX + "INFO 01-01 00:00:00 metrics.py:449] "
    hit_hdr = RAY_PREFIX + "INFO 01-01 00:00:00 metrics.py:465] "
    # only the hit-rate line was deduplicated: its values are several processes'
    (rec,) = parse_stats_lines(hdr + V0 + "\n" + hit_hdr + HIT + DEDUP + "\n")
    assert rec["prefix_cache_hit_rate_pct"] == 12.5
    assert rec["repeat_count"] == 3 and rec["merged_across_processes"] is True
    # cut after the GPU value: the CPU value is absent, with a note
    (rec,) = parse_stats_lines(hdr + V0 + "\n" + hit_hdr + "Prefix cache hit rate: GPU: 12.50%")
    assert rec["prefix_cache_hit_rate_pct"] == 12.5
    assert "cpu_prefix_cache_hit_rate_pct" not in rec
    assert "second V0 line: no 'CPU' value (cut?): absent" in rec["notes"]
    # a device logged twice: which value is right is unknown
    doubled = "Prefix cache hit rate: GPU: 45.00%, CPU: 0.00%, GPU: 3.0%"
    (rec,) = parse_stats_lines(hdr + V0 + "\n" + hit_hdr + doubled + "\n")
    assert rec["prefix_cache_hit_rate_pct"] is None
    assert rec["cpu_prefix_cache_hit_rate_pct"] == 0.0
    assert "second V0 line: 'GPU' logged twice: not read" in rec["notes"]
