"""Load dashboard test data into a database.

``load_export`` inserts an experiment exactly as the API served it after a real
run (``scripts/export_experiment.py``; files in ``tests/web/data``), with fresh
ids. ``bulk_history`` inserts many small runs with known metrics for the
filter/sort/pagination tests and the history benchmark.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from orchestrator.models import Experiment, Run, RunLog, RunMetric, RunRequest, RunSample

DATA = Path(__file__).resolve().parent / "data"

_RUN_FIELDS = (  # noqa: SIM905
    "name position is_baseline reference_variant variable variable_paths changes repeat_index "
    "sequence server_key resolved_config status status_reason progress created_at started_at "
    "finished_at model_id model_path model_digest max_model_len seed request_list_hash "
    "vllm_version layout workload explicit_engine_args engine_args engine_info timings error "
    "partial placement"
).split()


def load_export(
    session: Session, path: Path, *, name: str | None = None, shift: timedelta | None = None
) -> dict[str, Any]:
    """Insert the exported experiment; return ``{"experiment_id", "runs": {name#repeat: id}}``."""
    doc = json.loads(path.read_text())
    exp_doc = doc["experiment"]
    exp = Experiment(
        id=str(uuid.uuid4()),
        name=name or exp_doc["name"],
        description=exp_doc.get("description"),
        spec=exp_doc["spec"],
        model_id=exp_doc["model_id"],
        model_digest=exp_doc["model_digest"],
        request_list_hash=exp_doc["request_list_hash"],
        repeats=exp_doc["repeats"],
        variants=exp_doc["variants"],
    )
    session.add(exp)
    session.flush()
    ids = {r["id"]: str(uuid.uuid4()) for r in exp_doc["runs"]}
    out: dict[str, str] = {}
    for r in exp_doc["runs"]:
        fields = {k: r[k] for k in _RUN_FIELDS if k in r}
        for k in ("created_at", "started_at", "finished_at"):
            if fields.get(k):
                t = datetime.fromisoformat(fields[k])
                fields[k] = t + shift if shift else t
        run = Run(
            id=ids[r["id"]],
            experiment_id=exp.id,
            reference_run_id=ids.get(r["reference_run_id"] or ""),
            **fields,
        )
        if r.get("parity") is None and doc["runs"][r["id"]].get("parity"):
            run.parity = doc["runs"][r["id"]]["parity"]["report"]
        session.add(run)
        session.flush()
        extra = doc["runs"][r["id"]]
        metrics = extra["metrics"]["metrics"]
        if metrics:
            session.execute(
                insert(RunMetric),
                [{"run_id": run.id, "name": k, "value": v} for k, v in metrics.items()],
            )
        samples = extra["metrics"]["samples"]
        if samples:
            session.execute(
                insert(RunSample),
                [
                    {"run_id": run.id, "t_s": s["t_s"], "phase": s["phase"], "values": s["values"]}
                    for s in samples
                ],
            )
        if extra["requests"]:
            session.execute(
                insert(RunRequest), [{"run_id": run.id, **q} for q in extra["requests"]]
            )
        if extra.get("log"):
            session.add(RunLog(run_id=run.id, content=extra["log"]))
        out[f"{r['name']}#{r['repeat_index']}"] = run.id
    session.flush()
    return {"experiment_id": exp.id, "runs": out}


def bulk_history(
    session: Session,
    *,
    experiments: int,
    runs_per_experiment: int,
    model: str = "bulk-model",
    start: datetime | None = None,
    name_prefix: str = "bulk",
) -> list[str]:
    """Insert ``experiments`` x ``runs_per_experiment`` finished runs with summary metrics.

    Run ``i`` of experiment ``e`` has ``median_ttft_ms = 10 + i + e/1000``,
    ``enable_prefix_caching = (i % 2 == 1)``, status ``succeeded`` except every
    7th run (``failed``), and was submitted ``e`` minutes after ``start``.
    Returns the experiment ids.
    """
    start = start or datetime(2026, 1, 1, tzinfo=UTC)
    exp_ids = []
    for e in range(experiments):
        exp_id = str(uuid.uuid4())
        exp_ids.append(exp_id)
        session.execute(
            insert(Experiment),
            [
                {
                    "id": exp_id,
                    "name": f"{name_prefix}-{e:05d}",
                    "spec": {},
                    "model_id": model,
                    "model_digest": "0" * 64,
                    "request_list_hash": "1" * 64,
                }
            ],
        )
        created = start + timedelta(minutes=e)
        run_rows = []
        metric_rows = []
        for i in range(runs_per_experiment):
            rid = str(uuid.uuid4())
            apc = i % 2 == 1
            run_rows.append(
                {
                    "id": rid,
                    "experiment_id": exp_id,
                    "name": "baseline" if i == 0 else f"v{i}",
                    "position": i,
                    "sequence": i,
                    "is_baseline": i == 0,
                    "changes": {} if i == 0 else {"engine_args.enable_prefix_caching": apc},
                    "variable": None if i == 0 else "enable_prefix_caching",
                    "status": "failed" if (e * runs_per_experiment + i) % 7 == 6 else "succeeded",
                    "progress": {},
                    "created_at": created,
                    "started_at": created + timedelta(seconds=10 * i),
                    "finished_at": created + timedelta(seconds=10 * i + 5 + i),
                    "engine_args": {"enable_prefix_caching": apc, "max_num_seqs": 64 + i},
                    "explicit_engine_args": {"enable_prefix_caching": apc},
                    "layout": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1},
                    "workload": {"num_requests": 8},
                    "model_id": model,
                    "model_path": "/models/" + model,
                    "model_digest": "0" * 64,
                    "max_model_len": 2048,
                    "seed": 0,
                    "request_list_hash": "1" * 64,
                    "engine_info": {},
                    "timings": {},
                }
            )
            for name, value in (
                ("median_ttft_ms", 10 + i + e / 1000),
                ("p99_ttft_ms", 20 + i + e / 1000),
                ("median_e2el_ms", 100 + i),
                ("output_throughput", 500.0 - i),
                ("prefix_cache_hit_rate", 0.5 if apc else 0.0),
            ):
                metric_rows.append({"run_id": rid, "name": name, "value": value})
        session.execute(insert(Run), run_rows)
        session.execute(insert(RunMetric), metric_rows)
    session.flush()
    return exp_ids
