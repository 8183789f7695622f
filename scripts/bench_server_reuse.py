"""Benchmark: a 4-variant client-side sweep, one reused vLLM server vs a restart per run.

Usage (from the repo root, after `make engine`):

    .venv/bin/python scripts/bench_server_reuse.py [--model tiny] [--engine .engine-venv/bin/python]

Runs the same four variants (concurrency 1, 2, 4, 8 on the generated model)
twice through :mod:`jobs.run.runner`: once as one batch on a reused server
(prefix cache reset between runs), once with a fresh server per run. Prints
both wall times and their ratio, measured in one process one after the other
(the machine is shared and noisy: compare the ratio, not the seconds).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from jobs.modelgen.generator import generate_model
from jobs.run.runner import execute, execute_batch
from jobs.schemas import BatchJob, EngineLaunch, RunJob, RunSegment, WorkloadSpec

CONCURRENCY = (1, 2, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--engine", default=".engine-venv/bin/python")
    ap.add_argument("--requests", type=int, default=16)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vlab-bench-"))
    model = generate_model(work / args.model, args.model)

    def launch(tag: str) -> EngineLaunch:
        return EngineLaunch(
            engine_python=str(Path(args.engine).absolute()),
            model_dir=str(model),
            served_model_name=args.model,
            engine_args={"load_format": "dummy", "max_model_len": 2048},
            env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"},
            log_path=str(work / f"{tag}.log"),
        )

    workloads = [
        WorkloadSpec(num_requests=args.requests, concurrency=c, prefix_tokens=512, seed=3)
        for c in CONCURRENCY
    ]
    t0 = time.perf_counter()
    batch = execute_batch(
        BatchJob(
            launch=launch("reuse"),
            segments=[RunSegment(run_id=f"reuse-{i}", workload=w) for i, w in enumerate(workloads)],
        )
    )
    reuse_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh = [
        execute(RunJob(run_id=f"restart-{i}", launch=launch(f"restart-{i}"), workload=w))
        for i, w in enumerate(workloads)
    ]
    restart_s = time.perf_counter() - t0
    statuses = [r.status for r in batch + fresh]
    print(f"model={args.model} variants={len(workloads)} requests/run={args.requests}")
    print(f"statuses: {statuses}")
    print(f"reused server : {reuse_s:7.1f} s wall")
    print(f"restart per run: {restart_s:7.1f} s wall")
    print(f"ratio restart/reuse: {restart_s / reuse_s:.2f}x")
    for r in batch:
        print(
            f"  {r.run_id}: startup_s={r.timings.get('startup_s', 0):.1f} "
            f"startup_saved_s={r.timings.get('startup_saved_s', 0):.1f} "
            f"median_ttft_ms={r.metrics.get('median_ttft_ms', float('nan')):.1f}"
        )


if __name__ == "__main__":
    main()
