"""Time the run history (dashboard ``/``, ``GET /api/v1/runs``, exports) at two database sizes.

Usage: .venv/bin/python scripts/bench_history.py [--small 10000] [--large 1000000]
       [--keep] [--users 50] [--user-requests 10]

Fills a database per size on the server of ``DATABASE_URL`` (default: the machine's
Postgres) with finished runs carrying summary metrics, set-based
(``tests/web/seed.py:bulk_history_sql``, 4 runs per experiment; a million runs take
minutes), then times each query shape as the median of 7 requests through the real
app (in-process ASGI client, no network). Prints a table with the large/small ratio: a
page query whose cost does not grow with the history stays near 1x. Then ``--users``
concurrent dashboard users (threads, each its own HTTP client) against a real uvicorn
server (one process of its own) on each database, each loading ``--user-requests``
history pages (shapes in turn, no pause): the latency p50 and p99 over every request.

``--keep``: keep the databases (``vlab_bench_<runs>``) and reuse them on the next run
instead of seeding again (they are migrated to head either way).

``--export-runs N`` (default 20000; 0: skip): the streamed export of one experiment of
N/20 runs and of one of N runs (a scratch database of their own), CSV and Parquet:
the time and (in another export, traced) the peak memory Python allocated
(``tracemalloc``) of building the file (``orchestrator.analysis.service.export_file``):
what grows with the runs is the file (on disk past 2 MiB), not the memory.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.orm import sessionmaker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from api.app import create_app  # noqa: E402
from orchestrator.core.db import normalize_url, scratch_database, upgrade_to_head  # noqa: E402
from orchestrator.core.settings import EngineSettings, Settings  # noqa: E402
from tests.web.seed import bulk_history_sql  # noqa: E402

QUERIES = {
    "/ (newest first)": "/",
    "/ sort by TTFT p50": "/?sort=ttft_p50&dir=desc",
    "/ sort by TTFT p50, ascending": "/?sort=ttft_p50&dir=asc",
    "/ sort by started": "/?sort=started&dir=desc",
    "/ sort by duration": "/?sort=duration&dir=desc",
    "/ sort by experiment": "/?sort=experiment&dir=asc",
    "/ sort by status": "/?sort=status&dir=asc",
    "/ sort by change": "/?sort=variable&dir=desc",
    "/ engine_arg filter": "/?engine_arg=enable_prefix_caching%3Dtrue",
    "/ status=failed": "/?status=failed",
    "/ model filter": "/?model=bulk-model",
    "/ experiment name": "/?experiment=bulk-000-0001",
    "/ experiment name, any case": "/?experiment=BULK-000-0001",
    "/ experiment name, 2 % of experiments": "/?experiment=-0000",
    "/ experiment id": "/?experiment={exp}",
    "/ date range (one day)": "/?since=2026-01-01&until=2026-01-01",
    "/ page 100": "/?page=100",
    "/ page 100, sort by TTFT p50": "/?page=100&sort=ttft_p50",
    "api runs newest first": "/api/v1/runs?limit=50",
    "api runs sort hit rate": "/api/v1/runs?sort=hit_rate&limit=50",
    "api runs sort TTFT p99 asc": "/api/v1/runs?sort=ttft_p99&order=asc&limit=50",
    "api runs status=failed": "/api/v1/runs?status=failed&limit=50",
    "api runs experiment name": "/api/v1/runs?experiment=bulk-000-0001&limit=50",
    "api experiments list": "/api/v1/experiments?limit=50",
    "api experiments list, offset 2000": "/api/v1/experiments?limit=50&offset=2000",
    "api export CSV (one experiment)": "/api/v1/experiments/{exp}/export?format=csv",
    "api export Parquet (one experiment)": "/api/v1/experiments/{exp}/export?format=parquet",
}
#: shapes whose next page is a keyset cursor: timed on the page 100 pages in
CURSOR_QUERIES = {
    "api runs 100th page by cursor": "/api/v1/runs?limit=50",
    "api runs 100th page by cursor, hit rate": "/api/v1/runs?sort=hit_rate&limit=50",
}
USER_PATHS = [
    "/",
    "/?sort=ttft_p50&dir=desc",
    "/?status=failed",
    "/?engine_arg=enable_prefix_caching%3Dtrue",
    "/?page=20",
    "/?sort=hit_rate&dir=asc",
    "/?since=2026-02-01&until=2026-02-01",
    "/?experiment=bulk-001-0002",
]


def _seed(url: str, runs: int) -> None:
    engine = create_engine(url)
    with engine.connect() as c:
        have = c.scalar(text("SELECT count(*) FROM runs"))
    if have == runs:
        print(f"  reusing {runs} runs", file=sys.stderr)
        engine.dispose()
        return
    factory = sessionmaker(bind=engine)
    t0 = time.perf_counter()
    with factory.begin() as s:
        bulk_history_sql(s, experiments=runs // 4, runs_per_experiment=4)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text("VACUUM ANALYZE"))
    print(f"  seeded {runs} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    engine.dispose()


@contextmanager
def _database(admin: str, runs: int, keep: bool) -> Iterator[str]:
    if not keep:
        with scratch_database(admin, "vlab_bench") as url:
            upgrade_to_head(url)
            yield url
        return
    admin_url = make_url(normalize_url(admin))
    name = f"vlab_bench_{runs}"
    eng = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        if not c.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}):
            c.execute(text(f'CREATE DATABASE "{name}"'))
    eng.dispose()
    url = admin_url.set(database=name).render_as_string(hide_password=False)
    upgrade_to_head(url)
    yield url


def _app(url: str) -> FastAPI:
    home = Path(tempfile.mkdtemp())
    settings = Settings(home=home, engine=EngineSettings(python=home / "none"))
    return create_app(settings, sessionmaker(bind=create_engine(url, pool_size=20)))


def _median(client: TestClient, path: str) -> float:
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        assert client.get(path).status_code == 200, path
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _time(url: str) -> dict[str, float]:
    out = {}
    engine = create_engine(url)
    with engine.connect() as c:  # the experiment the export shapes read
        exp = c.scalar(text("SELECT id FROM experiments WHERE name = 'bulk-000-00001'"))
    engine.dispose()
    with TestClient(_app(url)) as client:
        for label, template in QUERIES.items():
            path = template.format(exp=exp)
            assert client.get(path).status_code == 200, path
            out[label] = _median(client, path)
        for label, path in CURSOR_QUERIES.items():
            nxt = path
            for _ in range(99):
                body = client.get(nxt).json()
                nxt = body["next"]
            out[label] = _median(client, nxt)
    return out


def _export_memory(admin: str, runs: int) -> list[tuple[int, str, float, float, float]]:
    """``(runs, format, ms, peak MiB, file MiB)`` of the export of an experiment of
    ``runs // 20`` runs and of one of ``runs`` (see ``--export-runs``)."""
    import tracemalloc  # deferred: only this measurement traces allocations

    from orchestrator.analysis.service import export_file

    out = []
    with scratch_database(admin, "vlab_bench_export") as url:
        upgrade_to_head(url)
        engine = create_engine(url)
        factory = sessionmaker(bind=engine)
        ids = {}
        for n in (runs // 20, runs):
            with factory.begin() as s:
                bulk_history_sql(
                    s, experiments=1, runs_per_experiment=n, name_prefix=f"x{n}", model=f"x{n}"
                )
                ids[n] = s.scalar(text(f"SELECT id FROM experiments WHERE name = 'x{n}-000-00000'"))
        for fmt in ("csv", "parquet"):
            with factory() as s:  # warm: imports, compiled statements
                export_file(s, ids[runs // 20], fmt)[0].close()
            for n, exp in ids.items():
                t0 = time.perf_counter()
                with factory() as s:
                    export_file(s, exp, fmt)[0].close()
                ms = (time.perf_counter() - t0) * 1000
                tracemalloc.start()  # another export: tracing slows allocations down
                with factory() as s:
                    body, size = export_file(s, exp, fmt)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                body.close()
                out.append((n, fmt, ms, peak / 2**20, size / 2**20))
        engine.dispose()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(url: str, port: int) -> None:
    """Serve the app on ``port`` (the concurrent-users measurement's server process)."""
    import uvicorn  # deferred: only the concurrent-users measurement serves over HTTP

    uvicorn.run(_app(url), host="127.0.0.1", port=port, log_level="warning")


def _users(url: str, users: int, each: int) -> tuple[float, float, float]:
    """``users`` threads, each with its own client, each loading ``each`` dashboard pages
    (no pause between them) from one uvicorn server process of its own (not sharing this
    process's interpreter lock): (p50 ms, p99 ms, pages/s)."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", url, "--port", str(port)], cwd=Path.cwd()
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(base + "/", timeout=30).raise_for_status()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)
        latencies: list[float] = []
        lock = threading.Lock()
        start = threading.Barrier(users)

        def user(k: int) -> None:
            with httpx.Client(base_url=base, timeout=120) as c:
                start.wait()
                for j in range(each):
                    path = USER_PATHS[(k + j) % len(USER_PATHS)]
                    t0 = time.perf_counter()
                    assert c.get(path).status_code == 200, path
                    with lock:
                        latencies.append((time.perf_counter() - t0) * 1000)

        workers = [threading.Thread(target=user, args=(k,)) for k in range(users)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=30)
    q = statistics.quantiles(latencies, n=100)
    return q[49], q[98], len(latencies) / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", type=int, default=10000)
    ap.add_argument("--large", type=int, default=1000000)
    ap.add_argument("--keep", action="store_true", help="keep and reuse vlab_bench_<runs>")
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--user-requests", type=int, default=10)
    ap.add_argument("--export-runs", type=int, default=20000, help="0: skip (see the docstring)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # internal: the users' server
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        _serve(args.serve, args.port)
        return
    admin = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    results = {}
    users = {}
    for n in (args.small, args.large):
        with _database(admin, n, args.keep) as url:
            _seed(url, n)
            results[n] = _time(url)
            if args.users:
                users[n] = _users(url, args.users, args.user_requests)
    print(f"| query | {args.small} runs (ms) | {args.large} runs (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for label in [*QUERIES, *CURSOR_QUERIES]:
        a, b = results[args.small][label], results[args.large][label]
        print(f"| {label} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    if users:
        print(
            f"\n{args.users} concurrent dashboard users, {args.user_requests} pages each, "
            "one uvicorn process:\n\n| runs | p50 (ms) | p99 (ms) | pages/s |"
            "\n|---:|---:|---:|---:|"
        )
        for n, (p50, p99, rate) in users.items():
            print(f"| {n} | {p50:.0f} | {p99:.0f} | {rate:.1f} |")
    if args.export_runs:
        print(
            "\nStreamed export of one experiment (export_file, peak of tracemalloc):\n\n"
            "| runs | format | ms | peak MiB | file MiB |\n|---:|---|---:|---:|---:|"
        )
        for n, fmt, ms, peak, size in _export_memory(admin, args.export_runs):
            print(f"| {n} | {fmt} | {ms:.0f} | {peak:.1f} | {size:.1f} |")


if __name__ == "__main__":
    main()
