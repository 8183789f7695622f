"""Reads while a run measures: p50/p99 of the same read mix, idle and during a run, one script run.

Usage::

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python scripts/bench_reads.py [--reads 2000] [--concurrency 32] \\
        [--history 200] [--split]

What it does, in order:

1. creates a scratch database on the server of ``DATABASE_URL`` and fills it with a
   history of ``--history`` real runs: copies of the demo experiment as the API served
   it after a real vLLM run (``tests/web/data/demo_experiment.json``: 4 runs with their
   resolved configuration, engine details, metrics, request records and time series,
   about 25 kB of JSON per run);
2. starts the service as an operator does, ``vlab up`` (one process: the API, the
   dispatcher and a local Ray of its own), on that database and a scratch
   ``VLAB_HOME``; the engine environment's python is a TEST DOUBLE (this script's
   ``engine`` command): ``serve`` answers with the project's stub server
   (:class:`jobs.stub.stubserver.StubServer`, 20 ms to the first token, 5 ms per token),
   everything else is the real launcher;
3. sends ``--reads`` GETs at ``--concurrency``, round robin over the mix
   ``GET /api/v1/runs`` (the first page of the run history), ``GET
   /api/v1/experiments/{id}`` (the newest copy) and ``GET /`` (the dashboard's history
   page),
   over HTTP from this process, with the service idle;
4. submits a one-run experiment through ``POST /api/v1/experiments`` (the tiny
   generated model, a long workload at concurrency 8), waits until it measures
   (request records reach the database), sends the same reads again, checks the run
   measured the whole time, and cancels it;
5. prints per phase p50, p99 and max latency, the status codes, and the ratio loaded /
   idle; and how many request records the run stored while the reads ran.

Compare the two phases as a ratio: both share the machine of the moment.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.core.db import scratch_database, upgrade_to_head  # noqa: E402
from tests.web.seed import load_export  # noqa: E402

ENGINE_ARGS = REPO / "tests" / "data" / "engine_args_vllm032cpu.json"
DEMO = REPO / "tests" / "web" / "data" / "demo_experiment.json"

SPEC: dict[str, Any] = {
    "name": "bench-reads-load",
    "description": "a run that measures while the reads run",
    "model": "tiny",
    "baseline": {
        "engine_args": {"max_model_len": 2048},
        "workload": {
            "num_requests": 20000,
            "concurrency": 8,
            "seed": 1,
            "prefix_tokens": 256,
            "output_tokens": 32,
            "warmup_requests": 1,
        },
    },
}


# --- the engine environment's python (TEST DOUBLE) -------------------------------------


def _engine_main(argv: list[str]) -> None:
    """``<engine python> jobs/launcher/vllm_launcher.py <command> ...``: ``serve`` runs the stub
    server, ``engine-args`` prints vLLM 0.32's (CPU build) list, the rest is the real
    launcher run by this interpreter (no vLLM here)."""
    command = argv[1] if len(argv) > 1 else ""
    if command == "engine-args":
        print(ENGINE_ARGS.read_text(), flush=True)
        return
    if command != "serve":
        os.execv(sys.executable, [sys.executable, *argv])
    from jobs.stub.stubserver import StubServer

    def opt(name: str, default: str) -> str:
        return argv[argv.index(name) + 1] if name in argv else default

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    host, port = opt("--host", "127.0.0.1"), int(opt("--port", "0"))
    with StubServer(0.020, 0.005, host, port, model=opt("--served-model-name", "model")):
        print("INFO [bench engine] SIMULATED vLLM; Application startup complete.", flush=True)
        stopping.wait()


def _write_engine_python(path: Path) -> Path:
    path.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="{REPO}" exec "{sys.executable}" "{Path(__file__).resolve()}" engine "$@"\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# --- the service ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _seed(url: str, history: int) -> str:
    upgrade_to_head(url)
    engine = create_engine(url)
    factory = sessionmaker(bind=engine)
    demo: dict[str, Any] = {}
    for i in range(max(1, history // 4)):  # 4 runs each, newest last
        with factory.begin() as s:
            demo = load_export(s, DEMO, name=f"demo-{i:04d}", shift=timedelta(minutes=i))
    with engine.connect() as c:
        c.execute(text("ANALYZE"))
        c.commit()
    engine.dispose()
    return str(demo["experiment_id"])


class Service:
    """``vlab up`` in its own process group (with the local Ray it starts); with ``split``,
    ``vlab serve`` (the API alone) and ``vlab orchestrate`` (the dispatcher and Ray) as two
    processes on the same database and home."""

    def __init__(self, url: str, home: Path, split: bool = False) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "DATABASE_URL": url,
            "VLAB_HOME": str(home),
            "VLAB_ENGINE__PYTHON": str(_write_engine_python(home / "engine-python")),
            "VLAB_ENGINE__RESOLVE_CONFIGS": "false",
            "RAY_ADDRESS": "local",  # a Ray of its own
        }
        env.pop("VLAB_TOKEN", None)
        vlab = str(Path(sys.executable).parent / "vlab")
        api = [vlab, "serve" if split else "up", "--host", "127.0.0.1", "--port", str(self.port)]
        commands = [api, [vlab, "orchestrate"]] if split else [api]
        self.logs = [(home / f"{c[1]}.log").open("ab") for c in commands]
        self.procs = [
            subprocess.Popen(c, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)
            for c, log in zip(commands, self.logs, strict=True)
        ]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[1]} exited ({proc.returncode}); see its log")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base}/healthz", timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"the API did not answer /healthz within {timeout_s:.0f} s")

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the process serving the API has used so far."""
        stat_ = Path(f"/proc/{self.procs[0].pid}/stat").read_text()
        fields = stat_.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # Ctrl-C: stops its runs and its Ray
                try:
                    proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    proc.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for log in self.logs:
            log.close()


# --- the reads --------------------------------------------------------------------------


async def _reads(base: str, paths: list[str], concurrency: int) -> tuple[list[float], Counter]:
    """GET every path of ``paths`` with ``concurrency`` requests in flight; latencies in ms."""
    latencies: list[float] = []
    codes: Counter = Counter()
    queue = iter(paths)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120) as client:

        async def worker() -> None:
            for path in queue:
                t0 = time.perf_counter()
                try:
                    r = await client.get(path)
                    await r.aread()
                    codes[r.status_code] += 1
                except httpx.HTTPError as exc:
                    codes[type(exc).__name__] += 1
                latencies.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, codes


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _phase(service: Service, paths: list[str], concurrency: int) -> dict[str, Any]:
    cpu0, t0 = service.cpu_s(), time.monotonic()
    latencies, codes = asyncio.run(_reads(service.base, paths, concurrency))
    wall = time.monotonic() - t0
    return {
        "p50": _pct(latencies, 50),
        "p99": _pct(latencies, 99),
        "max": max(latencies),
        "codes": dict(codes),
        "wall_s": wall,
        "service_cpu": (service.cpu_s() - cpu0) / wall,
    }


def _records(client: httpx.Client, run_id: str) -> int:
    return int(client.get(f"/api/v1/runs/{run_id}/requests", params={"limit": 1}).json()["total"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reads", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--history", type=int, default=200, help="real runs in the history")
    ap.add_argument(
        "--split",
        action="store_true",
        help="serve the API with `vlab serve` and run `vlab orchestrate` beside it",
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch home (its logs)")
    args = ap.parse_args()
    admin = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    home = Path(tempfile.mkdtemp(prefix="vlab-bench-reads-"))
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with scratch_database(admin, "vlab_bench") as url:
        demo_id = _seed(url, args.history)
        mix = ["/api/v1/runs", f"/api/v1/experiments/{demo_id}", "/"]
        paths = [mix[i % len(mix)] for i in range(args.reads)]
        service = Service(url, home, split=args.split)
        try:
            t0 = time.monotonic()
            service.wait_ready(300)
            say(f"the API answered in {time.monotonic() - t0:.1f} s (logs: {home})")
            client = httpx.Client(base_url=service.base, timeout=120)
            for path in mix:  # the first request of each pays for imports and caches
                assert client.get(path).status_code == 200, path
            idle = _phase(service, paths, args.concurrency)
            say(f"idle: p50 {idle['p50']:.0f} ms, p99 {idle['p99']:.0f} ms")

            created = client.post("/api/v1/experiments", json=SPEC)
            assert created.status_code == 201, created.text
            run_id = created.json()["runs"][0]["id"]
            deadline = time.monotonic() + 600
            while _records(client, run_id) < 50:
                status = client.get(f"/api/v1/runs/{run_id}").json()["status"]
                assert status in ("queued", "preparing", "running"), status
                assert time.monotonic() < deadline, "the run never measured"
                time.sleep(0.5)
            before = _records(client, run_id)
            loaded = _phase(service, paths, args.concurrency)
            stored = _records(client, run_id) - before
            status = client.get(f"/api/v1/runs/{run_id}").json()["status"]
            assert status == "running", f"the run ended during the reads: {status}"
            client.post(f"/api/v1/runs/{run_id}/cancel")
            client.close()
        finally:
            service.close()
    if not args.keep:
        for f in sorted(home.rglob("*"), reverse=True):
            with contextlib.suppress(OSError):
                f.rmdir() if f.is_dir() else f.unlink()
        with contextlib.suppress(OSError):
            home.rmdir()

    print(
        f"{args.reads} GETs at concurrency {args.concurrency} (runs list, one experiment, "
        f"history page; {args.history} runs in the history), service "
        f"{'`vlab serve` + `vlab orchestrate`' if args.split else '`vlab up`'}, "
        f"{os.cpu_count()} cores"
    )
    print("| phase | p50 (ms) | p99 (ms) | max (ms) | reads/s | API process CPU (cores) | codes |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, ph in (("idle", idle), ("a run measuring", loaded)):
        print(
            f"| {name} | {ph['p50']:.0f} | {ph['p99']:.0f} | {ph['max']:.0f} | "
            f"{args.reads / ph['wall_s']:.0f} | {ph['service_cpu']:.2f} | {ph['codes']} |"
        )
    print(
        f"ratio measuring / idle: p50 {loaded['p50'] / idle['p50']:.2f}x, "
        f"p99 {loaded['p99'] / idle['p99']:.2f}x; the run stored {stored} request records "
        f"while the reads ran ({stored / loaded['wall_s']:.0f}/s)"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        _engine_main(sys.argv[2:])
    else:
        main()
