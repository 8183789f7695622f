"""Typed engine events and their place on the run's timeline (:mod:`jobs.signals.engineevents`).

Every event shape is a real one: the vLLM 0.32.0 source line that logs it (file and
wording, quoted in :mod:`jobs.signals.engineevents`), Ray 2.60's source, or the public issue
quoted next to the case.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from jobs.signals import eventparse
from jobs.signals.engineevents import (
    EVENT_KEYS,
    EVENT_TYPES,
    MAX_CLOCK_GAP_S,
    parse_events,
    place_events,
    segment_events,
    to_epoch,
)

DATA = Path(__file__).parent / "data" / "enginelog"
T0 = datetime(2026, 5, 12, 8, 1, 30, tzinfo=UTC).timestamp()  # the run began 08:01:30
EC = "(EngineCore_DP0 pid=7) "
API = "(APIServer pid=1) "

CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    # (why / source, line, type, details)
    (
        "torch OOM inside vLLM's logger.exception traceback (NewLineFormatter repeats the header)",
        EC + "ERROR 05-12 08:01:39 [core.py:1512] torch.OutOfMemoryError: CUDA out of memory. "
        "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB",
        "out_of_memory",
        {},
    ),
    (
        "vllm/v1/core/kv_cache_utils.py:1011",
        EC + "ERROR 05-12 08:01:39 [core.py:1510] ValueError: No available memory for the cache "
        "blocks. Try increasing `gpu_memory_utilization` when initializing the engine",
        "out_of_memory",
        {},
    ),
    (
        "Ray's memory monitor (ray OOM prevention), raylet tag without pid",
        "(raylet, ip=10.0.0.2) Memory on the node (IP: 10.0.0.2, ID: abc) where the task was "
        "running was 29.50GB / 31.03GB (0.95087), which exceeds the memory usage threshold of "
        "0.95. Ray killed this worker (ID: def) because it was the most recently scheduled task",
        "out_of_memory",
        {},
    ),
    (
        "vllm-project/vllm#6042: torch's NCCL watchdog, c10 glog format",
        "[rank0]:[E ProcessGroupNCCL.cpp:563] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=134217728, NumelOut=134217728, "
        "Timeout(ms)=600000) ran for 600059 milliseconds before timing out.",
        "nccl_error",
        {},
    ),
    (
        "vllm-project/vllm#10626: NCCL error",
        "(VllmWorkerProcess pid=12) ERROR 11-25 08:17:40 multiproc_worker_utils.py:229] "
        "RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)",
        "nccl_error",
        {},
    ),
    (
        "vllm-project/vllm#6775: Gloo on a Ray worker",
        "[rank0]: RuntimeError: Gloo connectFullMesh failed with "
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error",
        "gloo_error",
        {},
    ),
    (
        "vllm/v1/engine/core.py:1512",
        EC + "ERROR 05-12 08:01:40 [core.py:1512] EngineCore encountered a fatal error.",
        "engine_dead",
        {},
    ),
    (
        "vllm/v1/engine/async_llm.py:906",
        API + "ERROR 05-12 08:01:40 [async_llm.py:906] AsyncLLM output_handler failed.",
        "engine_dead",
        {},
    ),
    (
        "vllm-project/vllm#21728 (vLLM 0.10 core_client.py)",
        API + "ERROR 05-12 08:01:40 [core_client.py:564] Engine core proc EngineCore_DP0 died "
        "unexpectedly, shutting down client.",
        "engine_dead",
        {},
    ),
    (
        "vllm/v1/engine/exceptions.py: EngineDeadError's message",
        API + "ERROR 05-12 08:01:41 [serving_chat.py:1] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "engine_dead",
        {},
    ),
    (
        "vllm/v1/executor/multiproc_executor.py:316",
        EC + "ERROR 05-12 08:01:40 [multiproc_executor.py:316] Worker proc VllmWorker-1 died "
        "unexpectedly (exit code: -9), shutting down executor.",
        "worker_died",
        {"exit_code": -9},
    ),
    (
        "vllm-project/vllm#6042 (V0 multiproc_worker_utils.py:120)",
        "ERROR 07-01 13:54:43 multiproc_worker_utils.py:120] Worker VllmWorkerProcess pid 1159 "
        "died, exit code: -6",
        "worker_died",
        {"exit_code": -6},
    ),
    (
        "ray/serve/_private/deployment_state.py: replica marked unhealthy (Ray Serve format)",
        "(ServeController pid=89848) WARNING 2026-05-12 08:01:45,182 controller 89848 -- "
        "Replica(id='abc', deployment='VLLMDeployment', app='default') failed the health check "
        "3 times in a row, marking it unhealthy.",
        "unhealthy",
        {},
    ),
    (
        "ray/serve/_private/deployment_state.py: one failed health check",
        "(ServeController pid=89848) WARNING 2026-05-12 08:01:44,100 controller 89848 -- Health "
        "check for Replica(id='abc', deployment='VLLMDeployment', app='default') failed: "
        "EngineDeadError",
        "engine_dead",  # the failure says why: the engine died (the higher priority type)
        {},
    ),
    (
        "vllm/entrypoints/serve/instrumentator/health.py: /health answers 503 once dead",
        API + 'INFO:     127.0.0.1:40512 - "GET /health HTTP/1.1" 503 Service Unavailable',
        "health_check_failed",
        {},
    ),
    (
        "vllm/v1/fault_tolerance/engine_core_sentinel.py: [FT] status",
        EC + "INFO 05-12 08:01:42 [engine_core_sentinel.py:100] [FT] Engine 0 status -> UNHEALTHY:",
        "unhealthy",
        {},
    ),
    (
        "vllm/entrypoints/launchers/dp_supervisor.py:451",
        API + "INFO 05-12 08:01:42 [dp_supervisor.py:451] DPSupervisor probe found 1 unhealthy "
        "DP Servers.",
        "unhealthy",
        {},
    ),
    (
        "vllm/v1/fault_tolerance/engine_core_sentinel.py:132",
        EC + "INFO 05-12 08:01:50 [engine_core_sentinel.py:132] [FT] Engine 0 status -> HEALTHY",
        "restart",
        {},
    ),
    (
        "GAIR-NLP/LIMO#29: V0 scheduler preemption warning",
        "WARNING 05-12 08:01:39 scheduler.py:1560] Sequence group 221 is preempted by "
        "PreemptionMode.RECOMPUTE mode because there is not enough KV cache space. This can "
        "affect the end-to-end performance. Increase gpu_memory_utilization or "
        "tensor_parallel_size to provide more KV cache memory. total_num_cumulative_preemption=101",
        "preemption",
        {"preemption_mode": "RECOMPUTE", "cumulative_preemptions": 101},
    ),
]


@pytest.mark.parametrize(("why", "line", "kind", "details"), CASES, ids=[c[0][:40] for c in CASES])
def test_event_types_from_real_shapes(
    why: str, line: str, kind: str, details: dict[str, Any]
) -> None:
    (ev,) = parse_events(line + "\n")  # a whole log's last line ends with a newline
    assert ev["type"] == kind, why
    assert ev.get("details", {}) == details
    assert set(ev) <= set(EVENT_KEYS) | {"after_time"}
    assert ev["type"] in EVENT_TYPES


@pytest.mark.parametrize(
    "line",
    [
        "(RayWorkerWrapper pid=9) host:9:9 [0] NCCL INFO Channel 00/02 :    0   1",
        " [W CUDAGraph.cpp:145] Warning: Waiting for pending NCCL work to finish before starting "
        "graph capture. (function operator())",  # vllm-project/vllm#2734
        "(ServeController pid=1) INFO 2026-05-12 08:01:45,182 controller 1 -- Replica(id='a', "
        "deployment='D', app='default') passed the health check after 2 consecutive failures.",
        API + 'INFO:     127.0.0.1:40512 - "GET /health HTTP/1.1" 200 OK',
        API + "INFO 05-12 08:01:39 [loggers.py:336] Engine 000: Avg prompt throughput: 1.0 "
        "tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, "
        "GPU KV cache usage: 1.0%",  # no Preemptions field: none in the interval
        "WARNING 05-12 08:01:39 [utils.py:1] Found ulimit of 1024 and failed to automatically "
        "increase with error current limit exceeds maximum limit",
    ],
)
def test_lines_that_are_no_events(line: str) -> None:
    assert parse_events(line) == []


def test_v1_preemptions_come_from_the_stats_line() -> None:
    """V1 logs no preemption line: its stats line says ``Preemptions: N`` when N > 0
    (vllm/v1/metrics/loggers.py:310). A stats record cut by a wrap gives none."""
    stats = (
        API + "INFO 05-12 08:01:39 [loggers.py:336] Engine 000: Avg prompt throughput: 1.0 "
        "tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 8 reqs, Waiting: 3 reqs, "
        "Preemptions: 5, GPU KV cache usage: 99.0%"
    )
    (ev,) = parse_events(stats)
    assert ev["type"] == "preemption" and ev["details"] == {"preemptions": 5}
    assert (ev["time"], ev["source"], ev["line"]) == ("05-12 08:01:39", "APIServer", 1)
    cut = stats.index("Preemptions: 5") + len("Preemptions: 5")
    assert parse_events(stats[:cut] + "\n" + 'INFO:     x - "GET /x HTTP/1.1" 200 OK') == []


def test_glued_event_keeps_its_own_time_and_process() -> None:
    line = (
        API + "INFO 05-12 08:01:39 [loggers.py:336] Engine 000: Avg prompt throughput: 1.0 "
        "tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, "
        "GPU KV cache usage: 1.0%" + EC + "ERROR 05-12 08:01:40 [core.py:1512] EngineCore "
        "encountered a fatal error."
    )
    (ev,) = parse_events(line)
    assert (ev["type"], ev["time"], ev["source"], ev["pid"]) == (
        "engine_dead",
        "05-12 08:01:40",
        "EngineCore_DP0",
        7,
    )
    assert ev["message"] == "EngineCore encountered a fatal error."


def test_ray_dedup_marks_the_event_merged() -> None:
    line = (
        "\x1b[36m(RayWorkerWrapper pid=933, ip=50.147.43.24)\x1b[0m [rank1]:[E528 "
        "08:52:46.164295950 ProcessGroupGloo.cpp:145] Gloo connectFullMesh failed with "
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:144] no error"
        "\x1b[32m [repeated 3x across cluster]\x1b[0m"
    )  # gpustack/gpustack#2125, with the dedup suffix Ray adds for the other ranks
    (ev,) = parse_events(line)
    assert ev["type"] == "gloo_error"
    assert ev["time"] == "05-28 08:52:46"  # torch's glog time: month 5, day 28
    assert (ev["source"], ev["pid"], ev["node_ip"]) == ("RayWorkerWrapper", 933, "50.147.43.24")
    assert ev["repeat_count"] == 3 and ev["merged_across_processes"] is True


def test_same_event_twice_is_counted_once() -> None:
    oom = EC + "ERROR 05-12 08:01:39 [core.py:1512] torch.OutOfMemoryError: CUDA out of memory."
    text = "\n".join([oom, EC + "ERROR 05-12 08:01:39 [core.py:1512] During handling...", oom])
    (ev,) = parse_events(text)
    assert ev["count"] == 2
    other = oom.replace("pid=7", "pid=8")  # another process's OOM is its own event
    assert len(parse_events(oom + "\n" + other)) == 2


def test_real_ray_log_of_vllm_2734() -> None:
    """The NCCL watchdog line has no time (torch's old glog format without one): it is
    placed after the last timed record, not at a guessed time; the dedup'd warning about
    pending NCCL work is no event."""
    text = (DATA / "ray_nccl_watchdog.log").read_text()
    (ev,) = parse_events(text)
    assert ev["type"] == "nccl_error" and ev["time"] is None
    assert (ev["source"], ev["pid"], ev["line"]) == ("RayWorkerVllm", 5085, 3)
    t0 = datetime(2024, 2, 3, 13, 14, 0, tzinfo=UTC).timestamp()
    (placed,) = place_events([ev], t0, UTC)
    assert placed["placement"] == "unplaced" and placed["t_s"] is None
    assert placed["after_t_s"] == 279.0  # 13:18:39, the last stats line before it


# --- vlab's stop of the engine ---------------------------------------------------------------

#: vLLM 0.32.0's shutdown when vlab SIGTERMs the engine after measuring: a real engine.log
#: (``EngineCore: trigger received signal=SIGTERM``, then ``AsyncLLM output_handler
#: failed.`` and the ``EngineDeadError`` traceback of the orderly shutdown).
SHUTDOWN = (DATA / "vllm032_cpu_shutdown.log").read_bytes().decode()
#: vlab's stop began after the access lines that end the measurement (before the trigger).
STOP_LINE = 5


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_the_shutdown_vlab_asked_for_is_no_engine_dead() -> None:
    """A healthy run stopped by vlab: its shutdown's EngineDeadError is no death."""
    assert "trigger received signal=SIGTERM" in SHUTDOWN.splitlines()[STOP_LINE - 1]
    assert "EngineDeadError" in SHUTDOWN and "output_handler failed" in SHUTDOWN
    assert parse_events(SHUTDOWN, stop_line=STOP_LINE) == []
    assert parse_events(SHUTDOWN, stop_line=1) == []
    # through the run's segment (the last run of a server, its log read after the stop)
    t0 = datetime(2026, 12, 6, 22, 17, 40, tzinfo=UTC).timestamp()
    seg = segment_events(SHUTDOWN, t0, 30.0, first=True, tz=UTC, stop_line=STOP_LINE)
    assert seg["events"] == [] and seg["summary"]["by_type"] == {}


def test_the_same_error_without_vlabs_stop_is_engine_dead() -> None:
    """The same lines without a stop that vlab asked for: the run lost its engine."""
    # the EngineDeadError traceback with no stop trigger before it (the engine core died)
    died = "\n".join(ln for ln in SHUTDOWN.splitlines() if "trigger received" not in ln)
    assert _types(parse_events(died, stop_line=1)) == ["engine_dead", "engine_dead"]
    # someone else SIGTERMed the engine during the run (vlab was not stopping it)
    assert _types(parse_events(SHUTDOWN)) == ["engine_dead", "engine_dead"]
    assert _types(parse_events(SHUTDOWN, stop_line=len(SHUTDOWN.splitlines()) + 1)) == [
        "engine_dead",
        "engine_dead",
    ]
    # a death during the measurement, then vlab's stop: the death stays an event
    lines = SHUTDOWN.splitlines()
    during = [ln.replace("12-06 22:17:51", "12-06 22:17:45") for ln in lines[21:29]]
    text = "\n".join([*during, *lines])
    events = parse_events(text, stop_line=len(during) + STOP_LINE)
    assert _types(events) == ["engine_dead", "engine_dead"]
    assert {e["time"] for e in events} == {"12-06 22:17:45"}
    # a stop that found the engine core gone (no trigger): what follows stays an event
    assert _types(parse_events(died, stop_line=STOP_LINE)) == ["engine_dead", "engine_dead"]


# --- time ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "t0", "expected"),
    [
        ("05-12 08:01:39", datetime(2026, 5, 12, 8, 1, 30, tzinfo=UTC), 9.0),
        # the run began on New Year's Eve: the record is of the year before the next
        ("12-31 23:59:59", datetime(2027, 1, 1, 0, 0, 5, tzinfo=UTC), -6.0),
        ("01-01 00:00:01", datetime(2026, 12, 31, 23, 59, 58, tzinfo=UTC), 3.0),
        ("02-29 10:00:00", datetime(2028, 2, 29, 9, 59, 0, tzinfo=UTC), 60.0),  # a leap year
        ("2026-05-12 08:01:45,182", datetime(2026, 5, 12, 8, 1, 30, tzinfo=UTC), 15.182),
        ("2026-05-12T08:01:39.5Z", datetime(2026, 5, 12, 8, 1, 30, tzinfo=UTC), 9.5),
        ("2026-05-12T10:01:39+02:00", datetime(2026, 5, 12, 8, 1, 30, tzinfo=UTC), 9.0),
        ("2026-05-12T08:01:39.331095044Z", datetime(2026, 5, 12, 8, 1, 30, tzinfo=UTC), 9.331),
    ],
)
def test_to_epoch(text: str, t0: datetime, expected: float) -> None:
    got = to_epoch(text, t0.timestamp(), UTC)
    assert got is not None and got - t0.timestamp() == pytest.approx(expected, abs=1e-3)


def test_local_times_use_the_writers_zone() -> None:
    """vLLM logs local time: the same text is another instant in another zone."""
    zone = timezone(timedelta(hours=-7))
    t0 = datetime(2026, 5, 12, 8, 1, 30, tzinfo=zone).timestamp()
    assert to_epoch("05-12 08:01:39", t0, zone) == t0 + 9
    assert to_epoch("not a time", t0, zone) is None


def test_place_events() -> None:
    events = parse_events(
        "\n".join(
            [
                EC + "ERROR 05-12 08:01:39 [core.py:1512] EngineCore encountered a fatal error.",
                "torch.OutOfMemoryError: CUDA out of memory.",  # a raw traceback line: no time
                EC + "ERROR 02-01 08:01:39 [core.py:1512] EngineCore failed to start.",
            ]
        )
    )
    dead, oom, far = place_events(events, T0, UTC)
    assert (dead["placement"], dead["t_s"]) == ("placed", 9.0)
    assert (oom["placement"], oom["t_s"], oom["after_t_s"]) == ("unplaced", None, 9.0)
    assert "after_time" not in oom
    assert far["placement"] == "unplaced" and far["t_s"] is None
    assert "another clock or time zone" in far["placement_note"]
    assert abs((to_epoch("02-01 08:01:39", T0, UTC) or 0.0) - T0) > MAX_CLOCK_GAP_S


def test_segment_events_split_a_batch_by_time() -> None:
    """Two runs on one server: each gets the events of its own seconds; a line without a
    time goes with the timed record before it; one before any time to the first run."""
    log = "\n".join(
        [
            "torch.OutOfMemoryError: CUDA out of memory.",  # before any timed record
            EC + "ERROR 05-12 08:01:35 [core.py:1] EngineCore encountered a fatal error.",
            "[rank0]:[E ProcessGroupNCCL.cpp:563] Watchdog caught collective operation timeout",
            EC + "ERROR 05-12 08:01:50 [core.py:1] EngineCore encountered a fatal error.",
        ]
    )
    first = segment_events(log, T0, 10.0, first=True, tz=UTC)  # 08:01:30 - 08:01:40
    second = segment_events(log, T0 + 12.0, 10.0, first=False, tz=UTC)  # 08:01:42 - :52
    assert [(e["type"], e["t_s"], e.get("after_t_s")) for e in first["events"]] == [
        ("out_of_memory", None, None),
        ("engine_dead", 5.0, None),
        ("nccl_error", None, 5.0),
    ]
    assert [(e["type"], e["t_s"]) for e in second["events"]] == [("engine_dead", 8.0)]
    assert first["summary"] == {
        "total": 3,
        "kept": 3,
        "by_type": {"out_of_memory": 1, "engine_dead": 1, "nccl_error": 1},
        "unplaced": 2,
    }


def test_segment_events_cap_keeps_every_kind() -> None:
    pre = "WARNING 05-12 08:01:{s:02d} scheduler.py:1] Sequence group {i} is preempted by " + (
        "PreemptionMode.RECOMPUTE mode because there is not enough KV cache space."
    )
    lines = [pre.format(s=31 + i % 20, i=i) for i in range(50)]
    lines.insert(25, EC + "ERROR 05-12 08:01:45 [core.py:1] EngineCore encountered a fatal error.")
    found = segment_events("\n".join(lines), T0, 60.0, first=True, tz=UTC, limit=10)
    kinds = [e["type"] for e in found["events"]]
    assert len(kinds) == 10 and kinds.count("engine_dead") == 1
    assert found["summary"]["total"] == 51 and found["summary"]["kept"] == 10
    lines_kept = [e["line"] for e in found["events"]]
    assert lines_kept == sorted(lines_kept) and lines_kept[0] == 1 and lines_kept[-1] == 51


def test_stats_notes_of_the_segment() -> None:
    cut = (
        API + "INFO 05-12 08:01:39 [loggers.py:336] Engine 000: Avg prompt throughput: 1.0 "
        "tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 8 r"
    )
    found = segment_events(cut, T0, 60.0, first=True, tz=UTC)
    (note,) = found["stats_notes"]
    assert note["line"] == 1 and "dropped" in note["note"]
    assert segment_events(cut, T0 + 30, 60.0, first=False, tz=UTC)["stats_notes"] == []


#: One line per pattern of jobs.signals.eventparse._PATTERNS (in its order), short forms of the
#: wordings its docstring cites: every pattern is reachable through the cheap prefilter.
PATTERN_SAMPLES = [
    ("out_of_memory", "ray.exceptions.OutOfMemoryError: Task was killed due to low memory"),
    ("out_of_memory", "RuntimeError: CUDA error: out of memory"),
    ("out_of_memory", "ValueError: No available memory for the cache blocks."),
    (
        "out_of_memory",
        "ValueError: To serve at least one request with the models's max seq len (32768), "
        "(4.00 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(1.00 GiB).",
    ),
    (
        "out_of_memory",
        "(raylet) Memory on the node (IP: 10.0.0.2, ID: abc) where the task was running was "
        "29.0GB / 30.0GB (0.96), which exceeds the memory usage threshold of 0.95.",
    ),
    ("out_of_memory", "(raylet) Ray killed this worker (ID: abc) because it was the most recent"),
    ("nccl_error", "[Rank 0] Watchdog caught collective operation timeout: Work(SeqNum=2)"),
    ("nccl_error", "host:12:12 [0] NCCL WARN Call to connect returned Connection refused"),
    ("nccl_error", "[PG 2 Rank 0] ProcessGroupNCCL watchdog thread terminated with exception"),
    ("gloo_error", "terminate called after throwing an instance of 'gloo::EnforceNotMet'"),
    (
        "gloo_error",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer",
    ),
    ("worker_died", "Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down"),
    ("worker_died", "RayWorkerProc rank=[1] died unexpectedly, shutting down executor."),
    ("worker_died", "Worker VllmWorkerProcess pid 1159 died, exit code: -6"),
    ("worker_died", "The actor died unexpectedly before finishing this task."),
    ("worker_died", "ray.exceptions.ActorDiedError: The actor died because of an error"),
    ("engine_dead", "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."),
    (
        "unhealthy",
        "Actor for Replica(id='a', deployment='D', app='x') crashed, marking it unhealthy "
        "immediately.",
    ),
    (
        "health_check_failed",
        "Health check for Replica(id='a', deployment='D', app='x') failed: boom",
    ),
    (
        "health_check_failed",
        'INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 500 Internal Server Error',
    ),
    ("preemption", "Sequence group 3 is preempted by PreemptionMode.SWAP mode because there is"),
    ("restart", "[FT] Engine 0 status -> HEALTHY"),
    ("restart", "The replica is restarting after the actor died"),
]


def test_every_pattern_has_a_sample_that_passes_the_prefilter() -> None:
    matched = {
        i
        for _, line in PATTERN_SAMPLES
        for i, (_, pattern, _) in enumerate(eventparse._PATTERNS)
        if pattern.search(line)
    }
    assert matched == set(range(len(eventparse._PATTERNS)))
    for kind, line in PATTERN_SAMPLES:
        assert [e["type"] for e in parse_events(line)] == [kind], line


# --- defects found by a fresh-user trial (issue #16) -----------------------------------


@pytest.mark.parametrize(
    "line",
    [
        # vLLM 0.32.0 request_logger.py:108 with --enable-log-outputs: a model's output
        API + "INFO 05-12 08:01:39 [request_logger.py:108] Generated response chatcmpl-abc: "
        "output: 'If PyTorch says CUDA out of memory, the worker died; restart the engine.', "
        "finish_reason: stop",
        # request_logger.py:55 at DEBUG: a prompt quoting a vLLM error record
        API + "DEBUG 05-12 08:01:39 [request_logger.py:55] Request cmpl-1 details: prompt: "
        "'why does my log say ERROR 01-02 03:04:05 [core.py:1] EngineCore encountered a "
        "fatal error.', prompt_token_ids: None, prompt_embeds shape: None.",
        # hints and chatter at INFO/WARNING/DEBUG that only mention a failure's words
        "WARNING 05-12 08:01:39 [config.py:10] If you see CUDA out of memory, reduce max_model_len",
        "INFO 05-12 08:01:39 [parallel_state.py:10] NCCL version 2.21.5 detected; no NCCL "
        "error reported",
        "DEBUG 05-12 08:01:39 [utils.py:10] health check failed count reset to 0",
        "INFO 05-12 08:01:39 [envs.py:10] engine will be restarted on failure by k8s",
        "INFO 05-12 08:01:39 [api_server.py:10] vLLM API server: OutOfMemoryError handler",
    ],
)
def test_no_event_from_prompts_outputs_or_harmless_hints(line: str) -> None:
    assert parse_events(line) == []


def test_loose_wordings_still_count_where_failures_are_written() -> None:
    """The same phrases are events in a traceback line (no level), at ERROR, or as an
    exception line at any level (torch's ``torch.OutOfMemoryError: CUDA out of memory``)."""
    assert [e["type"] for e in parse_events("torch.OutOfMemoryError: CUDA out of memory.")] == [
        "out_of_memory"
    ]
    err = EC + "ERROR 05-12 08:01:39 [core.py:1] CUDA out of memory while capturing graphs"
    assert [e["type"] for e in parse_events(err)] == ["out_of_memory"]
    warn = "WARNING 05-12 08:01:39 [x.py:1] torch.OutOfMemoryError: CUDA out of memory."
    assert [e["type"] for e in parse_events(warn)] == ["out_of_memory"]


REMOTE_OOM = (
    "(RayWorkerWrapper pid=9, ip=10.0.0.2) ERROR 05-12 08:01:39 [worker.py:1] "
    "torch.OutOfMemoryError: CUDA out of memory."
)


def test_another_nodes_local_time_is_not_placed() -> None:
    """Ray names ``ip=`` only for a worker on another node than the driver's
    (``print_worker_logs``, ``ray/_private/worker.py``); vLLM's time is that node's local
    time without a zone: unplaced, never shifted by a guessed offset; still kept by the
    run (after the runner's own record before it)."""
    berlin = timezone(timedelta(hours=2))
    t0 = datetime(2026, 5, 12, 10, 1, 30, tzinfo=berlin).timestamp()
    (ev,) = place_events(parse_events(REMOTE_OOM), t0, berlin)
    assert (ev["placement"], ev["t_s"]) == ("unplaced", None)
    assert "10.0.0.2" in ev["placement_note"]
    # the same node listed as this host's: placed as before
    (local,) = place_events(parse_events(REMOTE_OOM), T0, UTC, local_ips={"10.0.0.2"})
    assert local["placement"] == "placed"
    log = API + "INFO 05-12 10:01:35 [api_server.py:1] x\n" + REMOTE_OOM
    second = segment_events(log, t0, 10.0, first=False, tz=berlin)
    assert [(e["type"], e["after_t_s"]) for e in second["events"]] == [("out_of_memory", 5.0)]


def test_events_on_a_wrong_clock_are_kept_with_a_note() -> None:
    """Nothing vanishes: the first run keeps what lies before it (the start-up), and an
    event placed after the log was read (another clock) is kept unplaced, noted."""
    early = EC + "ERROR 05-12 06:01:39 [core.py:1] EngineCore failed to start."
    late = EC + "ERROR 05-12 10:01:39 [core.py:1] EngineCore encountered a fatal error."
    first = segment_events(early + "\n" + late, T0, 10.0, first=True, tz=UTC, log_end_s=10.0)
    assert [(e["type"], e["placement"]) for e in first["events"]] == [
        ("engine_dead", "placed"),
        ("engine_dead", "unplaced"),
    ]
    assert first["events"][0]["t_s"] < 0
    assert "later than the log was read" in first["events"][1]["placement_note"]
    later = segment_events(early, T0, 10.0, first=False, tz=UTC, log_end_s=10.0)
    assert later["events"] == []  # an earlier run's


# --- figures a wrap cut (trial of 2026-12-04: a cut exit code read as another one) -------

_WORKER_DIED = (
    "(EngineCore_DP0 pid=7) ERROR 05-12 08:01:40 [multiproc_executor.py:149] Worker proc "
    "VllmWorker-1 died unexpectedly, shutting down executor. (exit code: -11)"
)
_V0_WORKER_DIED = (
    "ERROR 05-12 08:01:40 multiproc_worker_utils.py:120] Worker VllmWorkerProcess pid 1159 "
    "died, exit code: -11"  # vllm-project/vllm#6042's shape (there -6), a SIGSEGV
)
_V0_PREEMPTED = (
    "WARNING 05-12 08:01:39 scheduler.py:1560] Sequence group 221 is preempted by "
    "PreemptionMode.RECOMPUTE mode because there is not enough KV cache space. "
    "total_num_cumulative_preemption=101"  # vllm/core/scheduler.py, GAIR-NLP/LIMO#29
)


@pytest.mark.parametrize(
    ("line", "cut_after", "key", "whole"),
    [
        (_WORKER_DIED, "exit code: -1", "exit_code", -11),
        (_V0_WORKER_DIED, "exit code: -1", "exit_code", -11),
        (_V0_PREEMPTED, "preemption=1", "cumulative_preemptions", 101),
    ],
)
def test_a_figure_cut_by_a_wrap_is_rejoined_or_left_out(
    line: str, cut_after: str, key: str, whole: int
) -> None:
    """A terminal or a log shipper wraps a long line at a column: the figure at its end
    (vLLM prints it last) is cut in two. Joined when the next line is only its tail,
    absent with a note when nothing says how it goes on, never the cut half."""
    cut = line.index(cut_after) + len(cut_after)
    head, tail = line[:cut], line[cut:]
    (ev,) = parse_events(head + "\n" + tail + "\n")
    assert ev["details"][key] == whole
    assert ev["notes"] == ["rejoined from 2 physical lines (wrapped)"]
    # the tail repeated after Ray's tag, as Ray prefixes each physical line
    if line.startswith("("):
        (ev,) = parse_events(head + "\n(EngineCore_DP0 pid=7) " + tail + "\n")
        assert ev["details"][key] == whole
    # the log read while the line was being written: no newline after the cut
    (ev,) = parse_events(head)
    assert key not in ev.get("details", {})
    assert any(key in n and "may be cut" in n for n in ev["notes"])
    # the next line goes on with a digit, but not as a number's tail: unknown
    (ev,) = parse_events(head + "\n" + "2026-12-04 10:00:00 something else\n")
    assert key not in ev.get("details", {})
    # a whole line followed by an unrelated line keeps its figure
    (ev,) = parse_events(line + "\nINFO 05-12 08:01:41 [core.py:1] next\n")
    assert ev["details"][key] == whole and "notes" not in ev
