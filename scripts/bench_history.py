"""Time the run history (dashboard ``/`` and ``GET /api/v1/runs``) at two database sizes.

Usage: .venv/bin/python scripts/bench_history.py [--small 1000] [--large 50000]

Creates two scratch databases on the server of ``DATABASE_URL`` (default: the
machine's Postgres), fills them with finished runs carrying summary metrics
(``tests/web/seed.py:bulk_history``, 4 runs per experiment), and times each
query shape as the median of 7 requests through the real app (in-process
ASGI client, no network). Prints a table with the large/small ratio: a page
query whose cost does not grow with the history stays near 1x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from api.app import create_app  # noqa: E402
from orchestrator.core.db import scratch_database, upgrade_to_head  # noqa: E402
from orchestrator.core.settings import EngineSettings, Settings  # noqa: E402
from tests.web.seed import bulk_history  # noqa: E402

QUERIES = {
    "/ (newest first)": "/",
    "/ sort by TTFT p50": "/?sort=ttft_p50&dir=desc",
    "/ engine_arg filter": "/?engine_arg=enable_prefix_caching%3Dtrue",
    "/ status=failed": "/?status=failed",
    "/ experiment name": "/?experiment=bulk-000-0001",
    "/ date range (one day)": "/?since=2026-01-01&until=2026-01-01",
    "/ page 100": "/?page=100",
    "api runs sort hit rate": "/api/v1/runs?sort=hit_rate&limit=50",
}


def _seed(url: str, runs: int) -> None:
    upgrade_to_head(url)
    engine = create_engine(url)
    factory = sessionmaker(bind=engine)
    t0 = time.perf_counter()
    step = 500
    for first in range(0, runs // 4, step):
        with factory.begin() as s:
            bulk_history(
                s,
                experiments=min(step, runs // 4 - first),
                runs_per_experiment=4,
                name_prefix=f"bulk-{first // step:03d}",
            )
    with engine.connect() as c:
        c.execute(text("ANALYZE"))
        c.commit()
    print(f"  seeded {runs} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    engine.dispose()


def _time(url: str) -> dict[str, float]:
    home = Path(tempfile.mkdtemp())
    settings = Settings(home=home, engine=EngineSettings(python=home / "none"))
    engine = create_engine(url)
    out = {}
    with TestClient(create_app(settings, sessionmaker(bind=engine))) as client:
        for label, path in QUERIES.items():
            assert client.get(path).status_code == 200, path
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                client.get(path)
                times.append((time.perf_counter() - t0) * 1000)
            out[label] = statistics.median(times)
    engine.dispose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--large", type=int, default=50000)
    args = ap.parse_args()
    admin = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    results = {}
    for n in (args.small, args.large):
        with scratch_database(admin, "vlab_bench") as url:
            _seed(url, n)
            results[n] = _time(url)
    print(f"| query | {args.small} runs (ms) | {args.large} runs (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for label in QUERIES:
        a, b = results[args.small][label], results[args.large][label]
        print(f"| {label} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
