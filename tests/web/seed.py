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

from sqlalchemy import insert, text
from sqlalchemy.orm import Session

from orchestrator.core.models import (
    RUN_SORT_METRICS,
    Experiment,
    Run,
    RunLog,
    RunMetric,
    RunRequest,
    RunSample,
)
from orchestrator.core.repositories import RunRepository

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
    if exp_doc.get("created_at"):  # shifted as its runs are: the history orders by it
        created = datetime.fromisoformat(exp_doc["created_at"])
        exp.created_at = created + shift if shift else created
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
            RunRepository(session).sync_sort_keys([run.id])
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
                    "created_at": start + timedelta(minutes=e),
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
            metrics = {
                "median_ttft_ms": 10 + i + e / 1000,
                "p99_ttft_ms": 20 + i + e / 1000,
                "median_e2el_ms": 100 + i,
                "output_throughput": 500.0 - i,
                "prefix_cache_hit_rate": 0.5 if apc else 0.0,
            }
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
                    **{col: metrics[name] for name, col in RUN_SORT_METRICS.items()},
                }
            )
            for name, value in metrics.items():
                metric_rows.append({"run_id": rid, "name": name, "value": value})
        session.execute(insert(Run), run_rows)
        session.execute(insert(RunMetric), metric_rows)
    session.flush()
    return exp_ids


def bulk_history_sql(
    session: Session,
    *,
    experiments: int,
    runs_per_experiment: int,
    model: str = "bulk-model",
    start: datetime | None = None,
    name_prefix: str = "bulk",
) -> None:
    """:func:`bulk_history`'s runs, set-based (``INSERT ... SELECT generate_series``): a
    million runs in minutes, not hours. Same values as :func:`bulk_history`, except that
    experiment ``e`` is named ``<name_prefix>-<e // 500:03d>-<e % 500:05d>`` (the
    benchmark's former chunks of 500 experiments).
    """
    params = {
        "n": experiments,
        "r": runs_per_experiment,
        "model": model,
        "start": start or datetime(2026, 1, 1, tzinfo=UTC),
        "prefix": name_prefix,
    }
    session.execute(
        text(
            "CREATE TEMP TABLE seed_e ON COMMIT DROP AS SELECT e, gen_random_uuid()::text AS id,"
            " CAST(:start AS timestamptz) + e * interval '1 minute' AS created"
            " FROM generate_series(0, :n - 1) AS e"
        ),
        params,
    )
    session.execute(
        text(
            "INSERT INTO experiments (id, name, spec, model_id, model_digest,"
            " request_list_hash, created_at)"
            " SELECT id, :prefix || '-' || lpad((e / 500)::text, 3, '0') || '-'"
            " || lpad((e % 500)::text, 5, '0'), '{}', :model, repeat('0', 64),"
            " repeat('1', 64), created FROM seed_e"
        ),
        params,
    )
    session.execute(
        text(
            "CREATE TEMP TABLE seed_r ON COMMIT DROP AS SELECT gen_random_uuid()::text AS id,"
            " s.id AS eid, s.e, s.created, i, i % 2 = 1 AS apc,"
            " 10 + i + s.e / 1000.0 AS ttft50, 20 + i + s.e / 1000.0 AS ttft99,"
            " 100.0 + i AS e2el50, 500.0 - i AS tput,"
            " CASE WHEN i % 2 = 1 THEN 0.5 ELSE 0.0 END AS hit"
            " FROM seed_e AS s CROSS JOIN generate_series(0, :r - 1) AS i"
        ),
        params,
    )
    session.execute(
        text(
            "INSERT INTO runs (id, experiment_id, name, position, sequence, is_baseline,"
            " changes, variable, status, cancel_requested, progress, created_at, started_at,"
            " finished_at, engine_args, explicit_engine_args, layout, workload, model_id,"
            " model_path, model_digest, max_model_len, seed, request_list_hash, engine_info,"
            " timings, sort_ttft_p50, sort_ttft_p99, sort_e2el_p50, sort_output_throughput,"
            " sort_hit_rate)"
            " SELECT id, eid, CASE WHEN i = 0 THEN 'baseline' ELSE 'v' || i END, i, i, i = 0,"
            " CASE WHEN i = 0 THEN '{}'::jsonb ELSE jsonb_build_object("
            "'engine_args.enable_prefix_caching', apc) END,"
            " CASE WHEN i = 0 THEN NULL ELSE 'enable_prefix_caching' END,"
            " CASE WHEN (e * :r + i) % 7 = 6 THEN 'failed' ELSE 'succeeded' END, false, '{}',"
            " created, created + 10 * i * interval '1 second',"
            " created + (11 * i + 5) * interval '1 second',"
            " jsonb_build_object('enable_prefix_caching', apc, 'max_num_seqs', 64 + i),"
            " jsonb_build_object('enable_prefix_caching', apc),"
            ' \'{"tensor_parallel_size": 1, "pipeline_parallel_size": 1}\','
            " '{\"num_requests\": 8}', CAST(:model AS text),"
            " '/models/' || CAST(:model AS text), repeat('0', 64), 2048, 0,"
            " repeat('1', 64), '{}', '{}', ttft50, ttft99, e2el50, tput, hit FROM seed_r"
        ),
        params,
    )
    session.execute(
        text(
            "INSERT INTO run_metrics (run_id, name, value) SELECT r.id, m.name, m.value"
            " FROM seed_r AS r CROSS JOIN LATERAL (VALUES ('median_ttft_ms', r.ttft50),"
            " ('p99_ttft_ms', r.ttft99), ('median_e2el_ms', r.e2el50),"
            " ('output_throughput', r.tput), ('prefix_cache_hit_rate', r.hit)) AS m(name, value)"
        )
    )


#: The two GPUs of :func:`gpu_runs`' GPU run: (node rank, node id, index, UUID).
GPUS = (
    (0, "a1" * 28, 2, "GPU-0c6f3a52-8d1e-4b7a-9f21-3e5d6c7b8a90"),
    (1, "b2" * 28, 5, "GPU-7d1e9b40-2a3c-4f5e-8d6b-1c2a3b4c5d6e"),
)
GPU_NAME = "NVIDIA H100 80GB HBM3"
GPU_MEMORY_MIB = 81559.0
MODEL_REVISION = "0123456789abcdef0123456789abcdef01234567"
CPU_NOTE = "this process holds no GPU through Ray (CPU device kind)"


def _gpu_values(i: int) -> dict[str, float]:
    """GPU sample keys of sample ``i`` (0-based) of the GPU run: two GPUs."""
    out: dict[str, float] = {}
    for k in range(len(GPUS)):
        out[f"gpu{k}_utilization_pct"] = 50.0 + 10 * i + k
        out[f"gpu{k}_memory_used_mib"] = 40960.0 + 1024 * i + 512 * k
        out[f"gpu{k}_power_w"] = 150.0 + 10 * i + 50 * k
        out[f"gpu{k}_energy_j"] = 1000.0 * (k + 1) + 180.0 * i
    out["gpu_utilization_pct"] = sum(out[f"gpu{k}_utilization_pct"] for k in range(2)) / 2
    out["gpu_memory_used_mib"] = sum(out[f"gpu{k}_memory_used_mib"] for k in range(2))
    out["gpu_power_w"] = sum(out[f"gpu{k}_power_w"] for k in range(2))
    out["gpu_energy_j"] = sum(out[f"gpu{k}_energy_j"] for k in range(2))
    return out


def gpu_runs(session: Session, *, name: str = "gpu telemetry") -> dict[str, Any]:
    """Insert an experiment with two finished runs as a GPU cluster and a CPU cluster
    store them (``engine_info["gpu_assignment"]``/``["gpu_telemetry"]``, placement
    executor and device kind, GPU summary metrics and ``gpu{k}_*`` sample keys).

    ``gpu``: two nodes (PP 2) with one GPU each (:data:`GPUS`), NVML telemetry with
    the energy counter, a pinned model revision and its resolution, five samples
    (before, 3 during, after) with GPU keys. ``cpu``: one CPU node holding no GPU,
    samples without GPU keys, no GPU metrics. Returns ``{"experiment_id", "gpu",
    "cpu", "metrics": {"gpu": ..., "cpu": ...}, "samples": {"gpu": ..., "cpu": ...}}``.
    """
    exp_id = str(uuid.uuid4())
    session.add(
        Experiment(
            id=exp_id,
            name=name,
            spec={},
            model_id="org/gpu-model",
            model_digest="0" * 64,
            model_revision=MODEL_REVISION,
            request_list_hash="1" * 64,
        )
    )
    session.flush()
    start = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)

    def run_row(run_name: str, position: int) -> dict[str, Any]:
        return {
            "id": str(uuid.uuid4()),
            "experiment_id": exp_id,
            "name": run_name,
            "position": position,
            "sequence": position,
            "is_baseline": position == 0,
            "status": "succeeded",
            "progress": {},
            "created_at": start,
            "started_at": start + timedelta(seconds=1),
            "finished_at": start + timedelta(seconds=9),
            "engine_args": {"max_num_seqs": 64},
            "explicit_engine_args": {},
            "layout": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            "workload": {"num_requests": 8},
            "model_id": "org/gpu-model",
            "model_path": "/models/org/gpu-model",
            "model_digest": "0" * 64,
            "model_revision": None,
            "max_model_len": 2048,
            "seed": 0,
            "request_list_hash": "1" * 64,
            "timings": {},
        }

    def samples(with_gpu: bool) -> list[dict[str, Any]]:
        out = []
        for i, phase in enumerate(("before", "during", "during", "during", "after")):
            values: dict[str, float] = {
                "kv_cache_usage": 0.1 * i,
                "num_requests_running": float(i),
                "num_requests_waiting": 0.0,
                "generation_tokens": 1000.0 * i,
                "prompt_tokens": 2000.0 * i,
            }
            if with_gpu:
                values.update(_gpu_values(i))
            out.append({"t_s": 2.0 + i, "phase": phase, "values": values})
        return out

    node_ids = [n for _, n, _, _ in GPUS]
    gpu = run_row("gpu", 0)
    gpu.update(
        model_revision=MODEL_REVISION,
        layout={"tensor_parallel_size": 1, "pipeline_parallel_size": 2},
        engine_info={
            "gpu_assignment": [
                {
                    "node_rank": rank,
                    "node_id": node_id,
                    "cuda_visible_devices": str(index),
                    "ray_gpu_ids": [str(index)],
                    "gpus": [
                        {
                            "index": index,
                            "uuid": gpu_uuid,
                            "name": GPU_NAME,
                            "memory_total_mib": GPU_MEMORY_MIB,
                            "local_rank": 0,
                            "rank": rank,
                        }
                    ],
                    "telemetry": "nvml",
                    "note": "",
                }
                for rank, node_id, index, gpu_uuid in GPUS
            ],
            "gpu_telemetry": {
                "available": True,
                "source": "nvml",
                "energy_source": "nvml_energy_counter",
                "notes": [],
            },
            "model_resolution": {
                "source": "hf_cache",
                "path": f"/root/.cache/huggingface/hub/models--org--gpu-model/snapshots/"
                f"{MODEL_REVISION}",
                "revision": MODEL_REVISION,
                "hf_cache": "/root/.cache/huggingface/hub",
                "offline": True,
                "weights_cached": True,
                "files": [
                    {"path": "config.json", "size": 612},
                    {"path": "model.safetensors", "size": 1_000_000},
                ],
            },
        },
        placement={
            "nodes": [
                {
                    "rank": rank,
                    "node_id": node_id,
                    "ip": f"10.0.0.{rank + 1}",
                    "devices": 1,
                    "reserved": 1,
                    "bundles": [rank],
                    "stages": [rank],
                }
                for rank, node_id in enumerate(node_ids)
            ],
            "nnodes": 2,
            "exclusive": False,
            "policy": "shared_nodes",
            "resource": "GPU",
            "executor": "mp",
            "device_kind_source": "detected",
            "bundle_shape": "per_node",
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 2,
        },
    )
    cpu = run_row("cpu", 1)
    cpu.update(
        engine_info={
            "gpu_assignment": [
                {
                    "node_rank": 0,
                    "node_id": "c3" * 28,
                    "cuda_visible_devices": None,
                    "ray_gpu_ids": [],
                    "gpus": [],
                    "telemetry": None,
                    "note": CPU_NOTE,
                }
            ],
            "gpu_telemetry": {"available": False, "note": CPU_NOTE},
        },
        placement={
            "nodes": [
                {
                    "rank": 0,
                    "node_id": "c3" * 28,
                    "ip": "10.0.1.1",
                    "devices": 1,
                    "reserved": 1,
                    "bundles": [0],
                    "stages": [0],
                    "cpu_binding": "0-3",
                }
            ],
            "nnodes": 1,
            "exclusive": False,
            "policy": "shared_nodes",
            "resource": "CPU",
            "executor": "mp",
            "device_kind_source": "setting",
            "bundle_shape": "per_device",
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
        },
    )
    session.execute(insert(Run), [gpu, cpu])
    common = {"median_ttft_ms": 12.5, "output_throughput": 750.0, "total_output_tokens": 3000.0}
    metrics = {
        "gpu": {
            **common,
            "gpu_energy_j": 1440.0,
            "energy_per_output_token_j": 0.48,
            "gpu_mean_power_w": 180.04,
            "gpu_peak_memory_used_mib": 45568.0,
            "gpu_mean_utilization_pct": 70.5,
        },
        "cpu": dict(common),
    }
    sample_rows = {"gpu": samples(True), "cpu": samples(False)}
    for key, row in (("gpu", gpu), ("cpu", cpu)):
        session.execute(
            insert(RunMetric),
            [{"run_id": row["id"], "name": k, "value": v} for k, v in metrics[key].items()],
        )
        RunRepository(session).sync_sort_keys([row["id"]])
        session.execute(insert(RunSample), [{"run_id": row["id"], **s} for s in sample_rows[key]])
    session.flush()
    return {
        "experiment_id": exp_id,
        "gpu": gpu["id"],
        "cpu": cpu["id"],
        "metrics": metrics,
        "samples": sample_rows,
    }


#: The capacity objectives of :func:`capacity_runs` (``CapacitySpec.slos``).
CAPACITY_SLOS = {"ttft_ms": {"p99": 500.0}, "tpot_ms": {"p99": 50.0}}


def _capacity_step(
    index: int,
    load: float,
    ttft: tuple[float, float, float],
    tpot: tuple[float, float, float],
    *,
    tokens: tuple[float, float],
    waiting: tuple[float, float, float] = (0.0, 0.0, 1.0),
    kv: float = 0.3,
    saturated: str | None = None,
) -> dict[str, Any]:
    """One ``CapacityStep`` dump: ``ttft``/``tpot`` are the p99 ``(value, ci_low,
    ci_high)`` checked against :data:`CAPACITY_SLOS`; each check's and the step's verdict
    follow the search's rule (interval under: pass, over: fail, straddling: uncertain)."""

    def check(metric: str, objective: float, vals: tuple[float, float, float]) -> dict[str, Any]:
        value, lo, hi = vals
        verdict = "pass" if hi <= objective else "fail" if lo > objective else "uncertain"
        return {
            "metric": metric, "percentile": "p99", "objective": objective,
            "value": value, "ci_low": lo, "ci_high": hi, "verdict": verdict,
        }  # fmt: skip

    checks = [check("ttft_ms", 500.0, ttft), check("tpot_ms", 50.0, tpot)]
    verdicts = {c["verdict"] for c in checks}
    verdict = (
        "fail"
        if "fail" in verdicts or saturated
        else "uncertain"
        if "uncertain" in verdicts
        else "pass"
    )
    output, per_user = tokens
    return {
        "index": index,
        "load": load,
        "requests": 64,
        "failed": 0,
        "duration_s": round(64 / load, 2),
        "percentiles": {
            "ttft_ms": {
                "p50": round(ttft[0] * 0.45, 1),
                "p90": round(ttft[0] * 0.8, 1),
                "p99": ttft[0],
            },
            "tpot_ms": {"p50": round(tpot[0] * 0.7, 1), "p99": tpot[0]},
        },
        "goodput": 1.0 if verdict == "pass" else 0.8 if verdict == "uncertain" else 0.4,
        "output_tokens_per_s": output,
        "output_tokens_per_s_per_user": per_user,
        "signals": {
            "waiting_first": waiting[0],
            "waiting_last": waiting[1],
            "waiting_max": waiting[2],
            "kv_cache_usage_max": kv,
            "dispatch_lag_p99_ms": 1.5,
        },
        "checks": checks,
        "saturated": saturated,
        "verdict": verdict,
    }  # fmt: skip


def capacity_documents() -> dict[str, dict[str, Any]]:
    """Hand-written ``CapacityResult`` dumps (``runs.capacity``) of :func:`capacity_runs`.

    ``baseline``: found, 2.1 req/s, bracket [2.1, 2.2], bound by TTFT p99; ``apc-on``:
    found, 4.2 req/s, bracket [4.2, 4.4]; ``tp2``: uncertain at 4.5 req/s (TTFT p99's
    interval straddles 500 ms twice), no capacity.
    """
    sat = "waiting requests grew through the step (0 -> 41)"
    baseline = [
        _capacity_step(0, 1.0, (180.0, 160.0, 205.0), (22.0, 20.0, 24.0), tokens=(100.0, 48.0)),
        _capacity_step(1, 8.0, (2400.0, 2100.0, 2800.0), (70.0, 65.0, 78.0), tokens=(260.0, 14.0),
                       waiting=(0.0, 41.0, 41.0), kv=0.97, saturated=sat),
        _capacity_step(2, 2.8, (720.0, 640.0, 810.0), (41.0, 38.0, 45.0), tokens=(240.0, 30.0)),
        _capacity_step(3, 2.1, (430.0, 390.0, 470.0), (33.0, 30.0, 36.0), tokens=(210.0, 40.0)),
        _capacity_step(4, 2.2, (560.0, 510.0, 620.0), (35.0, 32.0, 38.0), tokens=(215.0, 38.0)),
    ]  # fmt: skip
    apc = [
        _capacity_step(0, 1.0, (90.0, 80.0, 101.0), (21.0, 19.0, 23.0), tokens=(100.0, 50.0)),
        _capacity_step(1, 8.0, (1900.0, 1700.0, 2200.0), (66.0, 60.0, 72.0), tokens=(520.0, 16.0),
                       waiting=(0.0, 30.0, 30.0), kv=0.95, saturated=sat),
        _capacity_step(2, 4.0, (380.0, 350.0, 420.0), (30.0, 28.0, 33.0), tokens=(390.0, 37.0)),
        _capacity_step(3, 4.6, (650.0, 590.0, 720.0), (36.0, 33.0, 39.0), tokens=(430.0, 33.0)),
        _capacity_step(4, 4.2, (450.0, 410.0, 490.0), (31.0, 29.0, 34.0), tokens=(400.0, 36.0)),
        _capacity_step(5, 4.4, (540.0, 505.0, 590.0), (32.0, 30.0, 35.0), tokens=(410.0, 35.0)),
    ]  # fmt: skip
    tp2 = [
        _capacity_step(0, 1.0, (150.0, 130.0, 170.0), (25.0, 23.0, 27.0), tokens=(100.0, 42.0)),
        _capacity_step(1, 8.0, (2100.0, 1900.0, 2400.0), (68.0, 62.0, 75.0), tokens=(400.0, 15.0),
                       waiting=(0.0, 35.0, 35.0), kv=0.96, saturated=sat),
        _capacity_step(2, 4.5, (495.0, 450.0, 540.0), (38.0, 35.0, 41.0), tokens=(380.0, 26.0)),
        _capacity_step(3, 4.5, (505.0, 460.0, 552.0), (38.0, 35.0, 42.0), tokens=(378.0, 26.0)),
    ]  # fmt: skip
    return {
        "baseline": {
            "variable": "request_rate", "status": "found", "capacity": 2.1,
            "interval": [2.1, 2.2], "binding_slo": "ttft_ms:p99", "steps": baseline, "note": None,
        },
        "apc-on": {
            "variable": "request_rate", "status": "found", "capacity": 4.2,
            "interval": [4.2, 4.4], "binding_slo": "ttft_ms:p99", "steps": apc, "note": None,
        },
        "tp2": {
            "variable": "request_rate", "status": "uncertain", "capacity": None,
            "interval": [1.0, 8.0], "binding_slo": None, "steps": tp2,
            "note": "TTFT p99 straddled 500 ms at 4.5 req/s after 1 re-measurement",
        },
    }  # fmt: skip


#: Summary metrics of :func:`capacity_runs`' runs: (output_throughput, mean_tpot_ms).
CAPACITY_RUN_METRICS = {"baseline": (205.0, 26.0), "apc-on": (395.0, 28.0), "tp2": (380.0, 40.0)}


def capacity_runs(session: Session, *, name: str = "capacity") -> dict[str, Any]:
    """Insert an experiment whose three succeeded runs carry capacity searches
    (:func:`capacity_documents`): baseline (APC off, TP 1), ``apc-on`` (APC on) and
    ``tp2`` (TP 2), each reserving 2 devices, one repeat each, ``capacity*`` summary
    metrics for the found ones (as the runner stores them). Pareto (tokens/s per user,
    tokens/s per device): baseline (40, 105) and apc-on (36, 200) from their capacity
    steps are non-dominated; tp2 (1000/40 = 25, 380/2 = 190) from its metrics is
    dominated by apc-on. Returns ``{"experiment_id", "runs": {variant: id}, "documents"}``.
    """
    docs = capacity_documents()
    exp_id = str(uuid.uuid4())
    variants = [
        {"name": "baseline", "position": 0, "reference": None, "variable": None,
         "variable_paths": [], "changes": {}},
        {"name": "apc-on", "position": 1, "reference": "baseline",
         "variable": "engine_args.enable_prefix_caching",
         "variable_paths": ["engine_args.enable_prefix_caching"],
         "changes": {"engine_args.enable_prefix_caching": True}},
        {"name": "tp2", "position": 2, "reference": "baseline",
         "variable": "layout.tensor_parallel_size",
         "variable_paths": ["layout.tensor_parallel_size"],
         "changes": {"layout.tensor_parallel_size": 2}},
    ]  # fmt: skip
    capacity_spec = {
        "slos": CAPACITY_SLOS, "goodput": None, "variable": "request_rate", "min": 1.0,
        "max": 8.0, "tolerance": 0.05, "max_steps": 12, "requests_per_step": 64,
        "confidence": 0.95, "remeasure": 1,
    }  # fmt: skip
    session.add(
        Experiment(
            id=exp_id,
            name=name,
            spec={"name": name, "capacity": capacity_spec},
            model_id="small",
            model_digest="0" * 64,
            request_list_hash="1" * 64,
            repeats=1,
            variants=variants,
        )
    )
    session.flush()
    start = datetime(2026, 3, 4, 9, 0, tzinfo=UTC)
    ids = {v["name"]: str(uuid.uuid4()) for v in variants}
    rows = []
    for i, v in enumerate(variants):
        vname = str(v["name"])
        apc = vname == "apc-on"
        tp = 2 if vname == "tp2" else 1
        rows.append(
            {
                "id": ids[vname],
                "experiment_id": exp_id,
                "reference_run_id": ids["baseline"] if v["reference"] else None,
                "name": vname,
                "position": i,
                "sequence": i,
                "is_baseline": i == 0,
                "reference_variant": v["reference"],
                "variable": v["variable"],
                "variable_paths": v["variable_paths"],
                "changes": v["changes"],
                "status": "succeeded",
                "progress": {},
                "created_at": start,
                "started_at": start + timedelta(minutes=3 * i, seconds=1),
                "finished_at": start + timedelta(minutes=3 * i + 2),
                "engine_args": {"enable_prefix_caching": apc, "max_num_seqs": 64},
                "explicit_engine_args": {"enable_prefix_caching": apc},
                "layout": {"devices": 2, "tensor_parallel_size": tp, "pipeline_parallel_size": 1},
                "workload": {"arrival": "poisson", "num_requests": 64},
                "model_id": "small",
                "model_path": "/models/small",
                "model_digest": "0" * 64,
                "max_model_len": 2048,
                "seed": 0,
                "request_list_hash": "1" * 64,
                "engine_info": {},
                "timings": {},
                "capacity": docs[vname],
            }
        )
    session.execute(insert(Run), rows)
    metric_rows = []
    for vname, (tput, tpot) in CAPACITY_RUN_METRICS.items():
        values = {"output_throughput": tput, "mean_tpot_ms": tpot, "median_tpot_ms": tpot}
        doc = docs[vname]
        if doc["status"] == "found":
            low, high = doc["interval"]
            values.update(
                capacity=doc["capacity"],
                capacity_per_device=doc["capacity"] / 2,
                capacity_low=low,
                capacity_high=high,
            )
        metric_rows += [{"run_id": ids[vname], "name": k, "value": x} for k, x in values.items()]
    session.execute(insert(RunMetric), metric_rows)
    RunRepository(session).sync_sort_keys(list(ids.values()))
    session.flush()
    return {"experiment_id": exp_id, "runs": ids, "documents": docs}
