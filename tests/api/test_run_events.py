"""``GET /api/v1/runs/{id}/events``: the run's engine events, paginated and filtered, from
what the runner stored (``engine_info["engine_events"]``, :mod:`jobs.signals.engineevents`).

The stored events are the runner's own output for a real shape: vLLM 0.32's
``EngineCore encountered a fatal error.`` (``vllm/v1/engine/core.py:1512``) with the
torch OOM of its traceback, a V0 preemption warning (GAIR-NLP/LIMO#29) and a raw
traceback line without a time.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from jobs.signals.engineevents import EVENT_TYPES, segment_info
from tests.factories import make_experiment

PROBLEM = "application/problem+json"
LOG = "\n".join(
    [
        "WARNING 05-12 08:01:35 scheduler.py:1560] Sequence group 7 is preempted by "
        "PreemptionMode.RECOMPUTE mode because there is not enough KV cache space. "
        "total_num_cumulative_preemption=1",
        "(EngineCore_DP0 pid=7) ERROR 05-12 08:01:39 [core.py:1512] EngineCore encountered a "
        "fatal error.",
        "(EngineCore_DP0 pid=7) ERROR 05-12 08:01:39 [core.py:1512] torch.OutOfMemoryError: "
        "CUDA out of memory. Tried to allocate 2.00 GiB.",
        "RuntimeError: NCCL error: unhandled system error",
    ]
)


def _run_with_events(session_factory: sessionmaker[Session], info: dict[str, object]) -> str:
    with session_factory() as s:
        exp = make_experiment(s, n_runs=1, status="succeeded", engine_info=info)
        run_id = exp.runs[0].id
        s.commit()
    return run_id


def test_run_events_pages_and_filters(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    t0 = datetime(2026, 5, 12, 8, 1, 30, tzinfo=UTC).timestamp()
    info = segment_info(LOG, t0, 60.0, True)
    run_id = _run_with_events(session_factory, info)

    doc = client.get(f"/api/v1/runs/{run_id}/events").json()
    assert doc["recorded"] is True and doc["types"] == EVENT_TYPES
    assert doc["total"] == 4 and doc["summary"]["by_type"]["engine_dead"] == 1
    assert [(e["type"], e["placement"]) for e in doc["items"]] == [
        ("preemption", "placed"),
        ("engine_dead", "placed"),
        ("out_of_memory", "placed"),
        ("nccl_error", "unplaced"),
    ]
    assert [e["t_s"] for e in doc["items"]] != [None] * 4
    nccl = doc["items"][3]
    assert nccl["t_s"] is None and nccl["after_t_s"] == doc["items"][2]["t_s"]
    assert doc["items"][1]["source"] == "EngineCore_DP0" and doc["items"][1]["pid"] == 7

    page = client.get(f"/api/v1/runs/{run_id}/events", params={"limit": 2, "offset": 1}).json()
    assert [e["type"] for e in page["items"]] == ["engine_dead", "out_of_memory"]
    assert (page["total"], page["limit"], page["offset"]) == (4, 2, 1)

    oom = client.get(f"/api/v1/runs/{run_id}/events", params={"type": "out_of_memory"}).json()
    assert [e["line"] for e in oom["items"]] == [3] and oom["total"] == 1
    unplaced = client.get(f"/api/v1/runs/{run_id}/events", params={"placement": "unplaced"})
    assert [e["type"] for e in unplaced.json()["items"]] == ["nccl_error"]

    bad = client.get(f"/api/v1/runs/{run_id}/events", params={"type": "oom"})
    assert bad.status_code == 422 and bad.headers["content-type"] == PROBLEM
    assert "out_of_memory" in bad.json()["detail"]
    missing = client.get("/api/v1/runs/nope/events")
    assert missing.status_code == 404 and missing.headers["content-type"] == PROBLEM


def test_run_without_stored_events_is_unknown_not_none(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    old = _run_with_events(session_factory, {"stats_lines": []})
    doc = client.get(f"/api/v1/runs/{old}/events").json()
    assert doc["recorded"] is False and doc["items"] == [] and doc["summary"] is None
    empty = _run_with_events(session_factory, segment_info("", 0.0, 10.0, True))
    doc = client.get(f"/api/v1/runs/{empty}/events").json()
    assert doc["recorded"] is True and doc["total"] == 0
