"""Runs that fit side by side run concurrently; an exclusive-nodes run waits to be alone.

Real Postgres, real Ray (a local node with 2 CPU devices), the real
dispatcher, backend and supervisor. The engine is the test double of
``tests/jobs/test_runner_batch.py`` (a tiny OpenAI-compatible server in the
standard library), since three vLLM servers at once do not fit this machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Run
from orchestrator.core.settings import EngineSettings, OrchestratorSettings, Settings
from orchestrator.core.states import is_terminal
from orchestrator.dispatch.dispatcher import Dispatcher
from orchestrator.dispatch.ray.backend import RayRunBackend
from tests.factories import make_experiment
from tests.jobs.test_runner_batch import fake_engine_script
from tests.orchestrator.dispatch.raydb import ray_and_database


@pytest.fixture
def setup(tmp_path: Path, server_url: str) -> Iterator[dict[str, Any]]:
    with ray_and_database(
        tmp_path,
        server_url,
        fake_engine_script(),
    ) as found:
        yield found


@pytest.mark.timing
def test_side_by_side_then_exclusive(setup: dict[str, Any]) -> None:
    factory: sessionmaker[Session] = setup["factory"]
    workload = {"num_requests": 12, "prefix_tokens": 64, "output_tokens": 16, "warmup_requests": 0}
    with factory() as s:
        exp = make_experiment(
            s, n_runs=3, model_path=str(setup["model"]), workload=workload, engine_args={}
        )
        runs = sorted(exp.runs, key=lambda r: r.sequence)
        for i, r in enumerate(runs):
            r.explicit_engine_args = {}
            r.server_key = f"k{i}"  # three servers, no batching
        runs[2].layout = {**runs[2].layout, "exclusive_nodes": True}
        ids = [r.id for r in runs]
        s.commit()

    settings = Settings(
        home=setup["home"],
        engine=EngineSettings(python=setup["engine_python"], startup_timeout_s=60),
        orchestrator=OrchestratorSettings(max_concurrent_runs=3, poll_interval_s=0.2),
    )
    setup["home"].mkdir(exist_ok=True)
    dispatcher = Dispatcher(settings, factory, RayRunBackend(settings))
    stop = threading.Event()
    thread = threading.Thread(target=dispatcher.run_forever, args=(stop,), daemon=True)
    thread.start()
    seen_together = False
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with factory() as s:
                rows = {rid: s.get(Run, rid) for rid in ids}
            active = [
                r for r in rows.values() if r is not None and r.status in ("preparing", "running")
            ]
            if {r.id for r in active} >= set(ids[:2]):
                seen_together = True
                # the exclusive run cannot start while the node is shared
                assert rows[ids[2]] is not None and rows[ids[2]].status == "queued"
            if all(r is not None and is_terminal(r.status) for r in rows.values()):
                break
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(timeout=120)
    with factory() as s:
        done = [s.get(Run, rid) for rid in ids]
    assert [r.status for r in done if r] == ["succeeded"] * 3, [r.error for r in done if r]
    first, second, exclusive = done
    assert first and second and exclusive
    assert seen_together, "the two one-device runs never ran at the same time"
    assert first.placement and first.placement["policy"] == "shared_nodes"
    assert first.placement["nodes"][0]["reserved"] == 1
    assert exclusive.placement and exclusive.placement["policy"] == "exclusive_nodes"
    assert exclusive.placement["nodes"][0]["reserved"] == 2  # the whole node
    assert exclusive.claimed_at is not None and first.finished_at and second.finished_at
    assert exclusive.claimed_at >= max(first.finished_at, second.finished_at)
