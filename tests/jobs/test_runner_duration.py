"""A run with ``duration_s`` (a time-bounded measurement) is judged on the requests it
sent in its window, not on the whole request list (it always ended ``failed``: "only 48
of 2000 measured requests finished"). End to end with the project's stub server as the
engine (a test double launched the way runs launch vLLM), and :meth:`Segment.judge` on
records.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.engine.processes import group_members
from jobs.run.runner import execute_batch
from jobs.run.segment import Segment
from jobs.schemas import ChatRequest, RequestRecord, RunSegment, WorkloadSpec
from tests.jobs.test_engine_stopped import _batch, _stub_engine


def test_a_run_with_duration_s_is_judged_on_the_requests_it_sent(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A list far longer than the window: the run stops sending after ``duration_s`` and
    succeeds with what it sent."""
    planned = 2000
    job = _batch(
        tmp_path,
        tiny_model_dir,
        _stub_engine(tmp_path, loading_s=0.0),
        num_requests=planned,
        concurrency=2,
        duration_s=0.5,
    )
    [result] = execute_batch(job)
    measured = [r for r in result.requests if not r.warmup]
    assert result.status == "succeeded", result.error
    assert result.error is None and not result.partial
    assert 0 < len(measured) < planned
    assert all(r.success for r in measured)
    assert result.metrics["completed"] == len(measured)
    assert group_members(result.engine_info["pgid"]) == []


def _record(index: int, success: bool = True) -> RequestRecord:
    return RequestRecord(index=index, success=success, start_s=0.1 * index, error=None)


@pytest.mark.parametrize("duration_s", [None, 5.0])
def test_judge_counts_the_window_not_the_list(duration_s: float | None) -> None:
    workload = WorkloadSpec.model_validate(
        {"num_requests": 10, "warmup_requests": 0, "duration_s": duration_s}
    )
    seg = Segment(RunSegment(run_id="r", workload=workload), 0, 1)
    seg.requests = [
        ChatRequest(index=i, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        for i in range(workload.num_requests)
    ]
    seg.records = [_record(i) for i in range(4)]  # 4 of the 10 sent, all fine
    status, error = seg.judge()
    if duration_s is None:
        assert (status, error) == ("failed", "only 4 of 10 measured requests finished")
    else:
        assert (status, error) == ("succeeded", None)
    seg.records = [_record(0), *[_record(i, success=False) for i in range(1, 4)]]
    assert seg.judge()[0] == "failed"  # 3 of 4 failed: above the share allowed either way
