"""Measure: seconds from a SIGSTOP of the engine's API server mid-measure to the failed run.

Usage (from the repo root):

    .venv/bin/python scripts/measure_hang.py [--runs 5] [--engine PYTHON]

Each run starts an engine for one run through :func:`jobs.run.runner.execute_batch` (by
default the project's stub server as the engine, a test double launched the way runs
launch vLLM, logging vLLM's access and stats lines; ``--engine .engine-venv/bin/python``
for the real one), SIGSTOPs the engine's API server (the launcher's process) once 3
measured requests finished, and times SIGSTOP -> ``execute_batch`` returned (the run
``failed``, the engine stopped). Prints each run's seconds, status, partial flag and
whether any engine process is left, then the median; with ``--show-error`` the first
run's error text. Nothing here depends on the hang detector's own module, so the same
script measures an older checkout (``PYTHONPATH=<old tree>``).
"""

from __future__ import annotations

import argparse
import os
import signal
import stat
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jobs.engine.processes import group_members
from jobs.modelgen.generator import generate_model
from jobs.run.runner import execute_batch
from jobs.schemas import BatchJob, EngineLaunch, Progress, RunSegment, WorkloadSpec

REPO = Path(__file__).resolve().parents[1]
STUB_ENGINE = """#!{python}
# TEST DOUBLE for the engine venv's python: the stub server on the launcher's --port,
# logging vLLM's access and stats lines
import sys, threading, time
sys.path.insert(0, {repo!r})
argv = sys.argv[1:]
port = argv[argv.index("--port") + 1]
def noise():
    while True:
        time.sleep(0.05)
        print('(APIServer pid=1) INFO:     127.0.0.1:45678 - '
              '"POST /v1/completions HTTP/1.1" 200 OK', flush=True)
        print("(APIServer pid=1) INFO 12-05 10:00:00 [loggers.py:123] Engine 000: "
              "Avg prompt throughput: 1.0 tokens/s", flush=True)
threading.Thread(target=noise, daemon=True).start()
from jobs.stub.stubserver import main
main(["--host", "127.0.0.1", "--port", port, "--ttft-ms", "5", "--itl-ms", "20"])
"""


def one_run(work: Path, model: Path, engine: str) -> tuple[float, str, bool, bool, str]:
    """(seconds SIGSTOP -> result, status, partial, engine left, error) of one run."""
    work.mkdir(parents=True)
    workload = WorkloadSpec.model_validate(
        {"num_requests": 400, "prefix_tokens": 32, "output_tokens": 64, "warmup_requests": 1}
    )
    job = BatchJob(
        launch=EngineLaunch(
            engine_python=engine,
            model_dir=str(model),
            served_model_name="tiny",
            startup_timeout_s=600,
            log_path=str(work / "server.log"),
        ),
        segments=[RunSegment(run_id="hang", workload=workload)],
        scrape_interval_s=1.0,
        request_timeout_s=600,
    )
    stopped: dict[str, float] = {}
    pgid: list[int] = []

    def progress(p: Progress) -> None:
        if p.phase == "measuring" and p.requests_done >= 3 and not stopped:
            pid = _launcher_pid(work)
            os.kill(pid, signal.SIGSTOP)
            stopped["at"] = time.perf_counter()
            pgid.append(pid)

    [result] = execute_batch(job, progress=progress)
    took = time.perf_counter() - stopped["at"]
    left = bool(pgid and group_members(pgid[0]))
    return took, result.status, result.partial, left, result.error or ""


def _launcher_pid(work: Path) -> int:
    """The engine's launcher (its API server, the leader of its process group): the
    group leader whose working directory is ``work`` (the engine log's folder)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(work) and os.getpgid(pid) == pid:
                return pid
        except OSError:
            continue
    raise RuntimeError(f"no engine process runs in {work}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--engine", default=None, help="the engine python (default: the stub)")
    ap.add_argument("--show-error", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vlab-hang-"))
    model = generate_model(work / "tiny", "tiny", seed=0)
    engine = args.engine
    if engine is None:
        stub = work / "stub_engine"
        stub.write_text(STUB_ENGINE.format(python=sys.executable, repo=str(REPO)))
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
        engine = str(stub)
    times = []
    for i in range(args.runs):
        took, status, partial, left, error = one_run(work / f"run{i}", model, engine)
        times.append(took)
        print(f"run {i}: {took:.1f} s to {status}, partial={partial}, engine left={left}")
        if args.show_error and i == 0:
            print(error)
    print(f"median {statistics.median(times):.1f} s over {len(times)} runs")


if __name__ == "__main__":
    main()
