"""Test-data factories: real rows built the way the service builds them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from orchestrator.core.models import Experiment, Run
from orchestrator.core.states import RunStatus
from orchestrator.experiments.engine_catalog import EngineArgCatalog

DATA = Path(__file__).resolve().parent / "data"


def real_catalog() -> EngineArgCatalog:
    """The argument list vLLM 0.32.0 (CPU build) printed (``vllm_launcher.py engine-args``)."""
    return EngineArgCatalog.from_doc(json.loads((DATA / "engine_args_vllm032cpu.json").read_text()))


def make_experiment(session: Session, n_runs: int = 2, **run_overrides: Any) -> Experiment:
    exp = Experiment(
        name="factory",
        spec={},
        model_id="tiny",
        model_digest="0" * 64,
        request_list_hash="1" * 64,
    )
    session.add(exp)
    session.flush()
    for i in range(n_runs):
        fields: dict[str, Any] = dict(
            experiment_id=exp.id,
            name="baseline" if i == 0 else f"v{i}",
            position=i,
            sequence=i,
            is_baseline=i == 0,
            changes={},
            status=RunStatus.QUEUED.value,
            progress={},
            engine_args={"enable_prefix_caching": i > 0},
            explicit_engine_args={"enable_prefix_caching": i > 0},
            layout={"tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            workload={"num_requests": 4},
            model_id="tiny",
            model_path="/nonexistent/tiny",
            model_digest="0" * 64,
            max_model_len=2048,
            seed=0,
            request_list_hash="1" * 64,
            engine_info={},
            timings={},
        )
        fields.update(run_overrides)
        session.add(Run(**fields))
    session.flush()
    session.refresh(exp)
    return exp
